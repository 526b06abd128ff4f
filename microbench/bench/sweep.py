"""The sweep: every collective x scope x dtype x size, one point at a time, each recorded as it finishes."""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import time
from typing import Any

import jax
import numpy as np

from meshes.scopes import ScopePlan
from meshes.topology import Topology
from microbench.bench import collectives, hlo_check, program
from microbench.bench.sizes import round_count, sweep
from microbench.cluster import distributed, link_peaks
from microbench.output import run_folder, table
from microbench.output.run_folder import point_key


class JobFailed(RuntimeError):
  """Another process of a multi-process job failed: the remaining points can't be measured."""


STRAGGLER_SPREAD = 0.10  # cross-process spread of per-process median times, as a share of the median


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  collectives: tuple[str, ...]
  scopes: tuple[str, ...]
  dtypes: tuple[str, ...]
  min_bytes: int
  max_bytes: int
  step_factor: float
  iters: int
  warmup: int
  samples: int
  check: bool
  sample_s: float = 0.0  # > 0: fewer repetitions (down to 1) for operations that are already long
  inject_delay: tuple[int, float] | None = None  # (rank, seconds): fault injection for straggler tests
  inject_crash: tuple[int, int] | None = None    # (rank, point index): a rank that dies mid-sweep
  link_peaks: str | None = None  # --link_peaks: link peak per fabric level (else device-kind defaults)


def finished_points(records: list[dict[str, Any]]) -> set[tuple]:
  """Points a resumed run need not repeat: measured, or failed their HLO check (deterministic).
  Skipped points (e.g. out of memory) are tried again."""
  return {point_key(r) for r in records if r["status"] in ("ok", "error")}


def _gather(values: np.ndarray) -> np.ndarray:
  """[process, ...] stack of `values` from every process (identity for one process)."""
  if jax.process_count() == 1:
    return values[None]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(values, tiled=False))


def _stats(per_proc: np.ndarray) -> dict[str, Any]:
  """Sample time = slowest process's; spread = range of per-process medians over the median."""
  per_sample = per_proc.max(axis=0)
  med = float(np.median(per_sample))
  proc_medians = np.median(per_proc, axis=1)
  spread = float((proc_medians.max() - proc_medians.min()) / med) if med > 0 else 0.0
  return {
      "time_us": med * 1e6,
      "time_us_min": float(per_sample.min()) * 1e6,
      "time_us_p99": float(np.percentile(per_sample, 99)) * 1e6,
      "time_us_mean": float(per_sample.mean()) * 1e6,
      "time_spread": spread,
      "straggler": bool(spread > STRAGGLER_SPREAD),
      "slowest_rank": int(proc_medians.argmax()),
  }


def run_point(cfg: SweepConfig, mesh, plan: ScopePlan, coll: collectives.Collective, dtype: str,
              requested: int, barrier) -> dict[str, Any]:
  itemsize = np.dtype(program.DTYPES[dtype]).itemsize
  n = plan.group_size
  count = round_count(requested, itemsize, coll.count_multiple(n))
  platform = mesh.devices.flat[0].platform
  rec: dict[str, Any] = {
      "collective": coll.name, "scope": plan.name, "dtype": dtype, "requested_bytes": requested,
      "bytes": count * itemsize, "count": count, "group_size": n, "num_groups": plan.num_groups,
      "iters": cfg.iters, "samples": cfg.samples, "warmup": cfg.warmup, "impl": coll.impl(platform),
      "num_processes": jax.process_count(),
  }
  try:
    prog = program.build(coll, mesh, plan, count, dtype)
  except hlo_check.HloMismatch as e:
    return {**rec, "status": "error", "reason": f"HLO check failed: {e}"}
  except Exception as e:  # pylint: disable=broad-except
    return {**rec, "status": "skipped", "reason": f"compile failed: {type(e).__name__}: {_first_line(e)}"}
  rec["compile_s"] = prog.compile_s
  rec["hlo"] = prog.hlo_match.text[:400]
  try:
    wrong = program.check(prog, compare=cfg.check)
    if not cfg.check:
      wrong = None
    delay = cfg.inject_delay[1] if cfg.inject_delay and cfg.inject_delay[0] == jax.process_index() else 0.0
    iters = program.choose_iters(prog, cfg.iters, cfg.sample_s)
    if jax.process_count() > 1:  # every process must run the same program the same number of times
      iters = int(_gather(np.asarray([iters])).min())
    rec["iters"] = iters
    times = program.time_runs(prog, iters, cfg.warmup, cfg.samples, barrier, delay)
  except Exception as e:  # pylint: disable=broad-except
    # e.g. RESOURCE_EXHAUSTED: the point is lost, the sweep goes on.
    return {**rec, "status": "skipped", "reason": f"{type(e).__name__}: {_first_line(e)}"}
  all_times = _gather(times)
  if wrong is not None:
    wrong = int(_gather(np.asarray([wrong], np.int64)).sum())
  stats = _stats(all_times)
  algbw = rec["bytes"] / (stats["time_us"] * 1e-6) / 1e9
  return {**rec, **stats, "status": "ok", "wrong": wrong, "algbw_gbps": algbw,
          "busbw_gbps": algbw * coll.busbw_factor(n)}


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return text[0][:300] if text else ""


