"""The collectives, each a small unit registered by name.

A collective says how its per-rank buffer relates to nccl-tests' size S, its bus-bandwidth factor, the op
inside `shard_map`, one repetition `step` on a loop carry (the feedback that makes the next repetition depend
on this one without copying the S buffer), the HLO op it must compile to on each platform, which family of
known inputs checks it, and what its output must be: `reference` states it in NumPy on any inputs (the
readable specification, checked by the tests), `expected` computes any range of one rank's output on the
known check inputs without building the whole group's inputs (the check streams through it).

Adding one: subclass `Collective`, fill in the few methods, decorate with `@register`.
"""

from __future__ import annotations

import abc

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from microbench.bench.known_inputs import GroupInputs

REGISTRY: dict[str, "Collective"] = {}


def register(cls: type["Collective"]) -> type["Collective"]:
  REGISTRY[cls.name] = cls()
  return cls


def get(name: str) -> "Collective":
  return REGISTRY[name]


class Collective(abc.ABC):
  """One collective: sizes, cost factor, the op and its repetition step, the expected HLO op, the check."""

  name: str = ""
  hlo_op: str = ""  # the HLO opcode the op must compile to
  inputs: str = "data"  # known-input family: "data" (data only moves) or "sum" (values are added)
  ordered_groups: bool = False  # output order follows the replica group's order (checked in the HLO)

  def count_multiple(self, n: int) -> int:
    """Per-rank element count (of the S buffer) must be a multiple of this."""
    return 1

  @abc.abstractmethod
  def busbw_factor(self, n: int) -> float:
    """algbw -> busbw factor for a group of n (see README: Metrics)."""

  def in_count(self, count: int, n: int) -> int:
    """Per-rank input elements, given the S buffer's element count."""
    return count

  def out_count(self, count: int, n: int) -> int:
    return count

  @abc.abstractmethod
  def op(self, x: jax.Array, axes: tuple[str, ...], n: int, platform: str) -> jax.Array:
    """The collective itself on this rank's buffer (called inside shard_map on a mesh of `platform`)."""

  def carry(self, x: jax.Array, out_count: int) -> tuple[jax.Array, ...]:
    """The loop carry the timed repetitions start from."""
    return (x,)

  def step(self, carry: tuple[jax.Array, ...], axes: tuple[str, ...], n: int,
           platform: str) -> tuple[jax.Array, ...]:
    """One repetition: the op, its output fed to the next one (so XLA can neither drop nor merge
    repetitions). Two steps form the loop body, so the output of one lands in the buffer the next one
    frees and the body needs no copy of the S buffer."""
    (x,) = carry
    return (self.op(x, axes, n, platform),)

  @abc.abstractmethod
  def reference(self, xs: np.ndarray) -> np.ndarray:
    """Expected outputs [n, out] of a group from its inputs [n, in], in group-rank order."""

  @abc.abstractmethod
  def expected(self, inputs: GroupInputs, rank: int, in_count: int, start: int, stop: int) -> np.ndarray:
    """Output elements [start, stop) of group rank `rank` on the known inputs (exact integers, int64)."""

  def after(self, inputs: GroupInputs, rank: int, in_count: int, reps: int) -> tuple[np.ndarray, ...] | str:
    """The timed programs' final carry of group rank `rank` after `reps` (even, >= 2) repetitions from the
    known inputs, as float64 arrays (NaN: an element not checked), or a string saying why it can't be known
    exactly. Compared element by element with what the timed program returns (program.check_timed)."""
    return "no exact value after the repetitions is known for this collective"

  def hlo_expect(self, platform: str) -> str:
    return self.hlo_op

  def impl(self, platform: str) -> str:
    return self.hlo_expect(platform)


