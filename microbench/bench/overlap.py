"""Compute-communication overlap (`--overlap`): a collective beside independent compute, as OSU's non-blocking
collective benchmarks and PARAM's comms-compute mode measure it.

Per point, three timed programs of one structure (program.py's loop: a `fori_loop` with a known trip count,
two repetitions per trip, the carry donated), each timed by the difference of a 2- and a k-repetition arm:

- **comm**: the point's own timed programs, the collective alone;
- **compute**: a matmul alone, [D, D] @ [D, D] per device per repetition, on data independent of the collective;
- **both**: the collective and the matmul in the same loop body, neither depending on the other.

The three arms' calls are interleaved (each sample runs a pair of every arm), so drift on a shared machine hits
them alike. **The overlap percentage is OSU's** (osu_util_mpi.c, `print_stats_nbc`): OSU times the blocking
form of the collective alone (pure communication), then the non-blocking one with dummy compute sized to that
time inserted before the wait (overall), measuring the compute's own time inside; the share of the
communication hidden is what the overall time does not add on top of the compute, relative to the
communication: overlap = max(0, 100 - 100 x (t_overall - t_compute) / t_comm). 100% means the collective
cost nothing beside the compute; 0% that it was fully serialised. Here t_compute is the compute arm's time
(a device program can't time a part of itself).

**Sizing.** `--overlap=auto` sizes D so the matmul takes about as long as the collective: the matmul rate is
measured once per mesh and dtype (a compute arm at a probe size, timed by difference), and
D = (t_comm x rate / 2)^(1/3), rounded to a multiple of 8 (CPU) or 128 (GPU tensor-core tiles). `--overlap=N`
fixes D = N, PARAM's `--mm-dim`: a dimension rather than a FLOP count because it is what the program runs
(FLOPs would be rounded to one anyway) and it fixes the memory (3 D^2 per device). Under `--target` nothing
is timed, so `auto` compiles D = TARGET_DIM.

**Checks.** The collective is checked as every point is (the check program, then the comm and both arms'
final carries and digests through program.check_timed). The matmul multiplies by a cyclic permutation P
(m @ P rolls m's columns by one; XLA sees a dense operand and runs a dense GEMM): after R repetitions m must
equal the known m0 rolled by R, compared exactly on the devices (small integers, exact in every float type
and in TF32), so a dropped or repeated matmul shows. Each arm's HLO is checked: the compute arm runs the dot
k times and no collective; the both arm runs the collective as the comm arm does (hlo_check) and the dot k
times, and writes no more besides them than the comm arm does.

**Schedule.** In the both arm's compiled GPU program the matmul must sit between the collective's async
start and done (XLA's latency-hiding scheduler put it there): `overlap_scheduled`, with the windows and the
HLO lines that show it. XLA:CPU runs collectives synchronously (no start/done): the arms run and are
checked there, but overlap is not measurable, and the record and the console say so.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from microbench.meshes.scopes import ScopePlan
from microbench.bench import hlo_check, program
from microbench.bench.collectives import Collective
from microbench.hlo import parse
from microbench.hlo import async_windows

AUTO = "auto"
COMPUTE_SCOPE = "microbench_overlap_compute"  # names the matmul's instructions in the HLO
DIM_MULTIPLE = {"cpu": 8, "gpu": 128}
MAX_DIM = {"cpu": 2048, "gpu": 16384}  # 3 D^2 elements per device: 48 MiB (CPU, float32), 1.5 GiB (GPU, bf16)
PROBE_DIM = {"cpu": 128, "gpu": 4096}  # the matmul-rate probe: cheap on CPU, past launch costs on a GPU
PROBE_REPS = 10
PROBE_PAIRS = 3
TARGET_DIM = 4096
_PATTERN = 241  # m0[i, j] = (5 i + 3 j) mod 241 - 120: small integers, and no column shift below 241 maps m0 to itself
CPU_NOTE = ("not measurable on cpu: XLA:CPU runs collectives synchronously (no async start/done), so nothing is"
            " scheduled beside them; the three arms ran and were checked, the percentage is the host's threads"
            " sharing cores")


def parse_spec(text: str | None) -> int | str | None:
  """`--overlap`'s value: None (off), AUTO, or a matmul dimension; ValueError with the one line to print."""
  if text is None or text == "":
    return None
  if text.strip().lower() == AUTO:
    return AUTO
  try:
    dim = int(text)
  except ValueError:
    dim = 0
  if not 1 <= dim <= MAX_DIM["gpu"]:
    raise ValueError(f"--overlap={text}: use auto (a matmul sized to take as long as the collective) or the matmul"
                     f" dimension N, 1 to {MAX_DIM['gpu']} ([N, N] @ [N, N] per device, PARAM's --mm-dim)")
  return dim


