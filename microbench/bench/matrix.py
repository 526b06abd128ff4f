"""The input space the `microbench` command line accepts, as cases to draw and run: the check proven over the
whole matrix rather than the default sweeps.

A case is one point as a user could ask for it: a backend (CPU devices, a GPU kind's or a TPU kind's
compile-only devices), a machine shape, a collective (every registered one and its variants: reduction
operators, in place, broadcast roots, the ragged all-to-all's distributions), a dtype, a scope, a size (one
element per device up to 1 GiB on targets) and the repetition settings (--iters, --warmup, --samples,
--sample_ms), with the overlap and command-buffer modes where they apply. `draw` samples the space with a
seeded generator; `run_cases` runs cases through the sweep's own `run_point` in this process, and each
outcome says whether an honest point came out right:

- on CPU devices it runs: every program compiles, its HLO check passes, the check program's every element
  is right and every timed repetition's digest matches (`wrong == 0`, `timed_wrong == 0`);
- on a target nothing runs: every program compiles and its HLO check passes, the checked twins included
  (they run on the real machine);
- an input the command line refuses (a dtype a collective has no form in, a root outside the group) is a
  `refused` outcome with its one line, never an error.

With mutants (microbench.bench.mutants) the same cases run deliberately wrong collectives instead: each
must be caught (an HLO mismatch, a wrong element or a wrong timed digest). CPU cases need a process whose
device count is the case's (`JAX_NUM_CPU_DEVICES`); scripts/check_matrix.py starts one per count.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Any

from microbench.bench import collectives, command_buffer, reduce_ops

CPU_DEVICE_COUNTS = (2, 3, 4, 6, 8, 12, 16, 18, 24, 32, 48, 64, 72, 96, 128)
GPU_KINDS = ("h100", "h200", "b200", "gb200")
TPU_KINDS = ("v5e", "v5p", "v6e")
DTYPES = ("float32", "bfloat16", "float16", "int32", "float8_e4m3fn", "float8_e5m2")
GPU_SCOPES = ("scale_up", "scale_out", "rack_scale", "global")
TPU_SCOPES = ("host", "ici_x", "ici_y", "ici_z", "slice", "dcn", "global")
MAX_CPU_BYTES = 1 << 22    # the default sweep's largest CPU point: bigger ones only copy memory for longer
CPU_TOTAL_BYTES = 1 << 25  # ... and all devices' buffers together at most this (host memory; the ragged emulation: n x)
MAX_TARGET_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Case:
  """One point of the space, as the command line would run it."""
  backend: str       # "cpu", a GPU kind or a TPU kind (--target)
  topology: str      # --topology
  devices: int       # devices the topology has (CPU: the process's device count)
  collective: str    # a collectives.get name: all_reduce_max_inplace, broadcast_root3, ragged_all_to_all_skewed ...
  scope: str
  dtype: str
  bytes: int         # the requested size S
  iters: int = 20
  warmup: int = 1
  samples: int = 3
  sample_ms: float = 0.0
  mode: str = "plain"  # "overlap" (CPU), "command_buffer" (GPU targets: --command_buffer=both)

  @property
  def target(self) -> str | None:
    return None if self.backend == "cpu" else self.backend

  def label(self) -> str:
    return (f"{self.backend} {self.topology} {self.collective} over {self.scope}, {self.dtype}, {self.bytes} B,"
            f" iters={self.iters} warmup={self.warmup} samples={self.samples} sample_ms={self.sample_ms:g}"
            + ("" if self.mode == "plain" else f", {self.mode}"))


def _collective(rng: random.Random, n_hint: int) -> str:
  """A collective name from the whole registry: a base, then maybe an operator, in place, a root."""
  base = rng.choice([*collectives.NAMES, *collectives.RAGGED])
  if base in ("all_reduce", "reduce_scatter") and rng.random() < 0.5:
    base = f"{base}_{rng.choice(reduce_ops.OPS[1:])}"
  if base == "broadcast" and rng.random() < 0.5:
    root = rng.randrange(1, max(2, n_hint))
    base = f"broadcast_root{root}"
  if not base.startswith("ragged") and rng.random() < 0.3:
    base += collectives.INPLACE
  return base


def _size(rng: random.Random, itemsize: int, top: int) -> int:
  """Bytes log-uniform from one element to `top`, at powers of two or anywhere between."""
  exp = rng.uniform(math.log2(itemsize), math.log2(top))
  return max(itemsize, int(2 ** exp) if rng.random() < 0.5 else 1 << round(exp))


def _cpu_topology(rng: random.Random, devices: int) -> str:
  """racks:R,nodes:N,gpus:G over `devices`, any factorisation (groups of 2..devices in some scope)."""
  gpus = rng.choice([d for d in range(1, devices + 1) if devices % d == 0])
  rest = devices // gpus
  racks = rng.choice([d for d in range(1, rest + 1) if rest % d == 0])
  return f"racks:{racks},nodes:{rest // racks},gpus:{gpus}"


def _gpu_topology(rng: random.Random, kind: str) -> tuple[str, int]:
  if kind.startswith("gb"):  # NVL72: racks of up to 18 trays of 4
    racks, nodes = rng.choice((1, 1, 2, 4, 8)), rng.choice((2, 9, 18))
    return f"racks:{racks},nodes:{nodes},gpus:4", racks * nodes * 4
  nodes = rng.choice((1, 2, 4, 16, 64, 300))  # up to 2,400 GPUs
  return f"nodes:{nodes},gpus:8", nodes * 8


def _tpu_topology(rng: random.Random, kind: str) -> tuple[str, int]:
  """A slice (up to 256 chips), or several (multislice)."""
  if kind == "v5p":
    dims = rng.choice(((2, 2, 1), (2, 2, 2), (2, 2, 4), (4, 4, 4), (4, 4, 8), (4, 8, 8)))
  else:
    dims = rng.choice(((2, 2, 1), (2, 4, 1), (4, 4, 1), (8, 8, 1), (16, 16, 1)))
  slices = rng.choice((1, 1, 1, 2, 4)) if math.prod(dims) <= 64 else 1
  text = "x".join(str(d) for d in (dims if kind == "v5p" else dims[:2]))
  return text + (f",slices:{slices}" if slices > 1 else ""), math.prod(dims) * slices


def group_sizes_of(backend: str, topology: str) -> dict[str, int]:
  """Each scope's group size on the case's machine (scopes the machine does not have: absent)."""
  from microbench.meshes import tpu_slice  # pylint: disable=g-import-not-at-top
  from microbench.meshes.scopes import plan_scopes  # pylint: disable=g-import-not-at-top
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
  if backend in TPU_KINDS:
    from microbench.fabric import tpu_kinds  # pylint: disable=g-import-not-at-top
    shape = machine.parse_target_topology(backend, topology)
    host = tuple(tpu_kinds.target(backend).host_shape)
    top = tpu_slice.TpuSlices(shape.slices, shape.dims, tuple(min(h, d) for h, d in zip(host, shape.dims)))
    names = tpu_slice.SCOPES
  else:
    top, names = machine.parse_topology(topology), GPU_SCOPES
  return {p.name: p.group_size for p in plan_scopes(top, names) if not p.skip_reason}


def draw(rng: random.Random, backend: str, cpu_devices: int | None = None, max_bytes: int | None = None) -> Case:
  """One case of `backend` ("cpu", a GPU kind, a TPU kind); CPU cases on `cpu_devices` devices (else drawn);
  sizes up to `max_bytes` where given (a bounded sample), else the space's own limits."""
  if backend == "cpu":
    devices = cpu_devices or rng.choice(CPU_DEVICE_COUNTS)
    topology, top = _cpu_topology(rng, devices), min(MAX_CPU_BYTES, CPU_TOTAL_BYTES // devices)
  elif backend in TPU_KINDS:
    (topology, devices), top = _tpu_topology(rng, backend), MAX_TARGET_BYTES
  else:
    (topology, devices), top = _gpu_topology(rng, backend), MAX_TARGET_BYTES
  top = min(top, max_bytes) if max_bytes else top
  sizes = group_sizes_of(backend, topology)
  scope = rng.choice(sorted(s for s, n in sizes.items() if n >= 2) or sorted(sizes))
  name = _collective(rng, sizes[scope])
  if backend == "cpu" and name.startswith("ragged"):  # the emulation gathers n x the message per device
    top = max(64, top // sizes[scope])
  dtype = rng.choice(DTYPES)
  itemsize = 1 if dtype.startswith("float8") else 2 if "16" in dtype else 4
  iters = rng.choice((1, 6, 8, 10, 20, 20, 32))
  mode = "plain"
  if backend == "cpu" and iters > 1 and rng.random() < 0.1:
    mode = "overlap"
  elif backend in GPU_KINDS and rng.random() < 0.15:
    mode = "command_buffer"
  return Case(backend, topology, devices, name, scope, dtype, _size(rng, itemsize, top), iters=iters,
              warmup=rng.choice((0, 1, 1, 2)), samples=rng.choice((1, 2, 3)),
              sample_ms=rng.choice((0.0, 0.0, 20.0, 0.05)), mode=mode)


def cases(seed: int, counts: dict[str, int], cpu_devices: tuple[int, ...] | None = None,
          max_bytes: int | None = None) -> list[Case]:
  """`counts[backend]` cases of each backend, seeded; CPU cases' device counts from `cpu_devices` (default:
  CPU_DEVICE_COUNTS), spread over them in turn; sizes up to `max_bytes` where given."""
  rng = random.Random(seed)
  out = []
  for backend, count in counts.items():
    for i in range(count):
      pool = cpu_devices or CPU_DEVICE_COUNTS
      out.append(draw(rng, backend, pool[i % len(pool)] if backend == "cpu" else None, max_bytes))
  return out


@dataclasses.dataclass
class Outcome:
  case: Case
  status: str            # ok, compiled, refused, error (HLO check), failed (compile or run), skipped
  reason: str = ""
  wrong: int | None = None
  timed_wrong: int | None = None
  seconds: float = 0.0
  mutant: str | None = None
  facts: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def honest_ok(self) -> bool:
    """An honest case came out right (or was refused, or its scope skipped, in one line)."""
    return self.status in ("compiled", "refused", "skipped") or (
        self.status == "ok" and not self.wrong and not self.timed_wrong)

  @property
  def caught(self) -> bool:
    """A mutant case was caught: its HLO check failed, or an element or a timed digest was wrong."""
    return self.status == "error" or bool(self.wrong) or bool(self.timed_wrong)

  def as_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self.case), "status": self.status, "reason": self.reason, "wrong": self.wrong,
            "timed_wrong": self.timed_wrong, "seconds": round(self.seconds, 3), "mutant": self.mutant,
            **self.facts}


