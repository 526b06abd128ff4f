"""Runs a proxy's schedule: real collectives over the job's devices, compute emulated, one record per iteration.

One process per GPU (rank = process index), as SLURM and the launchers start jobs. Each communicator of the
schedule becomes a mesh of its members' devices and each collective one compiled program over it (the
benchmark's collective registry, inside `shard_map`), compiled before the first iteration; only the
members call it, so ranks keep their own timelines like MPI ranks. A started collective is dispatched and
runs on the device while the host emulates compute (`sleep`: the host waits and the process uses no CPU;
`busy`: a calibrated kernel keeps the device busy and the host waits for it); a wait blocks on its results.
Exposed communication is the time the host spends blocked on communication: waits, blocking collectives,
and dispatching started ones (microseconds on a GPU; on CPU a dispatch can block behind running
collectives, and that time is communication too; it is also reported on its own as `dispatch`).

After each iteration (outside the timed region) the ranks exchange their times; process 0 appends one JSON
line with every rank's runtime, exposed communication and compute, the slowest rank's throughput and the
communication share, flushed at once, so a job stopped by the study's kill sequence loses nothing recorded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import IO

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from microbench.bench import collectives, program
from microbench.study import rank_programs as sch
from microbench.study import workloads as wl

DTYPES = {k: program.DTYPES[k] for k in ("bfloat16", "float32", "float16")}  # the floating types a proxy moves


class ProxyError(RuntimeError):
  """A proxy that can't run here (wrong process/device count); the message is one line."""


def _devices_by_rank(gpus: int) -> list[jax.Device]:
  if len(jax.local_devices()) != 1:
    raise ProxyError(f"a proxy runs one process per GPU; this process has {len(jax.local_devices())} devices "
                     "(set JAX_NUM_CPU_DEVICES=1 on CPU, one task per GPU under SLURM)")
  if jax.process_count() != gpus:
    raise ProxyError(f"the schedule is for {gpus} ranks but the job has {jax.process_count()} processes")
  return sorted(jax.devices(), key=lambda d: d.process_index)


class Communicators:
  """The compiled collective programs this rank takes part in, with their zero-filled input buffers."""

  def __init__(self, devices: list[jax.Device], dtype):
    self._devices = devices
    self._dtype = dtype
    self._programs: dict[tuple, tuple[Callable, jax.Array]] = {}

  def _build(self, c: sch.Comm) -> tuple[Callable, jax.Array]:
    n = c.group.size
    mesh = jax.sharding.Mesh(np.array([self._devices[r] for r in c.group.ranks]), ("g",))
    if c.op == "permute":
      pairs = list(c.pairs)
      body = lambda x: lax.ppermute(x, "g", pairs)  # noqa: E731
      in_count = c.elements
    else:
      coll = collectives.get(c.op)
      platform = self._devices[c.group.ranks[0]].platform
      body = lambda x: coll.op(x, ("g",), n, platform)  # noqa: E731
      in_count = coll.in_count(c.elements, n)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("g"), out_specs=jax.P("g"), check_vma=False))
    sharding = jax.sharding.NamedSharding(mesh, jax.P("g"))
    local = np.zeros(in_count, dtype=self._dtype)
    buf = jax.make_array_from_callback((n * in_count,), sharding, lambda _: local)
    return fn.lower(buf).compile(), buf

  def program(self, c: sch.Comm) -> tuple[Callable, jax.Array]:
    key = (c.op, c.elements, c.group.ranks, c.pairs)
    if key not in self._programs:
      self._programs[key] = self._build(c)
    return self._programs[key]

  def __len__(self) -> int:
    return len(self._programs)


class BusyKernel:
  """A device kernel of a requested duration: a chain of small matmuls repeated a calibrated number of times."""

  def __init__(self, device: jax.Device):
    x = jax.device_put(jnp.full((256, 256), 1e-3, jnp.float32), device)
    self._x = x

    @jax.jit
    def spin(x, n):
      return lax.fori_loop(0, n, lambda _, y: jnp.tanh(y @ y), x)
    self._spin = spin
    spin(x, 1).block_until_ready()
    times = []
    for n in (8, 64):
      t = time.perf_counter()
      spin(x, n).block_until_ready()
      times.append((n, time.perf_counter() - t))
    (n0, t0), (n1, t1) = times
    self.seconds_per_iter = max((t1 - t0) / (n1 - n0), 1e-7)

  def __call__(self, seconds: float) -> None:
    n = int(round(seconds / self.seconds_per_iter))
    if n > 0:
      self._spin(self._x, n).block_until_ready()