def osu_overlap_pct(t_overall: float, t_compute: float, t_comm: float) -> float:
  """OSU's overlap percentage: the share of the pure communication time that running beside the compute did
  not add to it, floored at 0 (any unit, the same for the three)."""
  if t_comm <= 0:
    return 0.0
  return max(0.0, 100.0 - 100.0 * (t_overall - t_compute) / t_comm)


def compute_dtype(dtype: str) -> str:
  """The matmul's dtype: the point's float dtype; int32 and fp8 points multiply in float32 (XLA has no fp8 GEMM
  on every platform, and integer GEMMs are not what training overlaps)."""
  return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def size_dim(t_comm_s: float, rate_flops_s: float, platform: str) -> int:
  """D whose [D, D] @ [D, D] (2 D^3 FLOPs) takes about t_comm_s at the measured rate."""
  kind = "cpu" if platform == "cpu" else "gpu"
  step = DIM_MULTIPLE[kind]
  raw = (max(t_comm_s, 0.0) * max(rate_flops_s, 0.0) / 2) ** (1 / 3)
  return int(min(MAX_DIM[kind], max(step, round(raw / step) * step)))


def matmul(m: jax.Array, w: jax.Array) -> jax.Array:
  """One repetition of the compute: m @ w in m's dtype, named in the HLO."""
  with jax.named_scope(COMPUTE_SCOPE):
    return jnp.dot(m, w, preferred_element_type=m.dtype)


def _pattern(rows: int, cols: int, shift) -> jax.Array:
  """m0 rolled right by `shift` columns, as int32 (traced): m0[i, j] = (5 i + 3 j) mod 241 - 120."""
  i = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
  src = jnp.mod(j - shift, cols)
  return jnp.mod(5 * i + 3 * src, _PATTERN) - _PATTERN // 2


@functools.lru_cache(maxsize=16)
def _inputs_fn(mesh: jax.sharding.Mesh, dim: int, dtype: str) -> Callable:
  sharding = jax.NamedSharding(mesh, jax.P(mesh.axis_names))

  def per_device():
    m0 = _pattern(dim, dim, 0).astype(program.DTYPES[dtype])
    p = (jax.lax.broadcasted_iota(jnp.int32, (dim, dim), 1)
         == jnp.mod(jax.lax.broadcasted_iota(jnp.int32, (dim, dim), 0) + 1, dim)).astype(program.DTYPES[dtype])
    return m0, p
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(), out_specs=(jax.P(mesh.axis_names), jax.P(mesh.axis_names)),
                               check_vma=False), out_shardings=(sharding, sharding))


def compute_inputs(mesh: jax.sharding.Mesh, dim: int, dtype: str) -> tuple[jax.Array, jax.Array]:
  """(m0, P) on every device, made there: the known matrix and the cyclic permutation (P[j, j+1] = 1)."""
  return _inputs_fn(mesh, dim, dtype)()


@functools.lru_cache(maxsize=16)
def _compare_fn(mesh: jax.sharding.Mesh, dim: int) -> Callable:
  def per_device(m, shift):
    want = _pattern(dim, dim, shift[0])
    return jnp.sum(m.astype(jnp.float32) != want.astype(jnp.float32), dtype=jnp.int32).reshape(1)
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(jax.P(mesh.axis_names), jax.P()), out_specs=jax.P(mesh.axis_names),
                               check_vma=False))


def check_compute(mesh: jax.sharding.Mesh, m: jax.Array, dim: int, reps: int) -> int:
  """This process's devices whose matrix after `reps` matmuls by P is not m0 rolled by `reps` (on the devices;
  one count per device comes back)."""
  wrong = _compare_fn(mesh, dim)(m, jnp.asarray([reps % dim], jnp.int32))
  return sum(int(np.asarray(s.data)[0] > 0) for s in wrong.addressable_shards)