def _refusal(coll: collectives.Collective, case: Case, n: int, platform: str) -> str | None:
  """What the command line would refuse about this case, in its one line (None: nothing)."""
  return (coll.refuses(case.dtype) or coll.refuses_group(n) or coll.refuses_platform(platform)
          or command_buffer.refuses_collective("both" if case.mode == "command_buffer" else "no", case.collective))


def _mesh_and_plan(case: Case):
  """(mesh, the case's scope plan, platform, target facts) for the case's machine, or raises ValueError with
  a one-line reason (a scope this machine does not have: skipped)."""
  from microbench.meshes import tpu_slice  # pylint: disable=g-import-not-at-top
  from microbench.meshes.mesh import build_mesh, ordered_devices  # pylint: disable=g-import-not-at-top
  from microbench.meshes.scopes import plan_scopes  # pylint: disable=g-import-not-at-top
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
  target = None
  if case.target:
    top, target, mesh, _ = machine.resolve_target(case.backend, machine.parse_target_topology(case.backend,
                                                                                              case.topology), None)
    names = tpu_slice.SCOPES if case.backend in TPU_KINDS else GPU_SCOPES
  else:
    top = machine.parse_topology(case.topology)
    mesh, names = build_mesh(top, ordered_devices()), GPU_SCOPES
  if case.scope not in names:
    raise ValueError(f"no scope {case.scope} on {case.backend}")
  plan = next(p for p in plan_scopes(top, (case.scope,)))
  if plan.skip_reason:
    raise ValueError(plan.skip_reason)
  return mesh, plan, mesh.devices.flat[0].platform, target