@dataclasses.dataclass
class IterationTimes:
  runtime: float
  exposed: float
  compute: float
  by_label: dict[str, float]


def bind(steps: tuple[sch.Step, ...], comms: Communicators) -> list[tuple[Callable, jax.Array] | None]:
  """Each step's compiled program and buffer (None for compute and waits), compiled here, once, so the timed
  iterations only dispatch."""
  return [comms.program(s.comm) if isinstance(s, (sch.Start, sch.Blocking)) else None for s in steps]


def run_iteration(steps: tuple[sch.Step, ...], programs: list[tuple[Callable, jax.Array] | None],
                  compute: Callable[[float], None]) -> IterationTimes:
  """One iteration of one rank's schedule (`programs`: bind's); its wall time, exposed communication, compute."""
  pending: dict[int, jax.Array] = {}
  exposed = computed = 0.0
  by_label: dict[str, float] = {}
  t_start = time.perf_counter()
  for s, program in zip(steps, programs):
    if isinstance(s, sch.Compute):
      t = time.perf_counter()
      compute(s.seconds)
      computed += time.perf_counter() - t
    elif isinstance(s, sch.Start):
      fn, buf = program
      t = time.perf_counter()
      pending[s.handle] = fn(buf)
      dt = time.perf_counter() - t  # ~10 us on a GPU; on CPU a dispatch can block behind running collectives
      exposed += dt
      by_label["dispatch"] = by_label.get("dispatch", 0.0) + dt
    elif isinstance(s, sch.Wait):
      t = time.perf_counter()
      for h in s.handles:
        pending.pop(h).block_until_ready()
      dt = time.perf_counter() - t
      exposed += dt
      by_label[s.label] = by_label.get(s.label, 0.0) + dt
    else:
      fn, buf = program
      t = time.perf_counter()
      fn(buf).block_until_ready()
      dt = time.perf_counter() - t
      exposed += dt
      by_label[s.comm.label] = by_label.get(s.comm.label, 0.0) + dt
  return IterationTimes(time.perf_counter() - t_start, exposed, computed, by_label)


def _labels(job: sch.JobSchedule) -> list[str]:
  """Every timer label any rank reports, in a fixed order (all ranks derive the same list)."""
  out: set[str] = set()
  for steps in job.ranks:
    for s in steps:
      if isinstance(s, sch.Start):
        out.add("dispatch")
      elif isinstance(s, sch.Wait):
        out.add(s.label)
      elif isinstance(s, sch.Blocking):
        out.add(s.comm.label)
  return sorted(out)


def _gather(vec: np.ndarray) -> np.ndarray:
  """Every rank's vector, [ranks, len] (a collective: all ranks call it between iterations)."""
  if jax.process_count() == 1:
    return vec[None, :]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(vec, tiled=False)).reshape(jax.process_count(), -1)


def summary(job: sch.JobSchedule, element_bytes: int) -> dict:
  """What the header record says about the schedule: per-rank bytes and compute, collectives per label."""
  per_rank = [sch.bytes_per_iteration(job, r, element_bytes) for r in range(job.gpus)]
  counts: dict[str, int] = {}
  for c in job.comms(0):
    counts[f"{c.op}:{c.label}"] = counts.get(f"{c.op}:{c.label}", 0) + 1
  return {"bytes_per_iteration_rank0": per_rank[0] if per_rank else {},
          "bytes_per_iteration_max": max((sum(b.values()) for b in per_rank), default=0),
          "collectives_rank0": counts,
          "compute_s_max": max((sch.compute_seconds(job, r) for r in range(job.gpus)), default=0.0)}


def _compute_stand_in(compute: str, device: jax.Device) -> tuple[Callable[[float], None], BusyKernel | None]:
  """What stands for a step's compute: a kernel keeping `device` busy ("busy", returned twice: the kernel says
  its seconds per iteration), or a sleep ("sleep")."""
  if compute == "busy":
    kernel = BusyKernel(device)
    return kernel, kernel
  if compute == "sleep":
    return (lambda s: time.sleep(s) if s > 0 else None), None
  raise ProxyError(f"--compute={compute}: choose sleep or busy")