@dataclasses.dataclass
class Arm:
  """A compiled timed program of an arm (program.Compiled's shape: fn, text, reps, checked twin)."""
  fn: Callable
  hlo_text: str
  reps: int
  checked: "Arm | None" = None


def _spec(mesh: jax.sharding.Mesh, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((mesh.size * shape[0], *shape[1:]), dtype,
                              sharding=jax.NamedSharding(mesh, jax.P(mesh.axis_names)))


def dot_executions(hlo_text: str) -> int:
  """How many matmuls one call of a compiled program runs (loops counted by their trip counts)."""
  comps = parse.computations(hlo_text)
  counts = parse.execution_counts(hlo_text, comps)
  fused = _fused_names(comps)
  total = 0
  for name, comp in comps.items():
    if name in fused:
      continue
    for ins in filter(None, map(parse.parse_instruction, comp.lines)):
      if async_windows.runs_dot(ins, comps):
        times = counts.get(name)
        if times is None:
          raise hlo_check.HloMismatch(f"can't count how often the matmul runs: {ins.line.strip()[:160]}")
        total += times
  return total


def _fused_names(comps: dict[str, parse.Computation]) -> set[str]:
  out = set()
  for comp in comps.values():
    for ins in filter(None, map(parse.parse_instruction, comp.lines)):
      if ins.opcode == "fusion":
        out |= {c for k, c in parse.callees(ins) if k == "calls"}
  return out


_MATRIX = re.compile(r"\b[a-z]+[0-9a-z]*\[\d+,\d+\]")


def _loop_writes(hlo_text: str) -> int:
  """Elements the while bodies write per trip besides the collectives and the compute: the matmuls and
  whatever XLA emits around them, i.e. every write of a 2-D result (the collective's buffers are 1-D; XLA:CPU
  converts a 16-bit dot's operands and result to float32 without naming the scope)."""
  comps = parse.computations(hlo_text)
  bodies = set()
  for loop in parse.while_loops(hlo_text, comps):
    bodies |= parse.reachable(hlo_text, loop.body, comps)
  return sum(elements for name, writes in hlo_check.body_writes(hlo_text, comps).items() if name in bodies
             for elements, ins in writes if not (async_windows.runs_dot(ins, comps) or _MATRIX.search(ins.type_text)))


def loop(coll: Collective | None, step: Callable, reps: int, carry: tuple) -> tuple:
  """The timed programs' loop, as program runs `coll` (program.timed_loop)."""
  return program.timed_loop(coll, step, reps, carry)


def build_compute(mesh: jax.sharding.Mesh, dim: int, dtype: str, reps: int, coll: Collective | None = None) -> Arm:
  """The compute arm: `reps` (even) matmuls by P in the loop the collective's timed programs run (loop());
  checks that the dot runs `reps` times and no collective does."""
  dt = program.DTYPES[dtype]

  def per_device(m, w):
    return loop(coll, lambda c: (matmul(c[0], c[1]), c[1]), reps, (m, w))

  specs = [_spec(mesh, (dim, dim), dt)] * 2
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=(jax.P(mesh.axis_names),) * 2, out_specs=(jax.P(mesh.axis_names),) * 2,
                     check_vma=False)
  compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(*specs).compile()
  text = compiled.as_text()
  found = parse.find_collectives(text)
  if found:
    raise hlo_check.HloMismatch(f"the compute arm runs a collective: {found[0].text[:160]}")
  if (got := dot_executions(text)) != reps:
    raise hlo_check.HloMismatch(f"the compute arm runs the matmul {got} times per call, expected {reps}")
  return Arm(compiled, text, reps)


