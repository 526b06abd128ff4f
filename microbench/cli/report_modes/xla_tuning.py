"""`microbench-report RUN... --xla_perf_table=OUT.pbtxt` and `--xla_sol_options`: what XLA:GPU's scheduler
reads, written from the runs (docs/tuning.md)."""

from __future__ import annotations

import json
import os

from absl import app

from microbench.cli.report_modes import common

FLAGS = common.FLAGS
SOL_RECORD = "xla_sol_options.json"


def main(paths: list[str]) -> int:
  if not paths:
    raise app.UsageError("give the sweeps' run folders: microbench-report RUN [RUN ...] --xla_perf_table=OUT.pbtxt")
  from microbench.report import runs  # pylint: disable=import-outside-toplevel
  from microbench.tuning import xla_perf_table, xla_sol_fit  # pylint: disable=import-outside-toplevel
  try:
    sweeps, _ = runs.load(paths)  # once, for both outputs
    if FLAGS.xla_perf_table:
      _table(sweeps)
    if FLAGS.xla_sol_options:
      _sol(sweeps)
  except (runs.RunError, xla_perf_table.TableError, xla_sol_fit.FitError) as e:
    raise app.UsageError(str(e)) from None
  except OSError as e:
    raise app.UsageError(f"{e.filename}: {e.strerror or e}") from None
  return 0


def _table(sweeps: list) -> None:
  from microbench.tuning import xla_perf_table, xla_table_check  # pylint: disable=import-outside-toplevel
  key, entries, counts = xla_perf_table.from_sweeps(sweeps, FLAGS.xla_device_key)
  if any(s.meta.get("platform") != "gpu" for s in sweeps):
    print(f"microbench-report: a rehearsal: written from {sweeps[0].meta.get('platform')} runs under XLA's key"
          f" {key} (--xla_device_key); these are not {key} devices' times")
  if not entries:
    raise xla_perf_table.TableError(f"no point could go in ({'; '.join(counts.lines()) or 'no points'}): nothing"
                                    f" written to {FLAGS.xla_perf_table}")
  kept, replaced = xla_perf_table.write(FLAGS.xla_perf_table, key, entries)
  print(f"microbench-report: wrote {len(entries)} entries for {key} to {FLAGS.xla_perf_table} ({kept} kept from"
        f" the file, {replaced} replaced)")
  for line in counts.lines():
    print(f"microbench-report: {line}")
  per_node = int((sweeps[0].meta.get("topology") or {}).get("gpus") or 8)
  verdict = xla_table_check.check(FLAGS.xla_perf_table, key, per_node)
  for line in verdict.fatal + verdict.notes:
    print(f"microbench-report: {line}")
  print(f"microbench-report: use it with XLA_FLAGS=--xla_gpu_experimental_collective_perf_table_path="
        f"{os.path.abspath(FLAGS.xla_perf_table)}")


def _sol(sweeps: list) -> None:
  from microbench.tuning import xla_sol_fit  # pylint: disable=import-outside-toplevel
  machines = {(s.meta.get("device_kind"), (s.meta.get("topology") or {}).get("gpus")) for s in sweeps}
  if len(machines) != 1:
    raise xla_sol_fit.FitError(f"the runs are of {len(machines)} machines ({sorted(map(str, machines))}): fit one"
                               " machine's sweeps")
  device_kind, per_node = machines.pop()
  points, left = [], {}
  for s in sweeps:
    more, why = xla_sol_fit.points_from(s.records, s.meta)
    points += more
    for k, n in why.items():
      left[k] = left.get(k, 0) + n
  f = xla_sol_fit.fit(points, int(per_node or 8), xla_sol_fit.defaults_for(device_kind))
  for k, v in f.options.items():
    print(f"microbench-report: {k} = {xla_sol_fit.fmt(k, v)}  ({f.how[k]})")
  print(f"microbench-report: over {f.points} points across nodes the options reproduce the measured times within"
        f" {f.median_error:.1%} (median) and {f.max_error:.1%} (worst); worst per collective: "
        + ", ".join(f"{c} {e:.1%}" for c, e in f.worst_by_collective().items()))
  for why, n in sorted(left.items()):
    print(f"microbench-report: left out {n} point(s): {why}")
  print(f"XLA_FLAGS='{f.xla_flags()}'")
  out = FLAGS.out or sweeps[0].path
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, SOL_RECORD), "w", encoding="utf-8") as fh:
    json.dump({**f.record(), "runs": [s.path for s in sweeps], "device_kind": device_kind}, fh, indent=1)
  print(f"microbench-report: recorded in {os.path.join(out, SOL_RECORD)}")