@register
class AllReduce(Collective):
  name, hlo_op, inputs = "all_reduce", "all-reduce", "sum"

  def busbw_factor(self, n):
    return 2 * (n - 1) / n

  def op(self, x, axes, n, platform):
    return lax.psum(x, axes)

  def reference(self, xs):
    return np.broadcast_to(xs.sum(0), xs.shape)

  def expected(self, inputs, rank, in_count, start, stop):
    return inputs.total(start, stop)

  def after(self, inputs, rank, in_count, reps):
    if inputs.dtype != "int32":
      return (f"a {inputs.dtype} all-reduce repeated {reps} times holds n^{reps - 1} x the sum, rounded on the way:"
              " no exact value (the check program's exact comparison stands for the op)")
    total = inputs.total(0, in_count).astype(np.int64) * pow(inputs.n, reps - 1, 1 << 32)  # int32 wraps mod 2^32
    return (((total + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.float64),)


@register
class AllGather(Collective):
  """S is the per-rank output (n x the input shard)."""
  name, hlo_op, ordered_groups = "all_gather", "all-gather", True

  def count_multiple(self, n):
    return n

  def busbw_factor(self, n):
    return (n - 1) / n

  def in_count(self, count, n):
    return count // n

  def op(self, x, axes, n, platform):
    return lax.all_gather(x, axes, tiled=True)

  def carry(self, x, out_count):
    return (x, jnp.zeros((out_count,), x.dtype))  # the gathered output stays live in the carry

  def step(self, carry, axes, n, platform):
    x, _ = carry
    y = self.op(x, axes, n, platform)
    return (_depend(x, y), y)

  def reference(self, xs):
    return np.broadcast_to(xs.reshape(-1), (xs.shape[0], xs.size))

  def expected(self, inputs, rank, in_count, start, stop):
    return _from_chunks(in_count, start, stop, lambda q, a, b: inputs.rank(q, a, b))

  def after(self, inputs, rank, in_count, reps):
    first = float(inputs.rank(0, 0, 1)[0])  # every step writes the gathered first element (rank 0's) into x[0]
    shards = [inputs.rank(q, 0, in_count).astype(np.float64) for q in range(inputs.n)]
    for shard in shards:
      shard[0] = first
    return shards[rank], np.concatenate(shards)


@register
class ReduceScatter(Collective):
  """S is the per-rank input (n x the output shard)."""
  name, hlo_op, inputs, ordered_groups = "reduce_scatter", "reduce-scatter", "sum", True

  def count_multiple(self, n):
    return n

  def busbw_factor(self, n):
    return (n - 1) / n

  def out_count(self, count, n):
    return count // n

  def op(self, x, axes, n, platform):
    return lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)

  def carry(self, x, out_count):
    return (x, jnp.zeros((out_count,), x.dtype))  # the scattered output stays live in the carry

  def step(self, carry, axes, n, platform):
    x, _ = carry
    y = self.op(x, axes, n, platform)
    return (_depend(x, y), y)

  def reference(self, xs):
    n = xs.shape[0]
    return xs.sum(0).reshape(n, -1)

  def expected(self, inputs, rank, in_count, start, stop):
    base = rank * (in_count // inputs.n)
    return inputs.total(base + start, base + stop)

  def after(self, inputs, rank, in_count, reps):
    """x[0] takes the output's first element each step, so only element 0 of rank 0's chunk (fed by every
    rank's x[0]) keeps changing; everything else is known exactly."""
    ch = in_count // inputs.n
    y = inputs.total(rank * ch, (rank + 1) * ch).astype(np.float64)
    x = inputs.rank(rank, 0, in_count).astype(np.float64)
    x[0] = y[0]
    if rank == 0:
      x[0] = y[0] = np.nan
    return x, y


@register
class AllToAll(Collective):
  name, hlo_op, ordered_groups = "all_to_all", "all-to-all", True

  def count_multiple(self, n):
    return n

  def busbw_factor(self, n):
    return (n - 1) / n

  def op(self, x, axes, n, platform):
    return lax.all_to_all(x, axes, 0, 0, tiled=True)

  def reference(self, xs):
    n = xs.shape[0]
    return xs.reshape(n, n, -1).transpose(1, 0, 2).reshape(n, -1)

  def expected(self, inputs, rank, in_count, start, stop):
    chunk = in_count // inputs.n  # output chunk j is chunk `rank` of rank j's input
    return _from_chunks(chunk, start, stop, lambda j, a, b: inputs.rank(j, rank * chunk + a, rank * chunk + b))

  def after(self, inputs, rank, in_count, reps):
    if reps % 2:
      return (self.expected(inputs, rank, in_count, 0, in_count).astype(np.float64),)
    return (inputs.rank(rank, 0, in_count).astype(np.float64),)  # twice is the identity


@register
class Broadcast(Collective):
  """From group rank 0. Where XLA lowers `collective-broadcast` (GPUs) that is what runs; elsewhere the
  masked all-reduce JAX documents as its equivalent, recorded as the record's `impl`. `native` is the one
  place that decides, from the mesh's platform."""
  name, hlo_op, ordered_groups = "broadcast", "collective-broadcast", True

  @staticmethod
  def native(platform: str) -> bool:
    return platform == "gpu"

  def busbw_factor(self, n):
    return 1.0

  def hlo_expect(self, platform):
    return "collective-broadcast" if self.native(platform) else "all-reduce"

  def impl(self, platform):
    return "collective-broadcast" if self.native(platform) else "masked all-reduce"

  def op(self, x, axes, n, platform):
    if self.native(platform):
      return lax.pbroadcast(x, axes, 0)
    return lax.psum(jnp.where(lax.axis_index(axes) == 0, x, jnp.zeros_like(x)), axes)

  def reference(self, xs):
    return np.broadcast_to(xs[0], xs.shape)

  def expected(self, inputs, rank, in_count, start, stop):
    return inputs.rank(0, start, stop)

  def after(self, inputs, rank, in_count, reps):
    return (inputs.rank(0, 0, in_count).astype(np.float64),)


@register
class PPermute(Collective):
  """Point-to-point, as nccl-tests' sendrecv: each rank sends its buffer to the next rank of its group."""
  name, hlo_op = "ppermute", "collective-permute"

  def busbw_factor(self, n):
    return 1.0

  def pairs(self, n: int) -> list[tuple[int, int]]:
    """(source, target) group ranks."""
    return [(i, (i + 1) % n) for i in range(n)]

  def op(self, x, axes, n, platform):
    return lax.ppermute(x, axes, self.pairs(n))

  def reference(self, xs):
    return np.roll(xs, 1, axis=0)

  def expected(self, inputs, rank, in_count, start, stop):
    return inputs.rank((rank - 1) % inputs.n, start, stop)

  def after(self, inputs, rank, in_count, reps):
    return (inputs.rank((rank - reps) % inputs.n, 0, in_count).astype(np.float64),)


def _depend(x: jax.Array, y: jax.Array) -> jax.Array:
  """The next repetition's input: `x` with its first element replaced by the output's first element, in
  place. One element is enough to order the repetitions (the next one can't start before this one's output
  exists, and no two inputs are the same); the output stays live in the carry, so nothing of it can be
  dropped. A whole-shard feedback would add 1/n of the message of memory traffic to every repetition."""
  return lax.dynamic_update_slice(x, y[:1], (0,))


def _from_chunks(chunk: int, start: int, stop: int, source) -> np.ndarray:
  """Output elements [start, stop) of an output made of `chunk`-long pieces, piece j's local range [a, b)
  given by `source(j, a, b)`."""
  parts = []
  for j in range(start // chunk, (stop - 1) // chunk + 1 if stop > start else start // chunk):
    a, b = max(start, j * chunk) - j * chunk, min(stop, (j + 1) * chunk) - j * chunk
    parts.append(source(j, a, b))
  return np.concatenate(parts) if parts else np.empty(0, np.int64)


NAMES = tuple(REGISTRY)
