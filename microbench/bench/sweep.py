"""The sweep: every collective x scope x dtype x distinct size, one point at a time, each recorded as it
finishes, every device step under the watchdog's deadline."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
import dataclasses
from concurrent import futures
import datetime
import os
import signal
import time
from typing import Any

import jax
import numpy as np

from microbench.meshes.scopes import ScopePlan
from microbench.bench import collectives, command_buffer, hlo_check, overlap, program, tpu_peaks
from microbench.bench.sizes import round_count, sweep
from microbench.cluster import distributed
from microbench.fabric import expected as fabric_expected
from microbench.fabric import link_peaks
from microbench.cluster.watchdog import Watchdog, deadline
from microbench.output import rank_times, run_folder, table
from microbench.output.run_folder import point_keys
from microbench.aot import gpu_compile


class JobFailed(RuntimeError):
  """Another process of a multi-process job failed: the remaining points can't be measured."""


class PointFailed(RuntimeError):
  """A point's program failed to compile or run and the user did not ask to keep going (--keep_going)."""


STRAGGLER_SPREAD = 0.10  # cross-process spread of per-process median times, as a share of the median
DEADLINE_FACTOR = 10.0   # a device step may take this many times its expected duration


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  collectives: tuple[str, ...]
  scopes: tuple[str, ...]
  dtypes: tuple[str, ...]
  min_bytes: int
  max_bytes: int | None  # None: sizes.default_max_bytes(platform), resolved by the run
  step_factor: float
  iters: int      # operations in the long arm (upper bound with sample_s); 1 = latency mode
  warmup: int
  samples: int
  check: bool
  sample_s: float = 0.0  # > 0: fewer operations in the long arm for operations that are already long
  hang_timeout: float = 120.0  # floor of every device step's deadline (seconds)
  inject_delay: tuple[int, float] | None = None  # (rank, seconds per operation): a slow rank
  inject_crash: tuple[int, int] | None = None    # (rank, point index): a rank that dies mid-sweep
  link_peaks: str | None = None  # --link_peaks: link peak per fabric level (else device-kind defaults)
  fabric: str | None = None  # --fabric: a described machine whose links give the peaks (--link_peaks wins)
  inject_hang: tuple[int, int] | None = None     # (rank, point index): a rank stuck in point index+1
  target: str | None = None        # --target: compile for this GPU kind's compile-only devices, run nothing
  device_memory: int | None = None  # bytes per device of the target (what a compiled point must fit in)
  memory_fraction: float | None = None  # the share of it JAX uses (None: a GPU's, gpu_compile.mem_fraction())
  profile_points: tuple[int, ...] = ()  # --profile_points: point numbers (as printed, from 1) to trace
  profile_dir: str | None = None    # where the traces go (the run folder: TensorBoard's Profile tab)
  keep_going: bool = False  # --keep_going: a failed point is recorded and the sweep goes on (else it stops)
  nccl_debug: bool = False  # --nccl_debug: NCCL's INFO log of every process into the run folder, read into meta
  command_buffer: str = "no"  # --command_buffer: XLA:GPU's command buffers off, on, or both arms timed
  overlap: int | str | None = None  # --overlap: overlap.AUTO or a matmul dimension (None: off), overlap.py

  @property
  def latency_mode(self) -> bool:
    return self.iters == 1


def finished_points(records: list[dict[str, Any]]) -> set[tuple]:
  """Points a resumed run need not repeat: measured, compiled for a target, or failed their HLO check
  (deterministic).
  Failed points (a compile or run failure, out of memory, a hang; `skipped` in older runs) are tried again."""
  return {k for r in records if r["status"] in ("ok", "error", "compiled") for k in point_keys(r)}


def _gather(values: np.ndarray) -> np.ndarray:
  """[process, ...] stack of `values` from every process (identity for one process)."""
  if jax.process_count() == 1:
    return values[None]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(values, tiled=False))


WRONG_AT_KEPT = 8  # ranks per process whose first wrong element a record names


def _wrong_at(local: list[dict[str, int]]) -> list[dict[str, int]]:
  """Every process's first wrong elements (check run, group, group rank, wrong count, first index), gathered."""
  keys = ("run", "group", "rank", "wrong", "first")
  rows = np.full((WRONG_AT_KEPT, len(keys)), -1, np.int64)
  for i, w in enumerate(local[:WRONG_AT_KEPT]):
    rows[i] = [w[k] for k in keys]
  every = _gather(rows).reshape(-1, len(keys))
  return [dict(zip(keys, map(int, row))) for row in every if row[3] > 0]


def _spread(per_proc: np.ndarray) -> dict[str, Any]:
  """Cross-process spread of per-process median per-operation times ([process, sample], seconds), and every
  process's own times, compact (rank_times: `microbench-report --ranks` names the slow process and node)."""
  proc_medians = np.median(per_proc, axis=1)
  med = float(np.median(per_proc.max(axis=0)))
  spread = float((proc_medians.max() - proc_medians.min()) / med) if med > 0 else 0.0
  return {"time_spread": spread, "straggler": bool(spread > STRAGGLER_SPREAD),
          "slowest_rank": int(proc_medians.argmax()), **rank_times.encode(per_proc * 1e6)}