def build_both(coll: Collective, mesh: jax.sharding.Mesh, plan: ScopePlan, count: int, dtype: str, dim: int,
               reps: int, comm: program.Compiled | None = None, digest: bool | None = None) -> Arm:
  """The both arm: each repetition runs the collective's step (program.py's, digested as its timed program
  is) and a matmul on the independent (m, P) carried beside it. Checks the collective as hlo_check does for
  a timed program (but the write limit), the dot `reps` times, and, given the comm arm `comm`, that the loop
  body writes no more besides the collective and the matmuls than the comm arm's does. With `digest` None
  the checked twin is built too where the collective digests each repetition (program.build_timed's rule)."""
  n, platform = plan.group_size, program.platform_of(mesh)
  if digest is None:
    arm = build_both(coll, mesh, plan, count, dtype, dim, reps, comm, digest=False)
    arm.checked = build_both(coll, mesh, plan, count, dtype, dim, reps,
                             comm.checked if comm is not None else None, digest=True)
    return arm
  counts = program.carry_counts(coll, coll.in_count(count, n), coll.out_count(count, n), dtype, platform)
  ns = len(counts)
  cdt = program.DTYPES[compute_dtype(dtype)]

  def one(c):
    slots, y = coll.step(c[:ns], plan.axes, n, platform)
    acc = program.fold(c[ns], y) if digest else c[ns]
    return (*slots, acc, matmul(c[ns + 1], c[ns + 2]), c[ns + 2])

  def per_device(*carry):
    return loop(coll, one, reps, tuple(carry))

  specs = ([_spec(mesh, (c,), program.DTYPES[dtype]) for c in counts] + [_spec(mesh, (1,), jnp.uint32)]
           + [_spec(mesh, (dim, dim), cdt)] * 2)
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(jax.P(mesh.axis_names) for _ in specs),
                     out_specs=tuple(jax.P(mesh.axis_names) for _ in specs), check_vma=False)
  compiled = jax.jit(fn, donate_argnums=tuple(range(len(specs)))).lower(*specs).compile()
  text = compiled.as_text()
  # The collective as every timed program's (op, groups, dtype, count, executions in the loop); the matmul's
  # own D^2 writes are the compute, so the message-sized-write rule is applied below against the comm arm.
  timed = program.expectation(coll, plan, count, dtype, platform, reps, timed=True, twin=bool(digest))
  exp = dataclasses.replace(timed, copy_limit=None)
  hlo_check.verify(text, exp)
  if (got := dot_executions(text)) != reps:
    raise hlo_check.HloMismatch(f"the both arm runs the matmul {got} times per call, expected {reps}")
  if comm is not None:
    extra = _loop_writes(text) - _loop_writes(comm.hlo_text)
    limit = max(2, min(coll.in_count(count, n), coll.out_count(count, n)))  # the timed programs' copy limit
    if extra >= limit:
      raise hlo_check.HloMismatch(f"the both arm's loop body writes {extra} elements more than the collective's"
                                  " own timed program besides the collective and the matmul (a copy of a carried"
                                  " buffer)")
  return Arm(compiled, text, reps)


def schedule_check(hlo_text: str) -> dict[str, Any]:
  """Whether, in a compiled program, every matmul runs between an async collective's start and done: the
  record's `overlap_scheduled` (bool), `overlap_schedule` (why, in words), `overlap_windows` ([collective
  windows holding a matmul, collective windows]) and `overlap_hlo` (the scheduled order of the computation
  that holds the collective: its starts, dones and matmuls, as XLA printed them)."""
  comps = parse.computations(hlo_text)
  fused = _fused_names(comps)
  dots = [(name, ins) for name, comp in comps.items() if name not in fused
          for ins in filter(None, map(parse.parse_instruction, comp.lines)) if async_windows.runs_dot(ins, comps)]
  wins = async_windows.windows(hlo_text, comps)
  inside = {(w.computation, ins.name) for w in wins for ins in w.between if async_windows.runs_dot(ins, comps)}
  holding = [w for w in wins if any(async_windows.runs_dot(ins, comps) for ins in w.between)]
  out: dict[str, Any] = {"overlap_windows": [len(holding), len(wins)],
                         "overlap_hlo": _order_lines(comps, wins, dots)}
  if not dots:
    return {**out, "overlap_scheduled": False, "overlap_schedule": "no matmul in the compiled program"}
  if not async_windows.is_scheduled(hlo_text):
    return {**out, "overlap_scheduled": False,
            "overlap_schedule": "the module is not scheduled (no is_scheduled=true): its order says nothing"}
  if not wins:
    return {**out, "overlap_scheduled": False, "overlap_schedule": (
        "the collective compiled synchronous (no async start/done pair): nothing can run beside it")}
  outside = [(c, ins) for c, ins in dots if (c, ins.name) not in inside]
  if outside:
    c, ins = outside[0]
    return {**out, "overlap_scheduled": False, "overlap_schedule": (
        f"{len(outside)} of {len(dots)} matmuls run outside every collective's start-done window (first:"
        f" %{ins.name} in {c}): serialised with the collective")}
  share = "" if len(holding) == len(wins) else (
      f"; only {len(holding)} of {len(wins)} collective windows hold one (the others run the collective alone, which"
      " bounds the overlap)")
  return {**out, "overlap_scheduled": True, "overlap_schedule": (
      f"every matmul ({len(dots)}) runs between a collective's start and done{share}")}


