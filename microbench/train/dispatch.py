"""The mixture of experts' token dispatch, measured alone: one ragged all-to-all over the expert-parallel axis
with the send sizes the router chose in the run, timed as the benchmark times a collective.

Where the sizes come from: the training step reports each expert's assignments, summed over the whole batch,
its layers and microbatches (`moe_expert_assignments`, microbench.models.moe). One step's counts, divided by the
dispatches that step ran (layers x microbatches) and by the batch shards that route their own tokens, give
each device's assignments per dispatch, `a` rows of d_model elements; every source splits them over the
expert-parallel ranks in proportion to the tokens those ranks' experts received (cumulative rounding, so a
row sums to `a` exactly). Per-source differences are averaged out; the experts' skew, which sets the busiest
receiver and so the dispatch's time, is the router's.

How it is timed (the benchmark's method, microbench.bench.program, rebuilt here: the two measurements never
import each other): a program of 2 dispatches and one of `LONG_REPS`, each a `fori_loop` with a static trip
count whose repetitions write into the previous one's output buffer (which orders them), run alternately;
each round gives (T_long - T_short) / (LONG_REPS - 2) per dispatch, so launch and per-call costs cancel; the
figure is the median with its 95% interval. Both programs must run exactly their dispatches as compiled
(counted through the loop's known trip count: a merged or dropped exchange is not timed). Before timing, one
dispatch of known integer rows is compared exactly (int32: source rank x a + row index), so the sizes and
offsets the timed programs use are checked.

On GPUs the op is XLA's `ragged-all-to-all` (what `--moe_dispatch=ragged_all_to_all` runs in the model).
XLA:CPU has none, so on CPU the same output comes from a dense all-to-all of the runs padded to the largest
(more bytes than the ragged op sends): the record's `moe_dispatch_op` says which ran.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from microbench.fabric import conventions
from microbench.hlo import parse
from microbench.train import overheads

LONG_REPS = 10  # dispatches in the long program (the short one runs 2)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Rows each expert-parallel rank sends to each, for one dispatch of one device."""
  rows: np.ndarray  # [ep, ep] int64, source x destination

  @property
  def ep(self) -> int:
    return int(self.rows.shape[0])

  @property
  def input_offsets(self) -> np.ndarray:
    return np.cumsum(self.rows, axis=1) - self.rows

  @property
  def output_offsets(self) -> np.ndarray:
    return np.cumsum(self.rows, axis=0) - self.rows

  @property
  def sent(self) -> int:
    """Rows each source sends (its own share included): the S of the dispatch."""
    return int(self.rows[0].sum())

  @property
  def received(self) -> np.ndarray:
    return self.rows.sum(axis=0)