def difference_stats(t_short: np.ndarray, t_long: np.ndarray, reps_short: int, reps_long: int) -> dict[str, Any]:
  """Per-operation statistics from [process, sample] call times of the two arms.

  A sample's call time is the slowest process's; each alternating pair gives one per-operation time
  (T_long - T_short) / (reps_long - reps_short). If the median of those is not positive the difference did
  not resolve the operation above the per-call noise: the long arm's average (an upper bound that includes
  the per-call costs) is reported instead, and the method says so.
  """
  s, l = t_short.max(axis=0), t_long.max(axis=0)
  per_op = (l - s) / (reps_long - reps_short)
  med = float(np.median(per_op))
  out: dict[str, Any] = {
      "call_us_short": float(np.median(s)) * 1e6, "call_us_long": float(np.median(l)) * 1e6,
      "samples_us": [float(v) * 1e6 for v in per_op],
  }
  if med > 0:
    out.update(time_method="difference", time_us=med * 1e6, time_us_min=float(per_op.min()) * 1e6,
               time_us_max=float(per_op.max()) * 1e6, time_us_mean=float(per_op.mean()) * 1e6,
               call_overhead_us=(float(np.median(s)) - reps_short * med) * 1e6)
    out.update(_spread((t_long - t_short) / (reps_long - reps_short)))
    out.update(resolution(per_op))
  else:
    avg = l / reps_long
    out.update(time_method="long-arm average (difference unresolved)", time_us=float(np.median(avg)) * 1e6,
               time_us_min=float(avg.min()) * 1e6, time_us_max=float(avg.max()) * 1e6,
               time_us_mean=float(avg.mean()) * 1e6, samples_us=[float(v) * 1e6 for v in avg])
    out.update(_spread(t_long / reps_long))
  return out


def longer_reps(reps: int, stats: dict[str, Any], iters: int) -> int | None:
  """The long arm's operations that would bring a very noisy point's resolution to NOISE_LIMIT (the per-call
  noise is divided by the added operations), when --sample_ms had capped it below --iters; None otherwise.
  At most --iters: a point measured at --iters is flagged, not retried (the sweep's time stays bounded)."""
  if (stats.get("time_method") != "difference" or reps >= iters
      or not stats.get("resolution", 0) > RETRY_LIMIT):
    return None
  added = (reps - program.SHORT_REPS) * min(stats["resolution"], 1e3) / NOISE_LIMIT
  want = int(min(iters, program.SHORT_REPS + np.ceil(added)))
  want -= want % 2
  return want if want > reps else None


def _resolved(reps_short: int, reps_long: int):
  """time_pairs' early stop: the pairs so far, gathered from every process, resolve the median per-operation
  time to NOISE_LIMIT with every sample positive (the same answer on every process)."""
  def resolved(t_short: np.ndarray, t_long: np.ndarray) -> bool:
    s, l = _gather(t_short).max(axis=0), _gather(t_long).max(axis=0)
    per_op = (l - s) / (reps_long - reps_short)
    return float(np.median(per_op)) > 0 and not resolution(per_op)["noisy"]
  return resolved


RETRY_LIMIT = 0.10  # ... and timed once more, longer, past this (when --sample_ms had capped it)
NOISE_LIMIT = 0.05  # a point is NOISY when its median's 95% interval is wider than this share of it (each side)


def resolution(per_op: np.ndarray) -> dict[str, Any]:
  """How well the samples resolve the median per-operation time: the half-width of its 95% interval relative
  to it (McGill's notch, 1.57 IQR / sqrt(N)), `noisy` past NOISE_LIMIT, and also when the samples disagree on
  its sign (a difference smaller than the per-call noise: a negative per-call overhead, say)."""
  med = float(np.median(per_op))
  q25, q75 = np.percentile(per_op, [25, 75])
  rel = float(1.57 * (q75 - q25) / np.sqrt(len(per_op)) / med) if med > 0 else float("inf")
  return {"resolution": rel, "noisy": bool(rel > NOISE_LIMIT or (per_op <= 0).any())}


def latency_stats(t_calls: np.ndarray) -> dict[str, Any]:
  """Latency mode: one operation per call, percentiles over single operations ([process, sample])."""
  per_sample = t_calls.max(axis=0)
  q = np.percentile(per_sample, [50, 90, 99]) * 1e6
  return {"time_method": "latency (one operation per call, dispatch included)",
          "time_us": float(np.median(per_sample)) * 1e6, "time_us_min": float(per_sample.min()) * 1e6,
          "time_us_max": float(per_sample.max()) * 1e6, "time_us_mean": float(per_sample.mean()) * 1e6,
          "time_us_p50": float(q[0]), "time_us_p90": float(q[1]), "time_us_p99": float(q[2]),
          "samples_us": [float(v) * 1e6 for v in per_sample], **_spread(t_calls)}


class _Guard:
  """The watchdog's view of the point in progress (a no-op without a watchdog)."""

  def __init__(self, dog: Watchdog | None, floor_s: float, rec: dict[str, Any]):
    self.dog, self.floor_s, self.rec = dog, floor_s, rec

  def __call__(self, label: str, expected_s: float = 0.0):
    if self.dog is None:
      return contextlib.nullcontext()
    return self.dog.guard(label, deadline(expected_s, self.floor_s, DEADLINE_FACTOR), self.rec)


def _hang_here(cfg: SweepConfig, index: int) -> bool:
  return bool(cfg.inject_hang and cfg.inject_hang[0] == jax.process_index() and index == cfg.inject_hang[1] + 1)


class _HloFailed(Exception):
  """An HLO check failed at one stage of a point: the point is recorded as an error naming the stage."""

  def __init__(self, error: hlo_check.HloMismatch, stage: str | None):
    super().__init__(str(error))
    self.error, self.stage = error, stage


@contextlib.contextmanager
def _hlo_stage(stage: str | None = None):
  """Marks HLO checks failing inside with `stage` (run_point records them, the sweep goes on)."""
  try:
    yield
  except hlo_check.HloMismatch as e:
    raise _HloFailed(e, stage) from e


def _hlo_error(rec: dict[str, Any], failed: _HloFailed) -> dict[str, Any]:
  where = f" ({failed.stage})" if failed.stage else ""
  return {**rec, "status": "error", "reason": f"HLO check failed{where}: {failed.error}"}


