"""One benchmark point: build the jitted program, check its result, time it.

The collective runs `k` times inside one jitted `fori_loop`, each repetition fed by the previous one's
output, so XLA can neither drop nor merge repetitions and host dispatch is paid once per `k` operations.
`k` is a runtime argument: the correctness check (k=1), warm-up and timed runs share one compiled program.
Barriers sit outside the timed region; compile time is measured separately.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from meshes.scopes import ScopePlan
from meshes.topology import AXES
from microbench.bench import hlo_check, known_inputs
from microbench.bench.collectives import Collective
from microbench.hlo.parse import HloCollective

CHECK_CHUNK = 1 << 22  # elements compared at a time: host memory for the check stays small

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "int32": jnp.int32}


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
  """NumPy array in `dtype` (bfloat16 via ml_dtypes, which jax depends on)."""
  return np.asarray(values, np.dtype(DTYPES[dtype]))  # no copy when it already is


def tolerance(dtype: str, n: int) -> float:
  """Absolute tolerance for values of magnitude <= 8n: a few ulps of the dtype at that magnitude."""
  if dtype == "int32":
    return 0.0
  eps = float(jnp.finfo(DTYPES[dtype]).eps)
  return 2 * eps * 8 * n


@dataclasses.dataclass
class Program:
  """A compiled benchmark program and the arrays it runs on."""
  collective: Collective
  scope: ScopePlan
  dtype: str
  count: int  # elements of the S buffer per rank
  compiled: Callable
  hlo_text: str
  hlo_match: HloCollective
  compile_s: float
  mesh: jax.sharding.Mesh
  x: jax.Array | None = None

  @property
  def n(self) -> int:
    return self.scope.group_size


def _global_array(mesh: jax.sharding.Mesh, per_rank: int, fill: Callable[[np.ndarray, int], np.ndarray],
                  dtype) -> jax.Array:
  sharding = jax.NamedSharding(mesh, jax.P(AXES))

  def cb(index):
    sl = index[0]
    start = sl.start or 0
    stop = sl.stop if sl.stop is not None else mesh.size * per_rank
    positions = np.arange(start // per_rank, stop // per_rank)
    return fill(positions, per_rank).reshape(-1).astype(np.dtype(dtype))

  return jax.make_array_from_callback((mesh.size * per_rank,), sharding, cb)


def _scalar(mesh: jax.sharding.Mesh, value: int) -> jax.Array:
  return jax.make_array_from_callback((), jax.NamedSharding(mesh, jax.P()), lambda _: np.int32(value))


def build(coll: Collective, mesh: jax.sharding.Mesh, scope: ScopePlan, count: int, dtype: str) -> Program:
  """Compiles the repeated-collective program and checks its HLO (raises hlo_check.HloMismatch)."""
  n = scope.group_size
  in_count, out_count = coll.in_count(count, n), coll.out_count(count, n)
  jdtype = DTYPES[dtype]
  axes = scope.axes

  def per_device(x, k):
    def body(_, carry):
      x, _y = carry
      y = coll.op(x, axes, n)
      return coll.feedback(y, x), y
    return jax.lax.fori_loop(0, k, body, (x, jnp.zeros((out_count,), jdtype)))

  # check_vma=False: outputs are fed back as loop carries; replication typing adds nothing to a benchmark.
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=(jax.P(AXES), jax.P()),
                     out_specs=(jax.P(AXES), jax.P(AXES)), check_vma=False)
  x_spec = jax.ShapeDtypeStruct((mesh.size * in_count,), jdtype, sharding=jax.NamedSharding(mesh, jax.P(AXES)))
  k_spec = jax.ShapeDtypeStruct((), jnp.int32, sharding=jax.NamedSharding(mesh, jax.P()))
  t0 = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=0).lower(x_spec, k_spec).compile()
  compile_s = time.perf_counter() - t0
  text = compiled.as_text()
  platform = mesh.devices.flat[0].platform
  match = hlo_check.verify(text, coll.hlo_expect(platform), scope.groups)
  return Program(coll, scope, dtype, count, compiled, text, match, compile_s, mesh)


def check(prog: Program, compare: bool = True) -> int:
  """Runs one repetition on known inputs; returns this process's count of wrong output elements.

  With `compare=False` the run still happens (it is the first execution, and leaves the input buffer for
  the timed runs) but the output is not compared.
  """
  coll, n = prog.collective, prog.n
  in_count, out_count = coll.in_count(prog.count, n), coll.out_count(prog.count, n)
  x = _global_array(prog.mesh, in_count, known_inputs.block, DTYPES[prog.dtype])
  x_out, y = prog.compiled(x, _scalar(prog.mesh, 1))
  prog.x = x_out
  if not compare:
    return 0
  groups = prog.scope.groups
  where = {int(p): (gi, r) for gi, g in enumerate(groups) for r, p in enumerate(g)}
  tol = tolerance(prog.dtype, n)
  wrong = 0
  for shard in y.addressable_shards:
    gi, rank = where[(shard.index[0].start or 0) // out_count]
    got = np.asarray(shard.data)
    for a in range(0, out_count, CHECK_CHUNK):
      b = min(out_count, a + CHECK_CHUNK)
      # Round the exact expectation to the dtype first, so both sides hold representable values.
      want = np.asarray(as_dtype(coll.expected(groups[gi], rank, in_count, a, b), prog.dtype), np.float32)
      wrong += int(np.count_nonzero(~(np.abs(np.asarray(got[a:b], np.float32) - want) <= tol)))
  del y
  return wrong


def choose_iters(prog: Program, max_iters: int, sample_s: float) -> int:
  """Repetitions per sample: `max_iters`, fewer (down to 1) when one operation already takes a good part
  of `sample_s`. Repetition exists to amortise the host dispatch of a program; once an operation is much
  longer than a dispatch, more repetitions only cost time. `sample_s <= 0` always gives `max_iters`."""
  if sample_s <= 0 or max_iters == 1:
    return max_iters
  k = _scalar(prog.mesh, 1)
  t0 = time.perf_counter()
  prog.x, y = prog.compiled(prog.x, k)
  jax.block_until_ready((prog.x, y))
  # One operation plus one dispatch overestimates the operation, so a sample stays within about sample_s.
  once = time.perf_counter() - t0
  return int(min(max_iters, max(1, round(sample_s / once))))


def time_runs(prog: Program, iters: int, warmup: int, samples: int, barrier: Callable[[], None],
              inject_delay_s: float = 0.0) -> np.ndarray:
  """Per-operation seconds for each timed sample (wall time of `iters` in-graph repetitions / iters)."""
  k = _scalar(prog.mesh, iters)
  x = prog.x
  for _ in range(warmup):
    x, y = prog.compiled(x, k)
    jax.block_until_ready((x, y))
  times = []
  for _ in range(samples):
    barrier()
    t0 = time.perf_counter()
    x, y = prog.compiled(x, k)
    jax.block_until_ready((x, y))
    if inject_delay_s:
      time.sleep(inject_delay_s)
    times.append((time.perf_counter() - t0) / iters)
  prog.x = None
  del x, y
  return np.asarray(times)


def make_barrier(mesh: jax.sharding.Mesh) -> Callable[[], None]:
  """A cross-process barrier (a tiny all-reduce over every device); a no-op in a single process."""
  if jax.process_count() == 1:
    return lambda: None
  fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, AXES), mesh=mesh, in_specs=jax.P(AXES),
                             out_specs=jax.P(), check_vma=False))
  ones = _global_array(mesh, 1, lambda p, c: np.ones((len(p), c)), jnp.int32)

  def barrier():
    fn(ones).block_until_ready()
  return barrier
