"""The collectives, each a small unit registered by name.

A collective says how its per-rank buffer relates to nccl-tests' size S, its bus-bandwidth factor, one
step of the op inside `shard_map` (with the feedback that makes the next repetition depend on this one),
the HLO op it must compile to, and what its output must be: `reference` states it in NumPy on any inputs
(the readable specification, checked by the tests), `expected` computes any range of one rank's output on
the known check inputs without building the whole group's inputs (the check streams through it).

Adding one: subclass `Collective`, fill in the few methods, decorate with `@register`.
"""

from __future__ import annotations

import abc

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from microbench.bench.known_inputs import values

REGISTRY: dict[str, "Collective"] = {}


def register(cls: type["Collective"]) -> type["Collective"]:
  REGISTRY[cls.name] = cls()
  return cls


def get(name: str) -> "Collective":
  return REGISTRY[name]


class Collective(abc.ABC):
  """One collective: sizes, cost factor, the jitted step, the expected HLO op and a NumPy reference."""

  name: str = ""
  hlo_op: str = ""  # the HLO opcode the step must compile to

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
  def op(self, x: jax.Array, axes: tuple[str, ...], n: int) -> jax.Array:
    """The collective itself on this rank's buffer (called inside shard_map)."""

  def feedback(self, y: jax.Array, x: jax.Array) -> jax.Array:
    """Next repetition's input from this output, so repetitions can be neither dropped nor merged."""
    return y

  @abc.abstractmethod
  def reference(self, xs: np.ndarray) -> np.ndarray:
    """Expected outputs [n, out] of a group from its inputs [n, in], in group-rank order."""

  @abc.abstractmethod
  def expected(self, group: np.ndarray, rank: int, in_count: int, start: int, stop: int) -> np.ndarray:
    """Output elements [start, stop) of group rank `rank` on the known inputs (float32)."""

  def hlo_expect(self, platform: str) -> str:
    return self.hlo_op

  def impl(self, platform: str) -> str:
    return self.hlo_expect(platform)


@register
class AllReduce(Collective):
  name, hlo_op = "all_reduce", "all-reduce"

  def busbw_factor(self, n):
    return 2 * (n - 1) / n

  def op(self, x, axes, n):
    return lax.psum(x, axes)

  def reference(self, xs):
    return np.broadcast_to(xs.sum(0), xs.shape)

  def expected(self, group, rank, in_count, start, stop):
    return sum(values(p, start, stop) for p in group)


@register
class AllGather(Collective):
  """S is the per-rank output (n x the input shard)."""
  name, hlo_op = "all_gather", "all-gather"

  def count_multiple(self, n):
    return n

  def busbw_factor(self, n):
    return (n - 1) / n

  def in_count(self, count, n):
    return count // n

  def op(self, x, axes, n):
    return lax.all_gather(x, axes, tiled=True)

  def feedback(self, y, x):
    return y[:x.shape[0]]  # group rank 0's shard: a fixed slice XLA can't fold into the gather

  def reference(self, xs):
    return np.broadcast_to(xs.reshape(-1), (xs.shape[0], xs.size))

  def expected(self, group, rank, in_count, start, stop):
    return _from_chunks(group, in_count, start, stop, lambda q, a, b: (q, a, b))


@register
class ReduceScatter(Collective):
  """S is the per-rank input (n x the output shard)."""
  name, hlo_op = "reduce_scatter", "reduce-scatter"

  def count_multiple(self, n):
    return n

  def busbw_factor(self, n):
    return (n - 1) / n

  def out_count(self, count, n):
    return count // n

  def op(self, x, axes, n):
    return lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)

  def feedback(self, y, x):
    return lax.dynamic_update_slice(x, y, (0,))  # in place on the loop carry

  def reference(self, xs):
    n = xs.shape[0]
    return xs.sum(0).reshape(n, -1)

  def expected(self, group, rank, in_count, start, stop):
    base = rank * (in_count // len(group))
    return sum(values(p, base + start, base + stop) for p in group)


@register
class AllToAll(Collective):
  name, hlo_op = "all_to_all", "all-to-all"

  def count_multiple(self, n):
    return n

  def busbw_factor(self, n):
    return (n - 1) / n

  def op(self, x, axes, n):
    return lax.all_to_all(x, axes, 0, 0, tiled=True)

  def reference(self, xs):
    n = xs.shape[0]
    return xs.reshape(n, n, -1).transpose(1, 0, 2).reshape(n, -1)

  def expected(self, group, rank, in_count, start, stop):
    chunk = in_count // len(group)  # output chunk j is chunk `rank` of rank j's input
    return _from_chunks(group, chunk, start, stop, lambda j, a, b: (j, rank * chunk + a, rank * chunk + b))


@register
class Broadcast(Collective):
  """From group rank 0. GPUs run XLA's collective-broadcast; other backends (no lowering there) run the
  masked all-reduce JAX documents as its equivalent, recorded as the record's `impl`."""
  name, hlo_op = "broadcast", "collective-broadcast"

  def busbw_factor(self, n):
    return 1.0

  def hlo_expect(self, platform):
    return "collective-broadcast" if platform == "gpu" else "all-reduce"

  def impl(self, platform):
    return "collective-broadcast" if platform == "gpu" else "masked all-reduce"

  def op(self, x, axes, n):
    if jax.default_backend() == "gpu":
      return lax.pbroadcast(x, axes, 0)
    return lax.psum(jnp.where(lax.axis_index(axes) == 0, x, jnp.zeros_like(x)), axes)

  def reference(self, xs):
    return np.broadcast_to(xs[0], xs.shape)

  def expected(self, group, rank, in_count, start, stop):
    return values(group[0], start, stop)


@register
class PPermute(Collective):
  """Point-to-point, as nccl-tests' sendrecv: each rank sends its buffer to the next rank of its group."""
  name, hlo_op = "ppermute", "collective-permute"

  def busbw_factor(self, n):
    return 1.0

  def op(self, x, axes, n):
    return lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)])

  def reference(self, xs):
    return np.roll(xs, 1, axis=0)

  def expected(self, group, rank, in_count, start, stop):
    return values(group[(rank - 1) % len(group)], start, stop)


def _from_chunks(group: np.ndarray, chunk: int, start: int, stop: int, source) -> np.ndarray:
  """Output elements [start, stop) of an output made of `chunk`-long pieces, piece j taken from
  `source(j, a, b) -> (group rank, input start, input stop)` for its local range [a, b)."""
  parts = []
  for j in range(start // chunk, (stop - 1) // chunk + 1 if stop > start else start // chunk):
    a, b = max(start, j * chunk) - j * chunk, min(stop, (j + 1) * chunk) - j * chunk
    q, lo, hi = source(j, a, b)
    parts.append(values(group[q], lo, hi))
  return np.concatenate(parts) if parts else np.empty(0, np.float32)


NAMES = tuple(REGISTRY)