@dataclasses.dataclass
class _PointRun:
  """One point on its way: what it runs on, its record so far and the watchdog's view of it."""
  cfg: SweepConfig
  mesh: Any
  plan: ScopePlan
  coll: collectives.Collective
  dtype: str
  count: int
  platform: str
  rec: dict[str, Any]
  guard: _Guard
  barrier: Any
  index: int
  expected_op_s: float  # seconds per operation, once known (the probe raises it): sizes the deadlines
  delay: float = 0.0  # fault injection: seconds this process adds per operation
  arm: command_buffer.Arm | None = None  # XLA:GPU's command buffers of the first arm (None off GPUs)

  def op_s(self) -> float:
    return self.expected_op_s + self.delay


def _point_record(cfg: SweepConfig, plan: ScopePlan, coll: collectives.Collective, dtype: str, requested: int,
                  count: int, itemsize: int, platform: str, index: int, total: int,
                  also_requested: tuple[int, ...]) -> dict[str, Any]:
  rec: dict[str, Any] = {
      "collective": coll.name, "scope": plan.name, "dtype": dtype, "requested_bytes": requested,
      "bytes": count * itemsize, "count": count, "group_size": plan.group_size, "num_groups": plan.num_groups,
      "iters": cfg.iters, "samples": cfg.samples, "warmup": cfg.warmup,
      "impl": coll.impl(platform) + (", in place" if coll.inplace else ""),
      **({"op": coll.redop} if coll.redop else {}), **({"inplace": True} if coll.inplace else {}),
      **({"root": coll.root} if coll.root is not None else {}),
      "num_processes": jax.process_count(), "point": index, "of_points": total,
  }
  if also_requested:
    rec["also_requested"] = list(also_requested)
  return rec


def run_point(cfg: SweepConfig, mesh, plan: ScopePlan, coll: collectives.Collective, dtype: str,
              requested: int, barrier, watchdog: Watchdog | None = None, expected_op_s: float = 0.0,
              index: int = 0, total: int = 0, also_requested: tuple[int, ...] = ()) -> dict[str, Any]:
  """Measures one point. `expected_op_s` (from the block's previous point, 0 if none) sizes the watchdog's
  deadlines and, when known, the long arm, so all three programs compile at once."""
  itemsize = np.dtype(program.DTYPES[dtype]).itemsize
  count = round_count(requested, itemsize, coll.count_multiple(plan.group_size))
  platform = program.platform_of(mesh)
  rec = _point_record(cfg, plan, coll, dtype, requested, count, itemsize, platform, index, total, also_requested)
  p = _PointRun(cfg, mesh, plan, coll, dtype, count, platform, rec, _Guard(watchdog, cfg.hang_timeout, rec),
                barrier, index, expected_op_s)
  p.delay = cfg.inject_delay[1] if cfg.inject_delay and cfg.inject_delay[0] == jax.process_index() else 0.0
  p.arm = command_buffer.main_arm(cfg.command_buffer, platform)  # None off GPUs
  if p.arm is not None:
    rec["command_buffer"] = cfg.command_buffer
  reps = None
  if cfg.target and not cfg.latency_mode:
    reps = max(program.MIN_LONG_REPS, cfg.iters - cfg.iters % 2)  # nothing runs: the long arm at --iters
  elif not cfg.latency_mode and expected_op_s > 0:
    reps = program.long_reps(expected_op_s, cfg.iters, cfg.sample_s)
  try:
    return _compiled_and_measured(p, reps)
  except _HloFailed as failed:
    return _hlo_error(rec, failed)


def _compiled_and_measured(p: _PointRun, reps: int | None) -> dict[str, Any]:
  """The point's programs compiled (a failure recorded), then compiled facts for a target or the measurement."""
  cfg, rec = p.cfg, p.rec
  t0 = time.perf_counter()
  try:
    with _hlo_stage():
      point, short, long = _compile_point(cfg, p.coll, p.mesh, p.plan, p.count, p.dtype, reps, p.arm)
  except _HloFailed:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if cfg.target and "RESOURCE_EXHAUSTED" in str(e):  # XLA's own refusal to place the buffers: does not fit
      return {**rec, "status": "compiled", "target": cfg.target, "programs": {}, "fits": False,
              "memory_bytes": None, "device_memory_bytes": cfg.device_memory, "usable_bytes": cfg.device_memory,
              "reason": f"XLA refused to compile it for the target's memory: {_first_line(e)}"}
    return {**rec, "status": "failed", "reason": f"compile failed: {type(e).__name__}: {_first_line(e)}"}
  rec.update(compile_s=time.perf_counter() - t0, hlo=point.check_prog.verified.match.text[:400],
             wire_dtype=point.wire_dtype, check_runs=point.check_runs)
  if p.coll.inplace:  # XLA runs some ops out of place: in place then costs a copy of the message per operation
    rec["inplace_copies_per_op"] = point.check_prog.verified.copies
  if cfg.target:
    return _target_point(p, point, short, long, reps)
  try:
    stats, wrong = _measured(p, point, short, long)
  except _HloFailed:
    raise
  except Exception as e:  # pylint: disable=broad-except
    # e.g. RESOURCE_EXHAUSTED: the point is lost; the sweep stops after recording it, or with --keep_going
    # goes on (run_sweep decides).
    return {**rec, "status": "failed", "reason": f"run failed: {type(e).__name__}: {_first_line(e)}"}
  algbw = rec["bytes"] / (stats["time_us"] * 1e-6) / 1e9
  return {**rec, **stats, "status": "ok", "wrong": wrong, "algbw_gbps": algbw,
          "busbw_gbps": algbw * p.coll.busbw_factor(p.plan.group_size, p.count)}