def run_sweep(cfg: SweepConfig, mesh, topology: Topology, plans: list[ScopePlan], out: run_folder.RunOutputs,
              done: set[tuple] = frozenset()) -> list[dict[str, Any]]:
  """Runs every point not in `done`, records each as it finishes, returns the records of this run."""
  sizes = sweep(cfg.min_bytes, cfg.max_bytes, cfg.step_factor)
  barrier = program.make_barrier(mesh)
  records: list[dict[str, Any]] = []
  active = [p for p in plans if not p.skip_reason]
  for p in plans:
    if p.skip_reason:
      out.print(f"# scope {p.name} skipped: {p.skip_reason}")
  blocks = [(c, p, d) for c in cfg.collectives for p in active for d in cfg.dtypes]
  peaks = link_peaks.resolve(mesh.devices.flat[0].device_kind, link_peaks.parse(cfg.link_peaks))
  extents = dict(zip(mesh.axis_names, mesh.devices.shape))
  total = len(blocks) * len(sizes)
  index = 0
  t_start = time.perf_counter()
  for bi, (cname, plan, dtype) in enumerate(blocks):
    coll = collectives.get(cname)
    peak = link_peaks.bus_peak(cname, plan.axes, extents, peaks)
    out.print(f"\n# [{bi + 1}/{len(blocks)}] {cname} over {plan.name}: {plan.num_groups} group(s) of "
              f"{plan.group_size}, {coll.impl(mesh.devices.flat[0].platform)}, busbw factor "
              f"{coll.busbw_factor(plan.group_size):.4g}" + (f", link peak {peak:.4g} GB/s busbw" if peak else ""))
    out.print("#" + table.HEADER[1:])
    out.print("#" + table.UNITS[1:])
    for size in sizes:
      index += 1
      key = (cname, plan.name, dtype, size)
      if key in done:
        continue
      if cfg.inject_crash and cfg.inject_crash[0] == jax.process_index() and index > cfg.inject_crash[1]:
        os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die like a lost node, no cleanup
      rec = run_point(cfg, mesh, plan, coll, dtype, size, barrier)
      if rec["status"] == "ok":
        rec.update(link_peaks.share(rec["busbw_gbps"], peak))
      rec["point"] = index
      rec["of_points"] = total
      rec["finished_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
      if (rec["status"] == "skipped" and jax.process_count() > 1
          and distributed.is_peer_failure(rec["reason"])):
        raise JobFailed(rec["reason"])  # not recorded: the point was never measured
      out.record(rec)
      records.append(rec)
      out.print(table.format_row(rec))
  out.print(f"\n# {len(records)} point(s) in {time.perf_counter() - t_start:.1f} s")
  return records