_SHOWN = {f"{op}{sfx}" for op in parse.OPS for sfx in ("", "-start", "-done")} | {"async-start", "async-done"}


def _order_lines(comps, wins: list[async_windows.Window], dots) -> list[str]:
  """The scheduled order of the computation holding the first window (or the first matmul): each start, done
  and matmul as `%name = opcode`, in order."""
  def shown(ins: parse.Instr) -> bool:
    return ins.opcode in _SHOWN or async_windows.runs_dot(ins, comps)

  where = wins[0].computation if wins else next(
      (c for c, _ in dots if any(ins.opcode in parse.OPS for ins in filter(None, map(parse.parse_instruction,
                                                                                     comps[c].lines)))),
      dots[0][0] if dots else None)
  if where is None:
    return []
  lines = []
  for ins in filter(None, map(parse.parse_instruction, comps[where].lines)):
    if shown(ins):
      kind = " (matmul)" if async_windows.runs_dot(ins, comps) else ""
      lines.append(f"%{ins.name} = {ins.opcode}{kind}")
  return lines


def time_arms(arms: list[tuple[Any, Any]], carries: list[tuple], warmup: int, samples: int,
              barrier: Callable[[], None], period: int = 1) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[tuple]]:
  """Seconds per call of each arm's (short, long) programs, interleaved: each of `samples` rounds runs a pair
  of every arm in turn (short and long, the order flipping every round), so the arms see the same machine.
  The untimed checked calls come first, as in program.time_pairs (program.untimed_calls; an arm without
  twins runs its own programs there), so program.chain_reps counts each arm's final carry alike."""
  def run(prog, carry):
    out = prog.fn(*carry)
    jax.block_until_ready(out)
    return out

  carries = list(carries)
  for a, (short, long) in enumerate(arms):
    by_name = {"short": short, "long": long}
    for name in program.untimed_calls(warmup, short.reps, long.reps, period):
      carries[a] = run(getattr(by_name[name], "checked", None) or by_name[name], carries[a])
  times = [([], []) for _ in arms]
  for i in range(samples):
    for a, (short, long) in enumerate(arms):
      for prog in ((short, long) if i % 2 == 0 else (long, short)):
        barrier()
        t0 = time.perf_counter()
        carries[a] = run(prog, carries[a])
        times[a][0 if prog is short else 1].append(time.perf_counter() - t0)
  return [(np.asarray(s), np.asarray(l)) for s, l in times], carries


def per_op_s(t_short: np.ndarray, t_long: np.ndarray, reps_short: int, reps_long: int) -> tuple[float, str]:
  """Median seconds per operation from [process, sample] call times (each sample the slowest process's), by
  difference; the long arm's average where the difference is not positive (and the method says so)."""
  s, l = t_short.max(axis=0), t_long.max(axis=0)
  med = float(np.median((l - s) / (reps_long - reps_short)))
  if med > 0:
    return med, "difference"
  return float(np.median(l / reps_long)), "long-arm average (difference unresolved)"


_RATES: dict[tuple, float] = {}  # (mesh, dtype) -> FLOP/s per device: measured once per sweep