def _target_point(p: _PointRun, point: program.Point, short: program.Compiled | None,
                  long: program.Compiled | None, reps: int | None) -> dict[str, Any]:
  """A compile-only point: its programs' facts (with --command_buffer=both, the command-buffer programs too;
  with --overlap, the both arm's schedule)."""
  cfg = p.cfg
  with _hlo_stage("command buffers"):  # --command_buffer=both: the same programs with command buffers
    extra = _command_buffer_programs(cfg, point, reps) if cfg.command_buffer == "both" else {}
  if not cfg.overlap:
    return compiled_record(cfg, p.rec, point, short, long, extra)
  with _hlo_stage("overlap arms"):  # the both arm compiled beside the point's programs, its schedule read
    return {**compiled_record(cfg, p.rec, point, short, long, extra),
            **overlap.compiled_facts(cfg.overlap, p.coll, p.mesh, p.plan, p.count, p.dtype, long)}


def _measured(p: _PointRun, point: program.Point, short: program.Compiled | None,
              long: program.Compiled | None) -> tuple[dict[str, Any], int | None]:
  """The check, the timed runs and what follows them; (the time statistics, wrong elements of the check)."""
  cfg, rec = p.cfg, p.rec
  t_check = time.perf_counter()
  with p.guard("correctness check", p.expected_op_s):
    wrong = program.check(point, compare=cfg.check)
    wrong = int(_gather(np.asarray([wrong], np.int64)).sum()) if cfg.check else None
    if wrong:
      rec["wrong_at"] = _wrong_at(point.wrong_at)
  rec["check_s"] = time.perf_counter() - t_check  # inputs made, the check program run and compared
  if cfg.latency_mode:
    stats = _latency_runs(p, point)
  else:
    stats, long = _difference_runs(p, point, short, long)
    if cfg.overlap:  # the collective beside a matmul: three arms, timed interleaved (overlap.py)
      _overlap_arms(p, point, short, long, stats)
    if p.index in cfg.profile_points and cfg.profile_dir:
      with p.guard("profiled runs", (short.reps + long.reps) * p.op_s()):
        rec["profile"] = profile_point(point, short, long, cfg.profile_dir, describe_point(rec))
  if p.arm is not None and p.arm.check:  # where XLA:GPU runs the collective and the loop, per arm and program
    rec["command_buffer_placement"] = {p.arm.name: _placement(point, short, long)}
  if cfg.command_buffer == "both":  # the programs again, in command buffers: time_us_command_buffer
    wrong = _second_arm(p, point, short, long, wrong)
  return stats, wrong


def _latency_runs(p: _PointRun, point: program.Point) -> dict[str, Any]:
  """Latency mode: single operations timed, each call's output checked by digest."""
  cfg, rec = p.cfg, p.rec
  with p.guard("timed runs", (cfg.warmup + cfg.samples) * p.op_s()):
    if _hang_here(cfg, p.index):
      time.sleep(1e9)  # fault injection: a collective that never returns
    times, timed_wrong = program.time_calls(point, cfg.warmup, cfg.samples, p.barrier, p.delay)
    times = _gather(times)
  stats = latency_stats(times)
  if cfg.check:
    rec["timed_wrong"] = int(_gather(np.asarray([timed_wrong], np.int64)).sum())
    rec["timed_check"] = f"every one of the {cfg.samples} timed calls' output compared (digests)"
  return stats


def _probed_long(p: _PointRun, point: program.Point) -> program.Compiled:
  """The first point of a block: the long arm sized from one measured call, compiled (and raises the
  expected time per operation to that call's)."""
  cfg = p.cfg
  with p.guard("probe run", p.expected_op_s):
    call_s = program.call_time(point)
  reps = program.long_reps(call_s, cfg.iters, cfg.sample_s)
  if jax.process_count() > 1:  # every process must run the same programs
    with p.guard("agreeing on repetitions"):
      reps = int(_gather(np.asarray([reps])).min())
  t1 = time.perf_counter()
  with _hlo_stage("timed program"):
    long = _submit_long(_compile_pool(), cfg, p.coll, p.mesh, p.plan, p.count, p.dtype, reps, p.arm)()
  p.rec["compile_s"] += time.perf_counter() - t1
  p.expected_op_s = max(p.expected_op_s, call_s)
  return long


def _difference_runs(p: _PointRun, point: program.Point, short: program.Compiled, long: program.Compiled | None
                     ) -> tuple[dict[str, Any], program.Compiled]:
  """The short and long arms timed in alternating pairs (once more, longer, when --sample_ms capped the long arm
  below what resolves the operation), then their own output checked; (the statistics, the long arm timed)."""
  cfg, rec, coll, n = p.cfg, p.rec, p.coll, p.plan.group_size
  if long is None:  # first point of a block: size the long arm from one measured call
    long = _probed_long(p, point)
  rec["iters"], rec["short_iters"] = long.reps, short.reps
  rec["trip_count"] = max(long.verified.trip_counts, default=None)
  rec["body_writes"] = long.verified.body_writes  # elements the loop body writes besides the collective
  if shape := program.form(coll, p.count, n, long):  # the platform's form of the op: part of what is timed
    rec["form"] = shape
  if coll.inplace:
    rec["inplace_copies_per_op"] = long.verified.copies / long.reps
  carry = program.initial_carry(point)
  graphs = command_buffer.GRAPH_WARMUP if p.arm is not None and p.arm.on else 0  # --command_buffer=yes
  period = coll.period(n)
  untimed = len(program.untimed_calls(cfg.warmup, short.reps, long.reps, period))
  with p.guard("timed runs", (untimed + cfg.samples) * (short.reps + long.reps) * p.op_s()):
    if _hang_here(cfg, p.index):
      time.sleep(1e9)  # fault injection: a collective that never returns
    t_short, t_long, carry = program.time_pairs(short, long, carry, cfg.warmup, cfg.samples, p.barrier, p.delay,
                                                _resolved(short.reps, long.reps), graphs, period)
    t_short, t_long = _gather(t_short), _gather(t_long)
  stats = difference_stats(t_short, t_long, short.reps, long.reps)
  more = longer_reps(long.reps, stats, cfg.iters)
  if more:  # --sample_ms capped the long arm below what resolves the operation: once more, longer
    with _hlo_stage("timed program"):
      long = program.build_timed(coll, p.mesh, p.plan, p.count, p.dtype, more, command_buffer=p.arm)
    with p.guard("timed runs", (untimed + cfg.samples) * (short.reps + more) * p.op_s()):
      t_short, t_long, carry = program.time_pairs(short, long, program.initial_carry(point), cfg.warmup,
                                                  cfg.samples, p.barrier, p.delay, _resolved(short.reps, more),
                                                  graphs, period)
      t_short, t_long = _gather(t_short), _gather(t_long)
    rec.update(iters=long.reps, iters_first=rec["iters"], resolution_first=stats.get("resolution"))
    stats = difference_stats(t_short, t_long, short.reps, long.reps)
  rec["samples"] = int(t_long.shape[1])  # pairs taken (--samples is the most)
  if cfg.check:  # the timed calls' own output: their checked twins' every repetition, the final carry
    _check_timed(p, point, short, long, carry, graphs, period)
  del carry
  return stats, long


