"""The known inputs and the expected outputs built on the devices, as nccl-tests fills and checks its buffers
on the GPU: one jitted generator and one jitted comparison per point, so the host moves no message.

The values are microbench.bench.known_inputs' (its docstring gives the formulas; the host version stays the
readable specification and tests compare the two element by element), computed in 32-bit integer arithmetic:
every product is either reduced below 2^31 first or taken mod the alphabet M, a power of two dividing 2^32, so
uint32 wrap-around gives the same residue. The tables a few formulas index (the per-element constants of one
period, each reduce-scatter chunk's residue step) are computed on the host once and passed in.

Each device learns which group and group rank it is from a small sharded array. A collective's expected
output is an elementwise function of the known inputs: data collectives name, per output element, the source
rank and element (`source`); reductions name the input element whose reduced value lands there (`reduced_at`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from microbench.bench import known_inputs as ki

_U = jnp.uint32
_TABLE_MAX = 1 << 23  # elements of a group's period table (32 MiB of int32) the comparison may build


def _tables(kind: str, dtype: str, n: int, count: int) -> dict[str, np.ndarray]:
  """The host-side tables of one family (int32/uint32), passed to the generator as replicated arrays."""
  if kind == "data":
    m = ki.ALPHABET[dtype]
    tabs = {"abcd": np.stack(ki._constants(m)).astype(np.uint32)}  # [4, P]
    if dtype in ki.FP8:
      tabs["letters"] = ki._fp8_letters(dtype).astype(np.int32)
    return tabs
  gi = ki.GroupInputs(kind, dtype, n, 0, count)
  tabs = {"h": ki._constants(1 << 24)[0].astype(np.int32)}  # [P]
  if gi.chunk:
    tabs["f"] = gi.chunk_residue(np.arange(n)).astype(np.int32)
  return tabs


class Family:
  """The known inputs of one point (kind, dtype, group size, message length, check run) as traceable
  functions of (group index, rank, element index), all int32/uint32 arrays."""

  def __init__(self, kind: str, dtype: str, n: int, count: int, run: int = 0, shift: int = 0):
    self.kind, self.dtype, self.n, self.count, self.run = kind, dtype, int(n), int(count), int(run)
    self.shift = int(shift)  # the data family's letter shift (known_inputs.alt_shift: the second input)
    if kind != "data":
      gi = ki.GroupInputs(kind, dtype, n, 0, count, run)
      self.k, self.chunk, self.q_max = gi.k, gi.chunk, gi.q_max
      self.modulus, self.base = ki._modulus(dtype), ki._base(dtype)
    self.host_tables = _tables(kind, dtype, n, count)

  def key(self) -> tuple:
    return (self.kind, self.dtype, self.n, self.count, self.run, self.shift)

  def value(self, tabs: dict, g, q, i) -> jax.Array:
    """Rank q's input at elements i of group g (int32; q and i broadcast against each other)."""
    if self.kind == "data":
      return self._data(tabs, g, q, i)
    start, qv, target = self._rule(tabs, g, i)
    return self._from_slot(start, qv, target, q)

  def rank_values(self, tabs: dict, g, q, count: int) -> jax.Array:
    """Rank q's whole input [count]: the data family, periodic in the element, is computed over one period
    and tiled (memcpy speed instead of four table lookups per element)."""
    if self.kind != "data":
      return self.value(tabs, g, q, jax.lax.iota(jnp.int32, count))
    values = self.value(tabs, g, q, jax.lax.iota(jnp.int32, min(count, ki.PERIOD)))
    return values if count <= ki.PERIOD else jnp.tile(values, -(-count // ki.PERIOD))[:count]

  def data_at(self, tabs: dict, g, q, j, n: int) -> jax.Array:
    """Data values of ranks q at elements j (arrays of one shape): from a table of every rank's period when the
    group's table is small (one lookup per element), else the formula."""
    if n * ki.PERIOD > _TABLE_MAX:
      return self._data(tabs, g, q, j)
    table = self._data(tabs, g, jax.lax.iota(jnp.int32, n)[:, None], jax.lax.iota(jnp.int32, ki.PERIOD)[None, :])
    return table.reshape(-1)[q * ki.PERIOD + j % ki.PERIOD]

  def reduced(self, tabs: dict, g, i) -> jax.Array:
    """The exact reduced value over the group at elements i (int32): T, or 2T for prod."""
    _, _, target = self._rule(tabs, g, i)
    return 2 * target if self.kind == "prod" else target

  def _data(self, tabs, g, q, i):
    m = ki.ALPHABET[self.dtype]
    mask = _U(m - 1)
    j = i % ki.PERIOD
    a, b, c, d = (tabs["abcd"][t][j] for t in range(4))
    q = q.astype(_U)
    lo, hi = q & mask, (q // _U(m)) & mask
    u = jnp.where((j + self.run) % 2 == 0, lo, (hi + c * lo) & mask)
    w = (a * u + b + d * (g.astype(_U) & mask) + _U(self.shift)) & mask
    if self.dtype in ki.FP8:
      return tabs["letters"][w.astype(jnp.int32)]
    return w.astype(jnp.int32) - m // 2

  def _rule(self, tabs, g, i):
    """(window start, q, T) at elements i: the sum family's rule (known_inputs.GroupInputs._rule)."""
    n = self.n
    offset = (self.run * self.count) % n
    start = ((((i % n) + offset).astype(_U) * _U(self.k)) % _U(n)).astype(jnp.int32)  # 2n k may pass 2^31
    h = tabs["h"][((i % ki.PERIOD) + (977 * g) % ki.PERIOD) % ki.PERIOD]
    qv = 1 + h % self.q_max
    residue = (i % self.chunk + tabs["f"][i // self.chunk]) if self.chunk else i
    target = self.base + (residue + ki.GROUP_STEP * g) % self.modulus
    return start, qv, target

  def _from_slot(self, start, qv, target, q):
    n, k = self.n, self.k
    slot = (q - start + n) % n
    if self.kind == "sum":
      return jnp.where(slot < k - 1, qv, jnp.where(slot == k - 1, target - (k - 1) * qv, 0))
    if self.kind == "prod":
      sign = 1 - 2 * ((k - 2) % 2)
      return jnp.where(slot < k - 2, -1, jnp.where(slot == k - 2, 2, jnp.where(slot == k - 1, sign * target, 1)))
    if self.kind == "max":
      return jnp.where(slot == 0, target, 1 + qv)
    return jnp.where(slot == 0, target, ki.HALF[self.dtype] + qv)


def where_array(mesh: jax.sharding.Mesh, groups: np.ndarray) -> jax.Array:
  """[devices x 2] int32 sharded like the buffers: each device's (group index, group rank)."""
  info = np.zeros((mesh.size, 2), np.int32)
  for gi, group in enumerate(groups):
    for r, p in enumerate(group):
      info[int(p)] = (gi, r)
  return jax.device_put(info.reshape(-1), jax.NamedSharding(mesh, jax.P(mesh.axis_names)))


@functools.lru_cache(maxsize=16)
def _device_tables(mesh: jax.sharding.Mesh, family_key: tuple) -> dict[str, jax.Array]:
  """A family's tables on every device, put there once (the generator and every comparison reuse them)."""
  return {k: jax.device_put(v, jax.NamedSharding(mesh, jax.P())) for k, v in Family(*family_key).host_tables.items()}


def device_tables(mesh: jax.sharding.Mesh, family: Family) -> dict[str, jax.Array]:
  """The family's tables on every device (put once; see _device_tables)."""
  return _device_tables(mesh, family.key())


@functools.lru_cache(maxsize=16)
def _generator(mesh: jax.sharding.Mesh, family_key: tuple, per_rank: int, names: tuple) -> Callable:
  family = Family(*family_key)

  def per_device(where, tabs):
    return family.rank_values(tabs, where[0], where[1], per_rank).astype(family.dtype)

  specs = {k: jax.P() for k in names}
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(jax.P(mesh.axis_names), specs), out_specs=jax.P(mesh.axis_names),
                               check_vma=False))


def inputs(mesh: jax.sharding.Mesh, family: Family, where: jax.Array, per_rank: int) -> jax.Array:
  """The known inputs of every rank, [devices x per_rank] in the dtype, made on the devices."""
  tabs = _device_tables(mesh, family.key())
  return _generator(mesh, family.key(), per_rank, tuple(sorted(tabs)))(where, tabs)


def expected_output(coll, family: Family, tabs: dict, g, r, out_count: int, in_count: int, n: int,
                    wire_dtype: str) -> jax.Array:
  """Group rank r's expected output, traced (the dtype's values; avg rounded as the platform does)."""
  e = jax.lax.iota(jnp.int32, out_count)
  if family.kind != "data":
    values = family.reduced(tabs, g, coll.reduced_at(r, e, n, in_count))
    if coll.redop == "avg":
      recip = float(ki.as_dtype(np.float32(1) / np.float32(n), wire_dtype))
      wire = jnp.dtype(getattr(jnp, wire_dtype))
      values = (values.astype(wire) * jnp.asarray(recip, wire)).astype(wire)
    values = values.astype(family.dtype)
    keep = coll.keeps_input(r, e, n, in_count)  # in place: the rest of the buffer is the rank's own input
    if keep is not None:
      values = jnp.where(keep, family.rank_values(tabs, g, r, in_count).astype(family.dtype), values)
    return values
  q, j = coll.source(r, e, n, in_count)  # q < 0: no source (a ragged output's unused tail): the buffer's fill
  q = jnp.broadcast_to(q, e.shape)
  return jnp.where(q >= 0, family.data_at(tabs, g, jnp.maximum(q, 0), j, n), ki.FILL[family.dtype]).astype(family.dtype)


@functools.lru_cache(maxsize=16)
def _comparison(mesh: jax.sharding.Mesh, coll, family_key: tuple, out_count: int, in_count: int, n: int,
                wire_dtype: str, names: tuple, exact: bool, digest: Callable | None = None) -> Callable:
  """exact=False: [1] float32 per rank, the wrong count (exact below 2^24; zero exactly when none), one fused
  pass (XLA:CPU writes an integer reduction's operand out first, a float one it fuses). exact=True: [2] int32,
  the count and the first wrong index, run only when something was wrong. With `digest` (quick only), also every
  rank's digest of the output, all-gathered, from the same read of it."""
  family = Family(*family_key)

  def per_device(y, where, tabs):
    g, r = where[0], where[1]
    want = expected_output(coll, family, tabs, g, r, out_count, in_count, n, wire_dtype)
    differs = y != want
    if not exact:
      count = jnp.sum(differs, dtype=jnp.float32).reshape(1)
      return count if digest is None else (count, jax.lax.all_gather(digest(y), mesh.axis_names, tiled=True))
    first = jnp.min(jnp.where(differs, jax.lax.iota(jnp.int32, out_count), jnp.int32(out_count)))
    return jnp.stack([jnp.sum(differs, dtype=jnp.int32), first])

  specs = {k: jax.P() for k in names}
  out_specs = jax.P(mesh.axis_names) if digest is None or exact else (jax.P(mesh.axis_names), jax.P())
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(jax.P(mesh.axis_names), jax.P(mesh.axis_names), specs),
                               out_specs=out_specs, check_vma=False))


def precompile(mesh: jax.sharding.Mesh, coll, family: Family, where: jax.Array, out_count: int, in_count: int,
               n: int, wire_dtype: str | None, digest: Callable | None = None) -> None:
  """Compiles the generator (without `wire_dtype`) or the quick comparison (with it) for these shapes ahead of
  their first call, so a sweep can compile them beside the point's own programs (jit's cache then holds
  them): called one after another, their compiles were seconds of a sweep's check time."""
  tabs = _device_tables(mesh, family.key())
  names = tuple(sorted(tabs))
  if wire_dtype is None:
    _generator(mesh, family.key(), in_count, names).lower(where, tabs).compile()
  else:
    y = jax.ShapeDtypeStruct((mesh.size * out_count,), jnp.dtype(family.dtype),
                             sharding=jax.NamedSharding(mesh, jax.P(mesh.axis_names)))
    _comparison(mesh, coll, family.key(), out_count, in_count, n, wire_dtype, names, exact=False,
                digest=digest).lower(y, where, tabs).compile()


def compare(mesh: jax.sharding.Mesh, coll, family: Family, y: jax.Array, where: jax.Array, out_count: int,
            in_count: int, n: int, wire_dtype: str, digest: Callable | None = None):
  """[devices, 2] for this process's devices, by mesh position (others -1): wrong elements and the first wrong
  element's index (out_count when none); with `digest`, (that, every rank's digest of `y`)."""
  tabs = _device_tables(mesh, family.key())
  args = (mesh, coll, family.key(), out_count, in_count, n, wire_dtype, tuple(sorted(tabs)))
  quick = _comparison(*args, exact=False, digest=digest)(y, where, tabs)
  digests = None
  if digest is not None:
    quick, digests = quick
  out = np.full((mesh.size, 2), -1, np.int64)
  any_wrong = np.zeros(1, np.int64)
  for shard in quick.addressable_shards:
    out[shard.index[0].start or 0] = (0, out_count)
    any_wrong += int(np.asarray(shard.data)[0] > 0)
  if jax.process_count() > 1:  # every process must run the exact comparison if any one needs it
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    any_wrong = np.asarray(multihost_utils.process_allgather(any_wrong)).sum(keepdims=True)
  if any_wrong[0]:
    res = _comparison(*args, exact=True)(y, where, tabs)
    for shard in res.addressable_shards:
      out[(shard.index[0].start or 0) // 2] = np.asarray(shard.data)
  return out if digest is None else (out, digests)