def _config(case: Case, target) -> Any:
  from microbench.bench import sweep  # pylint: disable=g-import-not-at-top
  from microbench.aot import gpu_compile  # pylint: disable=g-import-not-at-top
  tpu = case.backend in TPU_KINDS
  return sweep.SweepConfig(
      collectives=(case.collective,), scopes=(case.scope,), dtypes=(case.dtype,), min_bytes=case.bytes,
      max_bytes=case.bytes, step_factor=2.0, iters=case.iters, warmup=case.warmup, samples=case.samples,
      check=True, sample_s=case.sample_ms / 1e3, target=case.target,
      device_memory=target.memory_bytes if target else None,
      memory_fraction=gpu_compile.TPU_MEM_FRACTION if tpu and target else None,
      command_buffer="both" if case.mode == "command_buffer" else "no",
      overlap=4 if case.mode == "overlap" else None)


def run_case(case: Case, coll: collectives.Collective | None = None, twins: bool = True) -> Outcome:
  """One case through the sweep's run_point (in this process; CPU cases need its device count). `coll`: a
  collective to run instead of the case's (a mutant). `twins`: on a target, compile and check the checked
  twins of both arms too (the sweep compiles none for a target; a real machine runs them)."""
  from microbench.bench import hlo_check, program, sweep  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  name = getattr(coll, "name", None)
  try:
    mesh, plan, platform, target = _mesh_and_plan(case)
  except ValueError as e:
    return Outcome(case, "skipped", str(e), seconds=time.perf_counter() - t0, mutant=name)
  base = collectives.get(case.collective)
  coll = coll or base
  refused = _refusal(base, case, plan.group_size, platform)
  if refused:
    return Outcome(case, "refused", refused, seconds=time.perf_counter() - t0, mutant=name)
  cfg = _config(case, target)
  rec = sweep.run_point(cfg, mesh, plan, coll, case.dtype, case.bytes, program.make_barrier(mesh))
  out = Outcome(case, rec["status"], rec.get("reason", ""), rec.get("wrong"), rec.get("timed_wrong"), mutant=name,
                facts={k: rec[k] for k in ("count", "group_size", "num_groups", "timed_check", "written_as",
                                           "relayout_passes_per_op") if k in rec})
  if twins and case.target and rec["status"] == "compiled" and not cfg.latency_mode:
    count = rec["count"]
    try:
      for reps in {program.SHORT_REPS, rec["iters"]}:
        program.build_twin(coll, mesh, plan, count, case.dtype, reps)
    except hlo_check.HloMismatch as e:
      out.status, out.reason = "error", f"HLO check failed (checked twin): {e}"
    except Exception as e:  # pylint: disable=broad-except
      if "RESOURCE_EXHAUSTED" in str(e):  # the twin does not fit the target's memory: said, as for the point
        out.reason = f"the checked twin does not fit: {str(e).splitlines()[0][:200]}"
      else:
        out.status, out.reason = "failed", f"checked twin failed to compile: {type(e).__name__}: {e}"[:400]
  out.seconds = time.perf_counter() - t0
  return out