def _check_timed(p: _PointRun, point: program.Point, short: program.Compiled, long: program.Compiled, carry,
                 graphs: int, period: int) -> None:
  """The timed calls' own output: their checked twins' every repetition and the final carry; with no known
  output, the plain programs replayed beside their twins."""
  rec, n = p.rec, p.plan.group_size
  t_timed_check = time.perf_counter()
  reps, digested = program.chain_reps(p.cfg.warmup, rec["samples"], short.reps, long.reps, graphs, period)
  timed_wrong, rec["timed_check"] = program.check_timed(point, carry, reps, digested)
  if p.coll.compared_to_op(n, p.platform):  # no known output: the plain programs replayed beside their twins
    with p.guard("replayed timed programs", 4 * (short.reps + long.reps) * p.op_s()):
      replay_wrong, replayed = program.replay_check(point, short, long)
    timed_wrong += replay_wrong
    rec["timed_check"] += f"; {replayed}"
  rec["timed_check_s"] = time.perf_counter() - t_timed_check
  rec["timed_wrong"] = None if timed_wrong is None else int(_gather(np.asarray([timed_wrong], np.int64)).sum())


def _overlap_arms(p: _PointRun, point: program.Point, short: program.Compiled, long: program.Compiled,
                  stats: dict[str, Any]) -> None:
  """--overlap: the collective beside a matmul, three arms timed interleaved (overlap.py); a wrong arm fails
  the run as a wrong timed program does."""
  cfg, rec = p.cfg, p.rec
  arms_s = 4 * (cfg.warmup + cfg.samples) * (short.reps + long.reps) * p.op_s()
  with _hlo_stage("overlap arms"), p.guard("overlap arms", arms_s):
    rec.update(overlap.measure(cfg.overlap, point, short, long, stats["time_us"] * 1e-6, cfg.warmup,
                               cfg.samples, p.barrier, _gather, check=cfg.check))
  if overlap.wrong(rec):
    rec["timed_wrong"] = (rec.get("timed_wrong") or 0) + overlap.wrong(rec)


def _second_arm(p: _PointRun, point: program.Point, short: program.Compiled | None, long: program.Compiled | None,
                wrong: int | None) -> int | None:
  """--command_buffer=both: the programs again in command buffers, timed after the first arm; returns the
  check's wrong elements with the second arm's added (a wrong second arm fails the run too)."""
  cfg, rec = p.cfg, p.rec
  ops = 1 if cfg.latency_mode else short.reps + long.reps
  with _hlo_stage("command buffers"):
    with p.guard("timed runs with command buffers", (cfg.warmup + cfg.samples) * ops * p.op_s()):
      second = _command_buffer_arm(cfg, point, short, long, p.barrier, p.delay)
  placement = second.pop("placement")
  if any(placement.values()):
    rec.setdefault("command_buffer_placement", {})["yes"] = placement
  rec.update(second)
  algbw_cb = rec["bytes"] / (second["time_us_command_buffer"] * 1e-6) / 1e9
  rec.update(algbw_gbps_command_buffer=algbw_cb,
             busbw_gbps_command_buffer=algbw_cb * p.coll.busbw_factor(p.plan.group_size, p.count))
  if wrong is not None and second.get("wrong_command_buffer") is not None:
    wrong += second["wrong_command_buffer"]
  if rec.get("timed_wrong") is not None and second.get("timed_wrong_command_buffer") is not None:
    rec["timed_wrong"] += second["timed_wrong_command_buffer"]
  return wrong


def profile_point(point: program.Point, short: program.Compiled, long: program.Compiled, profile_dir: str,
                  label: str) -> str | None:
  """One call of each timed program under jax.profiler, after the point's timed runs and checks (the trace
  costs nothing that is measured), from fresh known inputs. Every process runs the calls (a collective needs
  all of them); process 0 writes the trace into `profile_dir`/plugins/profile, which TensorBoard's Profile
  tab shows with the collective's kernels. Returns where (process 0) or None."""
  carry = program.initial_carry(point)
  tracing = jax.process_index() == 0
  if tracing:
    jax.profiler.start_trace(profile_dir)
  try:
    with jax.profiler.TraceAnnotation(f"microbench {label}"):
      # Each program call a step (step 0: the short program, 1: the long one), so the Profile tab's
      # Overview Page has step times instead of "no step marker observed" and zeros.
      for step, prog in enumerate((short, long)):
        with jax.profiler.StepTraceAnnotation(f"{prog.reps} operations", step_num=step):
          carry = prog.fn(*carry)
          jax.block_until_ready(carry)
  finally:
    if tracing:
      jax.profiler.stop_trace()
  return os.path.join(profile_dir, "plugins", "profile") if tracing else None