def matmul_rate(mesh: jax.sharding.Mesh, dtype: str, gather: Callable[[np.ndarray], np.ndarray],
                barrier: Callable[[], None]) -> float:
  """FLOP/s of one device's matmul while every device runs one (as the arms run), measured once per mesh and
  dtype: a compute arm at PROBE_DIM, timed by difference (every process agrees: the slowest's times)."""
  key = (mesh, dtype)
  if key not in _RATES:
    kind = "cpu" if program.platform_of(mesh) == "cpu" else "gpu"
    dim = PROBE_DIM[kind]
    short, long = build_compute(mesh, dim, dtype, program.SHORT_REPS), build_compute(mesh, dim, dtype, PROBE_REPS)
    (ts, tl) = time_arms([(short, long)], [compute_inputs(mesh, dim, dtype)], 1, PROBE_PAIRS, barrier)[0][0]
    t_op, _ = per_op_s(gather(ts), gather(tl), short.reps, long.reps)
    _RATES[key] = 2 * dim ** 3 / t_op
  return _RATES[key]


def measure(spec: int | str, point: program.Point, short: program.Compiled, long: program.Compiled,
            t_comm_s: float, warmup: int, samples: int, barrier: Callable[[], None],
            gather: Callable[[np.ndarray], np.ndarray], check: bool = True) -> dict[str, Any]:
  """The overlap fields of a measured point: the matmul sized (AUTO: from the point's time `t_comm_s` and the
  measured rate) or given, the three arms built at the point's k, timed interleaved and checked, OSU's
  percentage, the both arm's schedule, and whether overlap is measurable on this platform."""
  coll, mesh, plan, platform = point.collective, point.mesh, point.scope, point.platform
  cdtype = compute_dtype(point.dtype)
  rec: dict[str, Any] = {"overlap_mode": "auto" if spec == AUTO else "given", "overlap_compute_dtype": cdtype}
  if spec == AUTO:
    rate = matmul_rate(mesh, cdtype, gather, barrier)
    dim = size_dim(t_comm_s, rate, platform)
    rec["overlap_rate_tflops"] = rate / 1e12
    rec["overlap_sizing"] = (f"auto: {t_comm_s * 1e6:.4g} us of collective at {rate / 1e12:.4g} TFLOP/s per device"
                             f" (measured once, D = {PROBE_DIM['cpu' if platform == 'cpu' else 'gpu']}) -> D = {dim}")
  else:
    dim = int(spec)
    rec["overlap_sizing"] = f"given: D = {dim}"
  rec.update(overlap_dim=dim, overlap_flops=2 * dim ** 3)
  arms = [(short, long),
          (build_compute(mesh, dim, cdtype, short.reps, coll), build_compute(mesh, dim, cdtype, long.reps, coll)),
          (build_both(coll, mesh, plan, point.count, point.dtype, dim, short.reps, short),
           build_both(coll, mesh, plan, point.count, point.dtype, dim, long.reps, long))]
  rec.update(schedule_check(arms[2][1].hlo_text))
  m0, p = compute_inputs(mesh, dim, cdtype)
  m1, p1 = compute_inputs(mesh, dim, cdtype)
  carries = [program.initial_carry(point), (m0, p), (*program.initial_carry(point), m1, p1)]
  period = coll.period(plan.group_size)
  times, carries = time_arms(arms, carries, warmup, samples, barrier, period)
  (t_comm, how_c), (t_compute, how_m), (t_overall, how_b) = [
      per_op_s(gather(ts), gather(tl), short.reps, long.reps) for ts, tl in times]
  methods = {how_c, how_m, how_b}
  rec.update(t_comm_us=t_comm * 1e6, t_compute_us=t_compute * 1e6, t_overall_us=t_overall * 1e6,
             overlap_pct=osu_overlap_pct(t_overall, t_compute, t_comm), overlap_compute_vs_comm=t_compute / t_comm,
             overlap_time_method=methods.pop() if len(methods) == 1 else "mixed: " + ", ".join(sorted(methods)))
  reps, digested = program.chain_reps(warmup, samples, short.reps, long.reps, period=period)
  wrong = check_compute(mesh, carries[1][0], dim, reps) + check_compute(mesh, carries[2][-2], dim, reps)
  rec["overlap_compute_wrong"] = int(gather(np.asarray([wrong], np.int64)).sum())
  if check:
    comm_wrong, _ = program.check_timed(point, carries[0], reps, digested)
    both_wrong, note = program.check_timed(point, carries[2][:-2], reps, digested)
    if coll.compared_to_op(plan.group_size, platform):  # no known output: the both arm replayed beside its twins
      replay_wrong, replayed = program.replay_check(
          point, *arms[2], fresh=lambda: (*program.initial_carry(point), *compute_inputs(mesh, dim, cdtype)), acc_at=-3)
      both_wrong += replay_wrong
      note += f"; both arm: {replayed}"
    rec["overlap_timed_wrong"] = None if comm_wrong is None else int(
        gather(np.asarray([comm_wrong + both_wrong], np.int64)).sum())
    rec["overlap_timed_check"] = f"comm and both arms: {note}; the matmuls: m0 rolled by {reps} compared exactly"
  rec["overlap_measurable"] = platform != "cpu" and rec["overlap_windows"][1] > 0
  if platform == "cpu":
    rec["overlap_note"] = CPU_NOTE
  elif not rec["overlap_scheduled"]:
    rec["overlap_note"] = f"not overlapped as compiled: {rec['overlap_schedule']}"
  return rec