def run_cases(cases_: list[Case], twins: bool = True) -> list[Outcome]:
  return [run_case(c, twins=twins) for c in cases_]


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
  """Cases per backend and dtype, how they came out, and the failures (honest) or misses (mutants)."""
  by: dict[str, dict[str, int]] = {}
  for o in outcomes:
    key = o.case.backend if o.case.backend == "cpu" or o.case.target is None else o.case.backend
    row = by.setdefault(key, {})
    row[o.status] = row.get(o.status, 0) + 1
  honest = [o for o in outcomes if o.mutant is None]
  mutants = [o for o in outcomes if o.mutant is not None and o.status not in ("refused", "skipped")]
  return {"cases": len(outcomes), "by_backend": by,
          "dtypes": sorted({o.case.dtype for o in outcomes}),
          "honest_failures": [(o.case.label(), o.status, o.reason[:300]) for o in honest if not o.honest_ok],
          "mutants": len(mutants), "mutants_missed": [(o.mutant, o.case.label()) for o in mutants if not o.caught],
          "seconds": round(sum(o.seconds for o in outcomes), 1)}


def group_sizes(cases_: list[Case]) -> list[int]:
  """The group sizes a list of cases covers (for reports)."""
  return sorted({group_sizes_of(c.backend, c.topology).get(c.scope, 1) for c in cases_})



def run_mutants(case: Case, kinds: list[str] | None = None, limit: int | None = None) -> list[Outcome]:
  """The case with each applicable mutant (microbench.bench.mutants.kinds_for, or `kinds`) in place of its
  collective; each outcome must be `caught`. Only where the case runs (CPU devices): on a target nothing runs
  to be wrong. `limit`: at most that many of them, drawn with a seed from the case (the same case always runs
  the same ones), for samples whose every mutant costs a large program's compile."""
  from microbench.bench import mutants  # pylint: disable=g-import-not-at-top
  if case.target:
    return []
  try:
    mesh, plan, platform, _ = _mesh_and_plan(case)
  except ValueError:
    return []
  base = collectives.get(case.collective)
  if _refusal(base, case, plan.group_size, platform):
    return []
  chosen = kinds if kinds is not None else mutants.kinds_for(base, case.dtype, case.iters, plan.num_groups)
  if limit is not None and len(chosen) > limit:
    import random  # pylint: disable=g-import-not-at-top
    import zlib  # pylint: disable=g-import-not-at-top
    seed = zlib.crc32(repr(sorted(case.__dict__.items())).encode())
    drawn = set(random.Random(seed).sample(list(chosen), limit))
    chosen = [k for k in chosen if k in drawn]  # in their own order
  return [run_case(case, mutants.make(k, base, tuple(mesh.axis_names), tuple(plan.axes))) for k in chosen]