def compiled_record(cfg: SweepConfig, rec: dict[str, Any], point: program.Point,
                    short: program.Compiled | None, long: program.Compiled | None,
                    extra: dict[str, program.Compiled] | None = None) -> dict[str, Any]:
  """A point compiled for a GPU target: what each program runs as XLA:GPU compiled it, its memory per device
  and whether the largest fits the target's memory. Nothing ran, so no time and no check of values. `extra`:
  more programs of the point by name (`--command_buffer=both`: `long_command_buffer` ...)."""
  programs = {"check": point.check_prog, "short": short, "long": long, **(extra or {})}
  facts, peak = {}, 0
  for name, prog in programs.items():
    if prog is None:
      continue
    mem = gpu_compile.memory(prog.fn)
    facts[name] = {**prog.verified.facts(), "reps": prog.reps, "memory": mem}
    peak = max(peak, mem["total_bytes"] if mem else 0)
  n = point.scope.group_size
  shape = program.form(point.collective, point.count, n, long or point.check_prog)
  out = {**rec, "status": "compiled", "target": cfg.target, "programs": facts, "memory_bytes": peak,
         **({"form": shape} if shape else {}),
         "op_emitted": facts["check"]["op_emitted"],
         # XLA:TPU: the algorithm it chose, its own form of the op, the DCN transfers across slices
         **{k: facts["check"][k] for k in ("algorithm", "written_as", "dcn") if k in facts["check"]}}
  if long is not None:
    out.update(iters=long.reps, short_iters=short.reps, trip_count=max(long.verified.trip_counts, default=None),
               loop_reps=long.verified.in_loop)
  if cfg.device_memory:
    out.update(gpu_compile.fit(peak, cfg.device_memory, cfg.memory_fraction))
  return out



def _placement(point: program.Point, short: program.Compiled | None, long: program.Compiled | None
               ) -> dict[str, Any]:
  """Per program, where XLA:GPU runs its collectives and loops as to command buffers (hlo_check)."""
  progs = {"check": point.check_prog, "short": short, "long": long}
  return {name: p.verified.command_buffer for name, p in progs.items() if p is not None}


def _command_buffer_programs(cfg: SweepConfig, point: program.Point, reps: int | None
                             ) -> dict[str, program.Compiled]:
  """--command_buffer=both for a target: the point's timed programs (in latency mode its check program) compiled
  again with command buffers, each confirmed to run its collective (and loop) inside one."""
  coll, mesh, plan, count, dtype = point.collective, point.mesh, point.scope, point.count, point.dtype
  arm = command_buffer.SECOND_ARM
  if cfg.latency_mode:
    return {"check_command_buffer": program.build_check(coll, mesh, plan, count, dtype, command_buffer=arm).check_prog}
  out = {"short_command_buffer": program.build_timed(coll, mesh, plan, count, dtype, program.SHORT_REPS,
                                                     command_buffer=arm)}
  if reps:
    out["long_command_buffer"] = program.build_timed(coll, mesh, plan, count, dtype, reps, command_buffer=arm)
  return out


def _command_buffer_arm(cfg: SweepConfig, point: program.Point, short: program.Compiled | None,
                        long: program.Compiled | None, barrier, delay: float) -> dict[str, Any]:
  """--command_buffer=both: the point's timed programs (in latency mode its check program) compiled again with
  XLA:GPU's command buffers, checked like the first arm (the values, and the collective and loop inside a
  command buffer) and timed the same way with the same repetitions, after it. The first arm's time stays the
  record's `time_us`; this one's fields end in `_command_buffer`; `placement` is what hlo_check read."""
  coll, mesh, plan, count, dtype = point.collective, point.mesh, point.scope, point.count, point.dtype
  arm = command_buffer.SECOND_ARM
  out: dict[str, Any] = {}
  if cfg.latency_mode:
    cb = program.build_check(coll, mesh, plan, count, dtype, command_buffer=arm)
    wrong = program.check(cb, compare=cfg.check)
    out["wrong_command_buffer"] = int(_gather(np.asarray([wrong], np.int64)).sum()) if cfg.check else None
    times, _ = program.time_calls(cb, cfg.warmup, cfg.samples, barrier, delay)
    stats = latency_stats(_gather(times))
    out["placement"] = _placement(cb, None, None)
  else:
    short_cb = program.build_timed(coll, mesh, plan, count, dtype, short.reps, command_buffer=arm)
    long_cb = program.build_timed(coll, mesh, plan, count, dtype, long.reps, command_buffer=arm)
    out["placement"] = {"short": short_cb.verified.command_buffer, "long": long_cb.verified.command_buffer}
    graphs, period = command_buffer.GRAPH_WARMUP, coll.period(plan.group_size)
    t_short, t_long, carry = program.time_pairs(short_cb, long_cb, program.initial_carry(point), cfg.warmup,
                                                cfg.samples, barrier, delay, _resolved(short.reps, long.reps), graphs,
                                                period)
    t_short, t_long = _gather(t_short), _gather(t_long)
    stats = difference_stats(t_short, t_long, short.reps, long.reps)
    out["samples_command_buffer"] = int(t_long.shape[1])
    if cfg.check:  # the chain of the second arm's calls, compared like the first's
      reps, digested = program.chain_reps(cfg.warmup, out["samples_command_buffer"], short.reps, long.reps, graphs,
                                          period)
      wrong, out["timed_check_command_buffer"] = program.check_timed(point, carry, reps, digested)
      if coll.compared_to_op(plan.group_size, program.platform_of(mesh)):
        replay_wrong, replayed = program.replay_check(point, short_cb, long_cb)
        wrong += replay_wrong
        out["timed_check_command_buffer"] += f"; {replayed}"
      out["timed_wrong_command_buffer"] = None if wrong is None else int(
          _gather(np.asarray([wrong], np.int64)).sum())
  for key in ("time_us", "time_us_min", "time_us_max", "time_method", "call_us_short", "call_us_long",
              "resolution", "noisy"):
    if key in stats:
      out[f"{key}_command_buffer"] = stats[key]
  return out