def compiled_facts(spec: int | str, coll: Collective, mesh: jax.sharding.Mesh, plan: ScopePlan, count: int,
                   dtype: str, long: program.Compiled) -> dict[str, Any]:
  """A point compiled for a GPU target (nothing runs): the both arm at the long arm's k, its checks, its
  schedule and memory. AUTO compiles D = TARGET_DIM (no time to size from)."""
  from microbench.aot import gpu_compile  # pylint: disable=g-import-not-at-top
  dim = TARGET_DIM if spec == AUTO else int(spec)
  both = build_both(coll, mesh, plan, count, dtype, dim, long.reps, long, digest=False)  # nothing runs: no twin
  out = {"overlap_mode": "auto" if spec == AUTO else "given", "overlap_dim": dim, "overlap_flops": 2 * dim ** 3,
         "overlap_compute_dtype": compute_dtype(dtype), "overlap_memory": gpu_compile.memory(both.fn),
         **schedule_check(both.hlo_text)}
  out["overlap_sizing"] = (f"--target times nothing: auto compiled a [{dim} x {dim}] matmul (--overlap=N for another)"
                           if spec == AUTO else f"given: D = {dim}")
  if not out["overlap_scheduled"]:
    out["overlap_note"] = f"not overlapped as compiled: {out['overlap_schedule']}"
  return out


def wrong(rec: dict[str, Any]) -> int:
  """Ranks whose overlap arms were wrong: the matmul's result, or the comm or both arm's collective output."""
  return int(rec.get("overlap_compute_wrong") or 0) + int(rec.get("overlap_timed_wrong") or 0)


def console_lines(rec: dict[str, Any]) -> list[str]:
  """The lines a point's overlap fields add under its table row."""
  if "overlap_dim" not in rec:
    return []
  d = rec["overlap_dim"]
  what = f"[{d} x {d}] {rec['overlap_compute_dtype']} matmul ({rec['overlap_mode']})"
  win = rec.get("overlap_windows", [0, 0])
  cpu = rec.get("overlap_note") == CPU_NOTE
  sched = ("not measurable on cpu (no async collectives)" if cpu
           else f"scheduled inside the collective ({win[0]}/{win[1]} windows)" if rec.get("overlap_scheduled")
           else "NOT scheduled inside the collective")
  if "t_overall_us" in rec:
    bad = ""
    if wrong(rec):
      bad = (f"  WRONG (matmul on {rec['overlap_compute_wrong']} device(s), collective on"
             f" {rec.get('overlap_timed_wrong') or 0} rank(s))")
    line = (f"#   overlap: comm {rec['t_comm_us']:.2f} us, compute {rec['t_compute_us']:.2f} us ({what}), both"
            f" {rec['t_overall_us']:.2f} us -> {rec['overlap_pct']:.0f}% (OSU); {sched}{bad}")
  else:
    line = f"#   overlap: {what}, {sched}"
  lines = [line]
  if rec.get("overlap_note") and not cpu:  # the CPU's note is said once, before the sweep
    lines.append(f"#   overlap {rec['overlap_note']}")
  return lines
