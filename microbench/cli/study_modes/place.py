"""candidate placements of a mix ranked by predicted sigma; the first and last as plans to measure.

  microbench-study place --machine=testbed --jobs=dp:2 --jobs=dp:2 --jobs=fsdp:2 [--out=ranked/]
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from microbench.cli.study_modes import common
from microbench.study import generator, machines, ranking, workloads

FLAGS = flags.FLAGS

common.define_machine()
common.define_scales()
flags.DEFINE_multi_string("jobs", None, "One flag per job of the mix (required): STRATEGY:GPUS, e.g. dp:2 (the "
                          "nodes are the answer).")
flags.DEFINE_string("out", None, "A folder for the first- and last-ranked placements as plans (OUT/first, "
                    "OUT/last) for `run` to measure.")


def main(argv: list[str]) -> int:
  """Candidate placements of --jobs=STRATEGY:GPUS ... ranked by predicted worst, then mean sigma; with --out,
  the first- and last-ranked written as plans (OUT/first, OUT/last) for `run` to measure."""
  del argv
  if not FLAGS.jobs:
    raise app.UsageError("--jobs=STRATEGY:GPUS is required, once per job, e.g. --jobs=dp:2 --jobs=fsdp:4")
  jobs = []
  for text in FLAGS.jobs:
    strategy, _, gpus = text.partition(":")
    if not gpus.isdigit() or int(gpus) < 1 or "@" in text:
      raise app.UsageError(f"--jobs={text!r}: place wants STRATEGY:GPUS (e.g. dp:2); the nodes are its answer")
    jobs.append((strategy, int(gpus)))
  try:
    machine = machines.parse(FLAGS.machine, FLAGS.node_map)
    for strategy, _ in jobs:
      workloads.strategy(strategy)
    ranked = ranking.rank(machine, jobs, FLAGS.bytes_scale, FLAGS.compute_scale)
  except (machines.MachineError, workloads.WorkloadError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  print("| rank | worst sigma | mean sigma | jobs (class: nodes) | dominant links |")
  print("|---|---|---|---|---|")
  for i, e in enumerate(ranked, 1):
    desc = "; ".join(f"{j['strategy']}x{j['gpus']} {j['placement_class']}: {','.join(map(str, j['nodes']))}"
                     for j in e["jobs"])
    print(f"| {i} | {e['worst_sigma']:.3f} | {e['mean_sigma']:.3f} | {desc} |"
          f" {', '.join(x or '-' for x in e['links'])} |")
  if FLAGS.out:
    settings = generator.Settings(machine)
    for name, e in (("first", ranked[0]), ("last", ranked[-1])):
      generator.write(os.path.join(FLAGS.out, name), settings, [dict(_as_experiment(machine, e), id="e000")], {},
                      " ".join(sys.argv))
    common.say(f"first- and last-ranked placements written as plans to {FLAGS.out}/first and {FLAGS.out}/last")
  return 0


def _as_experiment(machine: machines.Machine, e: dict) -> dict:
  """A ranked candidate in the plan's experiment format (a hand-written mix on its nodes)."""
  exp = generator.manual(machine, [(j["strategy"], j["model"], j["nodes"]) for j in e["jobs"]])
  exp["pattern"] = dict(exp["pattern"], id="placed")
  return exp