_POOL: futures.ThreadPoolExecutor | None = None


def _compile_pool() -> futures.ThreadPoolExecutor:
  """One pool of three compile threads for the whole sweep (a pool per point spent seconds starting threads)."""
  global _POOL
  if _POOL is None:
    _POOL = futures.ThreadPoolExecutor(3, thread_name_prefix="compile")
  return _POOL


def _compile_point(cfg: SweepConfig, coll, mesh, plan, count: int, dtype: str, reps: int | None,
                   arm: command_buffer.Arm | None = None):
  """The check program and, unless in latency mode, the short arm and (when `reps` is known) the long arm
  with its checked twin, compiled concurrently with the point's helper programs (program.helper_compiles):
  XLA compiles release the GIL, and all of them are independent but the comparison, which waits for the check
  program's wire dtype. `arm`: XLA:GPU's command buffers for all of them (None: XLA's default)."""
  if cfg.latency_mode:
    return program.build_check(coll, mesh, plan, count, dtype, command_buffer=arm), None, None
  pool = _compile_pool()
  check = pool.submit(program.build_check, coll, mesh, plan, count, dtype, command_buffer=arm)
  # a compile-only target runs nothing: no twin to check a run's values, no helper to make or compare them
  short = _submit_long(pool, cfg, coll, mesh, plan, count, dtype, program.SHORT_REPS, arm)
  long = _submit_long(pool, cfg, coll, mesh, plan, count, dtype, reps, arm) if reps else None
  wire_dtype = (lambda: check.result().wire_dtype) if cfg.check else None
  helpers = [] if cfg.target else [pool.submit(_quietly, job) for job in
                                   program.helper_compiles(coll, mesh, plan, count, dtype, wire_dtype)]
  point, short = check.result(), short()
  long = long() if long else None
  for job in helpers:
    job.result()
  return point, short, long


def _submit_long(pool: futures.ThreadPoolExecutor, cfg: SweepConfig, coll, mesh, plan, count: int, dtype: str,
                 reps: int, arm: command_buffer.Arm | None) -> Callable[[], program.Compiled]:
  """A timed arm and its checked twin compiling side by side; returns what waits for both."""
  plain = pool.submit(program.build_timed, coll, mesh, plan, count, dtype, reps, command_buffer=arm, twin=False)
  twin = None if cfg.target else pool.submit(program.build_twin, coll, mesh, plan, count, dtype, reps, arm)

  def result() -> program.Compiled:
    prog = plain.result()
    prog.checked = twin.result() if twin else None
    return prog
  return result


def _quietly(job: Callable[[], None]) -> None:
  """A helper's compile ahead of its call. A failure is left to the helper's own call, which raises it where
  the point records it."""
  try:
    job()
  except Exception:  # pylint: disable=broad-except
    pass


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return text[0][:300] if text else ""


def distinct_counts(coll: collectives.Collective, dtype: str, n: int, sizes: list[int]) -> dict[int, list[int]]:
  """Element count per rank -> the requested sizes that round to it, in sweep order."""
  itemsize = np.dtype(program.DTYPES[dtype]).itemsize
  out: dict[int, list[int]] = {}
  for size in sizes:
    out.setdefault(round_count(size, itemsize, coll.count_multiple(n)), []).append(size)
  return out


def _say_skips(cfg: SweepConfig, plans: list[ScopePlan], active: list[ScopePlan], platform: str,
               out: run_folder.RunOutputs) -> None:
  """One comment line per scope, collective, dtype or mode the sweep leaves out, and why."""
  for c in cfg.collectives:
    for p in active:
      if collectives.get(c).refuses_group(p.group_size):
        out.print(f"# {c} over {p.name} skipped: {collectives.get(c).refuses_group(p.group_size)}")
  for p in plans:
    if p.skip_reason:
      out.print(f"# scope {p.name} skipped: {p.skip_reason}")
  if cfg.command_buffer != "no":
    out.print(f"# --command_buffer={cfg.command_buffer}: {command_buffer.SAYS[cfg.command_buffer]}")
  if cfg.overlap and platform == "cpu":
    out.print(f"# --overlap: {overlap.CPU_NOTE}")
  if not active:
    out.print("# nothing to measure: every requested scope was skipped (a collective within one device moves"
              " nothing, and XLA removes it); no point is recorded")
  for c in cfg.collectives:
    if collectives.get(c).refuses_platform(platform):
      out.print(f"# {c} skipped: {collectives.get(c).refuses_platform(platform)}")
    for d in cfg.dtypes:
      if collectives.get(c).refuses(d):
        out.print(f"# {c} in {d} skipped: {collectives.get(c).refuses(d)}")


def _say_block(cfg: SweepConfig, header: str, plan: ScopePlan, dtype: str, counts: dict[int, list[int]],
               out: run_folder.RunOutputs) -> None:
  """A block's heading, the requested sizes that share one element count, and the table's header."""
  out.print(header)
  itemsize = np.dtype(program.DTYPES[dtype]).itemsize
  for count, reqs in counts.items():
    if len(reqs) > 1:
      out.print(f"# requested sizes {', '.join(map(str, reqs))} B all round to {count} elements "
                f"({count * itemsize} B) for groups of {plan.group_size}: measured once")
  for line in table.header(command_buffer=cfg.command_buffer == "both" and not cfg.target):
    out.print("#" + line[1:])