def sizes_from_counts(expert_assignments: np.ndarray, ep: int, dispatches: int, batch_shards: int) -> Sizes:
  """One step's per-expert assignments [E] (summed over the batch, layers and microbatches) -> the rows each
  device sends each expert-parallel rank per dispatch (experts split in contiguous blocks over ranks, as the
  model shards them)."""
  counts = np.rint(np.asarray(expert_assignments, np.float64)).astype(np.int64)
  e = counts.shape[0]
  if e % ep:
    raise ValueError(f"ep:{ep} does not divide the {e} experts")
  per_rank = counts.reshape(ep, e // ep).sum(axis=1)
  a = int(round(counts.sum() / (dispatches * batch_shards)))
  if per_rank.sum() == 0 or a == 0:
    return Sizes(np.zeros((ep, ep), np.int64))
  bounds = (a * np.cumsum(per_rank)) // per_rank.sum()
  row = np.diff(np.concatenate([[0], bounds]))
  return Sizes(np.tile(row, (ep, 1)))


def busbw_factor(sizes: Sizes) -> float:
  return conventions.ragged_busbw_factor(sizes.rows.tolist())


def _exchange(x: jax.Array, buf: jax.Array, sizes: Sizes, axis: str, native: bool) -> jax.Array:
  """The ragged all-to-all of this device's rows `x` [a, D] into `buf` [R, D] over `axis` (inside shard_map)."""
  rows = jnp.asarray(sizes.rows, jnp.int32)
  ins, outs = jnp.asarray(sizes.input_offsets, jnp.int32), jnp.asarray(sizes.output_offsets, jnp.int32)
  r = jax.lax.axis_index(axis)
  if native:
    return jax.lax.ragged_all_to_all(x, buf, ins[r], rows[r], outs[r], rows[:, r], axis_name=axis)
  block = max(1, int(sizes.rows.max()))
  lowest = jnp.iinfo(x.dtype).min if jnp.issubdtype(x.dtype, jnp.integer) else jnp.finfo(x.dtype).min
  after = (buf[0, 0] == jnp.asarray(lowest, buf.dtype)).astype(jnp.int32)  # orders repetitions, never true
  at = jnp.minimum(ins[r][:, None] + jax.lax.iota(jnp.int32, block)[None, :] + after, x.shape[0] - 1)
  got = jax.lax.all_to_all(x[at], axis, 0, 0, tiled=True)  # [ep, block, D]: row q from source q
  e = jax.lax.iota(jnp.int32, buf.shape[0])
  off, size = outs[:, r], rows[:, r]
  q = jnp.maximum(jnp.sum((e[:, None] >= off[None, :]).astype(jnp.int32), axis=1) - 1, 0)
  j = e - off[q]
  return jnp.where((j < size[q])[:, None], got[q, jnp.minimum(j, block - 1)], buf)


def executions(hlo_text: str, op: str) -> int | None:
  """How often the compiled program runs `op` per call (through loops' known trip counts); None when a count
  is unknown. The timed programs must run exactly their repetitions (XLA may merge or drop collectives)."""
  counts = parse.execution_counts(hlo_text)
  total = 0
  for c in parse.find_collectives(hlo_text):
    if c.op != op:
      return None
    times = counts.get(c.computation)
    if times is None:
      return None
    total += times
  return total


def _program(mesh: jax.sharding.Mesh, axis: str, sizes: Sizes, d: int, reps: int, native: bool):
  """(x, buf) -> buf after `reps` dispatches, every mesh axis manual (the other axes' groups run alike)."""
  axes = tuple(mesh.axis_names)

  def per_device(x, buf):
    x, buf = x.reshape(-1, d), buf.reshape(-1, d)
    if reps == 1:
      return _exchange(x, buf, sizes, axis, native).reshape(-1)
    out = jax.lax.fori_loop(0, reps, lambda _, b: _exchange(x, b, sizes, axis, native), buf)
    return out.reshape(-1)

  fn = jax.shard_map(per_device, mesh=mesh, in_specs=(jax.P(axes), jax.P(axes)), out_specs=jax.P(axes),
                     check_vma=False)
  return jax.jit(fn, donate_argnums=(1,))


def _array(mesh: jax.sharding.Mesh, per_device: int, dtype, fill=None) -> jax.Array:
  """[devices x per_device] sharded over every mesh axis: zeros, or `fill(position)` per device."""
  sharding = jax.NamedSharding(mesh, jax.P(tuple(mesh.axis_names)))

  def cb(index):
    if fill is None:
      return np.zeros(per_device, np.dtype(dtype))
    return fill((index[0].start or 0) // per_device).astype(np.dtype(dtype))
  return jax.make_array_from_callback((mesh.size * per_device,), sharding, cb)


def check(mesh: jax.sharding.Mesh, axis: str, sizes: Sizes, d: int, native: bool) -> int:
  """Wrong elements (over every process's devices) of one dispatch of known int32 rows: row i of expert-parallel
  rank s holds s x a + i in every column; the receiver must hold each source's run in source order, zeros past
  what it received."""
  a, ep = sizes.sent, sizes.ep
  out_rows = _out_rows(sizes, native)
  ranks = _axis_ranks(mesh, axis)
  x = _array(mesh, a * d, jnp.int32, lambda p: np.repeat(ranks[p] * a + np.arange(a), d))
  y = _program(mesh, axis, sizes, d, 1, native)(x, _array(mesh, out_rows * d, jnp.int32))
  wrong = 0
  for shard in y.addressable_shards:
    dst = ranks[(shard.index[0].start or 0) // (out_rows * d)]
    want = np.zeros(out_rows, np.int64)
    for s in range(ep):
      o, n, i = sizes.output_offsets[s, dst], sizes.rows[s, dst], sizes.input_offsets[s, dst]
      want[o:o + n] = s * a + i + np.arange(n)
    wrong += int(np.count_nonzero(np.asarray(shard.data).reshape(out_rows, d) != want[:, None]))
  if jax.process_count() > 1:  # every process must agree whether to time (the timed programs are collectives)
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    wrong = int(np.asarray(multihost_utils.process_allgather(np.asarray([wrong], np.int64))).sum())
  return wrong


def _axis_ranks(mesh: jax.sharding.Mesh, axis: str) -> np.ndarray:
  """Each mesh position's index along `axis` (row-major positions, as the sharded buffers are laid out)."""
  idx = np.indices(mesh.devices.shape)[list(mesh.axis_names).index(axis)]
  return idx.reshape(-1)


def _out_rows(sizes: Sizes, native: bool) -> int:
  """Output rows per device: the largest receive (the ragged op), or ep x the largest run (the padded one)."""
  if native:
    return max(1, int(sizes.received.max()))
  return sizes.ep * max(1, int(sizes.rows.max()))


def measure(mesh: jax.sharding.Mesh, axis: str, sizes: Sizes, d_model: int, dtype, rounds: int) -> dict[str, Any]:
  """The dispatch's record: what ran, its check, the time per dispatch (median over `rounds` alternating
  rounds of the 2- and LONG_REPS-dispatch programs, with its 95% interval), bytes and busbw."""
  native = mesh.devices.flat[0].platform == "gpu"
  itemsize = np.dtype(dtype).itemsize
  out: dict[str, Any] = {
      "moe_dispatch_op": "ragged-all-to-all" if native else
                         "padded all-to-all (XLA:CPU has no ragged-all-to-all; the ragged op runs on GPUs)",
      "moe_dispatch_rows": sizes.rows.tolist(), "moe_dispatch_d_model": d_model,
      "moe_dispatch_bytes": sizes.sent * d_model * itemsize,  # S: what each device sends, its own share included
      "moe_dispatch_busbw_factor": busbw_factor(sizes)}
  if sizes.sent == 0 or sizes.ep < 2:
    return {**out, "moe_dispatch_time_s": None, "moe_dispatch_note": "nothing to dispatch"}
  out["moe_dispatch_wrong"] = wrong = check(mesh, axis, sizes, d_model, native)
  if wrong:
    return {**out, "moe_dispatch_time_s": None, "moe_dispatch_note": f"{wrong} wrong elements: not timed"}
  out_rows = _out_rows(sizes, native)
  x = _array(mesh, sizes.sent * d_model, dtype, lambda p: np.ones(sizes.sent * d_model))
  buf = [_array(mesh, out_rows * d_model, dtype)]
  progs = {}
  for k in (2, LONG_REPS):
    progs[k] = _program(mesh, axis, sizes, d_model, k, native).lower(x, buf[0]).compile()
    ran = executions(progs[k].as_text(), "ragged-all-to-all" if native else "all-to-all")
    if ran != k:
      return {**out, "moe_dispatch_time_s": None,
              "moe_dispatch_note": f"the {k}-dispatch program runs {ran} exchanges per call as compiled: not timed"}

  def call(k):
    def run():
      buf[0] = jax.block_until_ready(progs[k](x, buf[0]))
    return run
  times = overheads.alternate({k: call(k) for k in progs}, rounds)
  per_op = [(tl - ts) / (LONG_REPS - 2) for ts, tl in zip(times[2], times[LONG_REPS])]
  t = statistics.median(per_op)
  ci = overheads.median_interval(per_op)
  out.update(moe_dispatch_time_s=t, moe_dispatch_time_ci=None if ci is None else list(ci),
             moe_dispatch_rounds=rounds,
             moe_dispatch_busbw_gbps=out["moe_dispatch_bytes"] * out["moe_dispatch_busbw_factor"] / t / 1e9
             if t > 0 else None)
  return out
