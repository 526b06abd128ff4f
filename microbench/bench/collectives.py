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
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from microbench.bench import reduce_ops
from microbench.bench.known_inputs import FP8, GroupInputs, as_dtype
from microbench.fabric import conventions

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
  inputs: str = "data"  # known-input family: "data" (data only moves) or the reduction's ("sum", "max", ...)
  ordered_groups: bool = False  # output order follows the replica group's order (checked in the HLO)
  redop: str | None = None  # reductions: the operator (nccl-tests' -o)

  def refuses(self, dtype: str) -> str | None:
    """Why this collective can't run in `dtype` (one line), or None."""
    return None

  @property
  def writes_message(self) -> bool:
    """The op itself writes the message besides the collective (avg's multiplication by 1/n)."""
    return False

  def count_multiple(self, n: int) -> int:
    """Per-rank element count (of the S buffer) must be a multiple of this."""
    return 1

  def busbw_factor(self, n: int) -> float:
    """algbw -> busbw factor for a group of n: nccl-tests' convention for the family (fabric.conventions)."""
    return conventions.busbw_factor(type(self).name, n)

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
    """Output elements [start, stop) of group rank `rank` on the known inputs (exact integers, int64; avg:
    the exact sum, which `finish` divides)."""

  def finish(self, inputs: GroupInputs, values: np.ndarray, wire_dtype: str) -> np.ndarray:
    """The output the program must produce from `expected`'s exact values, given the type its collective
    ran in (only avg rounds)."""
    return values

  def after(self, inputs: GroupInputs, rank: int, in_count: int, reps: int) -> tuple[np.ndarray, ...] | str:
    """The timed programs' final carry of group rank `rank` after `reps` (even, >= 2) repetitions from the
    known inputs, as float64 arrays (NaN: an element not checked), or a string saying why it can't be known
    exactly. Compared element by element with what the timed program returns (program.check_timed)."""
    return "no exact value after the repetitions is known for this collective"

  def hlo_expect(self, platform: str) -> str:
    return self.hlo_op

  def impl(self, platform: str) -> str:
    return self.hlo_expect(platform)


class Reduction(Collective):
  """A collective that reduces (all-reduce, reduce-scatter), with one of NCCL's operators: sum (the default
  and the collective's plain name), max, min, prod, avg (`all_reduce_max`, ...). Each operator has its own
  known inputs (known_inputs: max and min one extreme rank per element, prod a window whose product is 2T,
  avg the sum's), so using one operator for another shows in the check."""

  def __init__(self, redop: str = "sum"):
    self.redop = redop
    if redop != "sum":
      self.name = f"{type(self).name}_{redop}"
    self.inputs = "sum" if redop in ("sum", "avg") else redop

  def refuses(self, dtype):
    if dtype in FP8:
      return (f"{self.name} in {dtype}: XLA:GPU hands no fp8 reduction to NCCL (fp8 runs all_gather, all_to_all,"
              " ppermute and broadcast)")
    if self.redop == "avg" and dtype == "int32":
      return f"{self.name} in int32: XLA has no integer average (jax.lax.pmean returns float32); use sum"
    return None

  @property
  def writes_message(self):
    return self.redop == "avg"

  def impl(self, platform):
    op = self.hlo_expect(platform)
    return {"sum": op, "avg": f"{op} (sum), x 1/n: XLA has no average"}.get(self.redop, f"{op} ({self.redop})")

  def finish(self, inputs: GroupInputs, values: np.ndarray, wire_dtype: str) -> np.ndarray:
    """avg: the expected output from the exact sum, divided by n as XLA does it: pmean's division becomes a
    multiplication by the reciprocal rounded to the type the sum arrives in (the wire dtype: XLA:CPU widens
    bfloat16 to float32, GPUs keep every dtype), the product rounded to that type, then to the dtype (read
    from the compiled HLO on CPU and for GPU targets; tests pin both)."""
    if self.redop != "avg":
      return values
    recip = float(as_dtype(np.float32(1) / np.float32(inputs.n), wire_dtype))
    product = as_dtype(values.astype(np.float64) * recip, wire_dtype)  # exact in float64, rounded once
    return as_dtype(product, inputs.dtype).astype(np.float64)

  def combine(self, xs: np.ndarray) -> np.ndarray:
    """NumPy's reduction of [n, ...] over ranks (the readable specification)."""
    return {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod, "avg": np.mean}[self.redop](xs, axis=0)