def _with_bounds(rec: dict[str, Any], peak: float | None, tpu: bool, family: str,
                 model: fabric_expected.ScopeModel | None) -> None:
  """Adds what the links allow (busbw's share of the peak) and what the fabric model expects of the point."""
  if rec["status"] == "ok":
    rec.update(link_peaks.share(rec["busbw_gbps"], peak, family))
    if tpu:
      rec["peak_algorithm"] = tpu_peaks.PEAK_ALGORITHM
    if model is not None:
      rec.update(fabric_expected.point(model, family, rec))
  elif rec["status"] == "compiled" and peak:  # what the links would allow the measurement, once it runs
    rec.update(peak_gbps=peak,
               peak_algorithm=tpu_peaks.PEAK_ALGORITHM if tpu else link_peaks.ALGORITHMS.get(family))
  rec["finished_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _stop_on_peer_failure(rec: dict[str, Any], out: run_folder.RunOutputs) -> None:
  """A point a lost peer ended: the job can't go on. Recorded as failed (a resume measures it again), named, so
  the outcome reads the same whether this process's watchdog or the lost peer ended the point first."""
  if rec["status"] == "failed" and jax.process_count() > 1 and distributed.is_peer_failure(rec["reason"]):
    reason = f"a process of the job failed during {describe_point(rec)}: {rec['reason']}"
    out.record({**rec, "status": "failed", "reason": reason})
    raise JobFailed(reason)


def run_sweep(cfg: SweepConfig, mesh, peaks: dict[str, link_peaks.LevelPeak], plans: list[ScopePlan],
              out: run_folder.RunOutputs, done: set[tuple] = frozenset(), watchdog: Watchdog | None = None,
              records: list[dict[str, Any]] | None = None,
              models: dict[str, fabric_expected.ScopeModel] | None = None) -> list[dict[str, Any]]:
  """Runs every point not in `done`, records each as it finishes (also appended to `records`), returns
  the records of this run; `peaks`: the link peaks per fabric level (link_peaks.resolve) for busbw's share;
  `models`: per scope, what the fabric model expects of its points (fabric_expected; none: no expectation)."""
  sizes = sweep(cfg.min_bytes, cfg.max_bytes, cfg.step_factor)
  barrier = program.make_barrier(mesh)
  records = [] if records is None else records
  active = [p for p in plans if not p.skip_reason]
  platform = program.platform_of(mesh)
  _say_skips(cfg, plans, active, platform, out)
  blocks = [(c, p, d) for c in cfg.collectives for p in active for d in cfg.dtypes
            if not collectives.get(c).refuses(d) and not collectives.get(c).refuses_group(p.group_size)
            and not collectives.get(c).refuses_platform(platform)]
  extents = dict(zip(mesh.axis_names, mesh.devices.shape))
  tpu = tpu_peaks.is_tpu_mesh(mesh.axis_names)  # a TPU pod: the torus model's bound, not fabric levels
  plan_counts = [distinct_counts(collectives.get(c), d, p.group_size, sizes) for c, p, d in blocks]
  total = sum(len(c) for c in plan_counts)
  index = 0
  t_start = time.perf_counter()
  for bi, ((cname, plan, dtype), counts) in enumerate(zip(blocks, plan_counts)):
    coll = collectives.get(cname)
    family = type(coll).name  # all_reduce for all_reduce_max too: the links bound any operator alike
    peak = (tpu_peaks.scope_peak(family, plan.name, extents, mesh.devices.flat[0].device_kind) if tpu
            else link_peaks.bus_peak(family, plan.axes, extents, peaks))
    _say_block(cfg, f"\n# [{bi + 1}/{len(blocks)}] {cname} over {plan.name}: {plan.num_groups} group(s) of "
               f"{plan.group_size}, {coll.impl(platform)}, busbw factor {coll.busbw_factor(plan.group_size):.4g}"
               + (f", link peak {peak:.4g} GB/s busbw" if peak else ""), plan, dtype, counts, out)
    itemsize = np.dtype(program.DTYPES[dtype]).itemsize
    last: tuple[float, int] | None = None  # (seconds per operation, bytes) of this block's previous point
    for count, reqs in counts.items():
      index += 1
      if all((cname, plan.name, dtype, r) in done for r in reqs):
        continue
      if cfg.inject_crash and cfg.inject_crash[0] == jax.process_index() and index > cfg.inject_crash[1]:
        os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die like a lost node, no cleanup
      expected = last[0] * count * itemsize / last[1] if last else 0.0
      rec = run_point(cfg, mesh, plan, coll, dtype, reqs[0], barrier, watchdog, expected, index, total,
                      tuple(reqs[1:]))
      _with_bounds(rec, peak, tpu, family, (models or {}).get(plan.name))
      _stop_on_peer_failure(rec, out)
      if rec["status"] == "ok":  # a call of the long arm / its operations, which includes per-call costs
        per_op = rec["call_us_long"] / rec["iters"] if "call_us_long" in rec else rec["time_us"]
        last = (per_op * 1e-6, rec["bytes"])
      out.record(rec)
      records.append(rec)
      out.print(table.format_row(rec))
      for line in overlap.console_lines(rec):
        out.print(line)
      if rec["status"] == "failed" and not cfg.keep_going:
        raise PointFailed(f"{describe_point(rec)} failed: {rec['reason']}")
  out.print(f"\n# {len(records)} point(s) in {time.perf_counter() - t_start:.1f} s")
  return records


def describe_point(rec: dict[str, Any]) -> str:
  """`point 3/15 (all_reduce over scale_up, float32, 4096 B)`: how messages name a point."""
  return (f"point {rec.get('point', '?')}/{rec.get('of_points', '?')} ({rec['collective']} over {rec['scope']}, "
          f"{rec['dtype']}, {rec.get('bytes', rec.get('requested_bytes'))} B)")