def _header(job: sch.JobSchedule, *, iters: int, warmup: int, compute: str, dtype: str, label: str,
            devices: list[jax.Device], programs: int, compile_s: float, labels: list[str],
            full: sch.JobSchedule | None, kernel: BusyKernel | None) -> dict:
  """The header record: the schedule, the run's settings, the devices, the compile time and what the
  schedule moves (scaled, and at full scale where `full` is given)."""
  header = {"kind": "proxy", "label": label, "schedule": job.name, "gpus": job.gpus, "meta": job.meta,
            "samples_per_iteration": job.samples_per_iteration, "iters": iters, "warmup": warmup,
            "compute": compute, "dtype": dtype, "platform": devices[0].platform,
            "device_kind": devices[0].device_kind, "programs_rank0": programs, "compile_s_rank0": compile_s,
            "scaled": summary(job, np.dtype(DTYPES[dtype]).itemsize), "labels": labels, "pid": os.getpid()}
  if full is not None:
    header["full"] = summary(full, wl.BF16_BYTES)  # the study's full-scale messages are bf16
  if kernel is not None:
    header["busy_seconds_per_iter"] = kernel.seconds_per_iter
  return header


def _iteration_record(job: sch.JobSchedule, it: int, warmup: int, wall: float, table: np.ndarray,
                      labels: list[str]) -> dict:
  """One iteration's record from every rank's [runtime, exposed, compute, exposed per label]: the slowest
  rank sets the iteration's time."""
  runtime, exposed, computed = table[:, 0], table[:, 1], table[:, 2]
  slow = int(np.argmax(runtime))
  shares = exposed / np.maximum(runtime, 1e-12)
  return {"kind": "iter", "iter": it, "warmup": it < warmup, "t_start": wall,
          "runtime_s": float(runtime[slow]), "slowest_rank": slow,
          "throughput": job.samples_per_iteration / float(runtime[slow]),
          "exposed_s": float(exposed[slow]), "comm_share": float(shares.max()),
          "ranks": {"runtime_s": runtime.round(7).tolist(), "exposed_s": exposed.round(7).tolist(),
                    "compute_s": computed.round(7).tolist()},
          "exposed_by_label_slowest": {k: float(table[slow, 3 + i]) for i, k in enumerate(labels)}}


def _write_line(writer: IO[str] | None, record: dict) -> None:
  """One JSON line, flushed at once (a job may be killed between iterations)."""
  if writer:
    writer.write(json.dumps(record) + "\n")
    writer.flush()


def run(job: sch.JobSchedule, *, iters: int, warmup: int, out: IO[str] | None, compute: str = "sleep",
        dtype: str = "bfloat16", label: str = "", full: sch.JobSchedule | None = None,
        say: Callable[[str], None] = print) -> list[dict]:
  """Runs `warmup` + `iters` iterations of `job` (this process's rank); process 0 writes one JSON line per
  iteration to `out` and returns the records. `full` is the unscaled schedule, for the header."""
  sch.check_consistent(job)
  devices = _devices_by_rank(job.gpus)
  rank = jax.process_index()
  comms = Communicators(devices, DTYPES[dtype])
  t = time.perf_counter()
  programs = bind(job.ranks[rank], comms)
  compile_s = time.perf_counter() - t
  emulate, kernel = _compute_stand_in(compute, devices[rank])
  labels = _labels(job)
  writer = out if rank == 0 else None
  _write_line(writer, _header(job, iters=iters, warmup=warmup, compute=compute, dtype=dtype, label=label,
                              devices=devices, programs=len(comms), compile_s=compile_s, labels=labels, full=full,
                              kernel=kernel))
  records = []
  _gather(np.zeros(1, np.float32))  # everyone compiled: start together
  for it in range(warmup + iters):
    wall = time.time()
    times = run_iteration(job.ranks[rank], programs, emulate)
    vec = np.array([times.runtime, times.exposed, times.compute] + [times.by_label.get(k, 0.0) for k in labels],
                   np.float32)
    records.append(_iteration_record(job, it, warmup, wall, _gather(vec), labels))
    _write_line(writer, records[-1])
  if rank == 0 and iters:
    timed = [r["runtime_s"] for r in records if not r["warmup"]]
    say(f"{job.name}: {job.gpus} rank(s), median iteration {statistics.median(timed) * 1e3:.2f} ms, "
        f"{job.samples_per_iteration / statistics.median(timed):.2f} samples/s")
  return records