@register
class AllReduce(Reduction):
  name, hlo_op = "all_reduce", "all-reduce"

  def op(self, x, axes, n, platform):
    return reduce_ops.all_reduce(x, axes, self.redop)

  def reference(self, xs):
    return np.broadcast_to(self.combine(xs), xs.shape)

  def expected(self, inputs, rank, in_count, start, stop):
    return inputs.reduced(start, stop)

  def after(self, inputs, rank, in_count, reps):
    if self.redop in ("max", "min"):  # idempotent: every repetition after the first gives the same
      return (inputs.reduced(0, in_count).astype(np.float64),)
    if self.redop != "sum" or inputs.dtype != "int32":
      what = {"sum": f"holds n^{reps - 1} x the sum", "prod": "holds a power of the product",
              "avg": "holds the average rounded again at every step"}[self.redop]
      return (f"a {inputs.dtype} all-reduce{'' if self.redop == 'sum' else ' ' + self.redop} repeated {reps} times"
              f" {what}, rounded on the way: no exact value (the check program's exact comparison stands for"
              " the op)")
    total = inputs.total(0, in_count).astype(np.int64) * pow(inputs.n, reps - 1, 1 << 32)  # int32 wraps mod 2^32
    return (((total + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.float64),)


@register
class AllGather(Collective):
  """S is the per-rank output (n x the input shard)."""
  name, hlo_op, ordered_groups = "all_gather", "all-gather", True

  def count_multiple(self, n):
    return n

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
    shards, gathered = _gathered_after(inputs, in_count)
    return shards[rank], gathered


@register
class ReduceScatter(Reduction):
  """S is the per-rank input (n x the output shard)."""
  name, hlo_op, ordered_groups = "reduce_scatter", "reduce-scatter", True

  def count_multiple(self, n):
    return n

  def out_count(self, count, n):
    return count // n

  def op(self, x, axes, n, platform):
    return reduce_ops.reduce_scatter(x, axes, n, self.redop)

  def carry(self, x, out_count):
    return (x, jnp.zeros((out_count,), x.dtype))  # the scattered output stays live in the carry

  def step(self, carry, axes, n, platform):
    x, _ = carry
    y = self.op(x, axes, n, platform)
    return (_depend(x, y), y)

  def reference(self, xs):
    n = xs.shape[0]
    return self.combine(xs).reshape(n, -1)

  def expected(self, inputs, rank, in_count, start, stop):
    base = rank * (in_count // inputs.n)
    return inputs.reduced(base + start, base + stop)

  def after(self, inputs, rank, in_count, reps):
    """x[0] takes the output's first element each step, so only element 0 of rank 0's chunk (fed by every
    rank's x[0]) keeps changing; everything else is known exactly."""
    if self.redop == "avg":
      return "avg's output depends on the platform's rounding of 1/n (the check program compares it)"
    ch = in_count // inputs.n
    y = self.expected(inputs, rank, in_count, 0, ch).astype(np.float64)
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


@functools.lru_cache(maxsize=2)
def _gathered_after(inputs: GroupInputs, in_count: int) -> tuple[list[np.ndarray], np.ndarray]:
  """All-gather's carry after the repetitions: every step writes the gathered first element (rank 0's) into
  x[0]; the gathered output is the same on every rank of the group (built once per group, not per rank)."""
  first = float(inputs.rank(0, 0, 1)[0])
  shards = [inputs.rank(q, 0, in_count).astype(np.float64) for q in range(inputs.n)]
  for shard in shards:
    shard[0] = first
  return shards, np.concatenate(shards)


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


NAMES = tuple(REGISTRY)  # the collectives; the reductions' other operators are variants of two of them
for _name in ("all_reduce", "reduce_scatter"):
  for _op in reduce_ops.OPS[1:]:
    REGISTRY[f"{_name}_{_op}"] = type(REGISTRY[_name])(_op)


def with_op(name: str, op: str) -> Collective:
  """The collective `name` with reduction operator `op` (data-moving collectives have none: themselves)."""
  coll = get(name)
  if not isinstance(coll, Reduction) or op == "sum":
    return coll
  return get(f"{name}_{op}")
