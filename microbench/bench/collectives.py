"""The collectives, each a small unit registered by name.

A collective says how its per-rank buffer relates to nccl-tests' size S, its bus-bandwidth factor, the op
inside `shard_map`, how the timed repetitions feed one another (`feedback`), the HLO op it must compile to on
each platform, which family of known inputs checks it, and what its output must be: `reference` states it in
NumPy on any inputs (the readable specification, checked by the tests), `expected` computes any range of one
rank's output on the known check inputs without building the whole group's inputs (the check streams
through it).

The timed repetitions: with `feedback = "hold"` every repetition runs the op on the known inputs again (held
in the carry, made to depend on the previous output through one element whose value does not change), so
every repetition's output must equal the check program's; with `"chain"` (the output has the input's shape)
each output is the next input, and `rep_output` says which known buffer repetition k must reproduce. Either
way every repetition's whole output is folded into a digest the timed check compares (program.py).

Adding one: subclass `Collective`, fill in the few methods, decorate with `@register`.
"""

from __future__ import annotations

import abc

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

  feedback: str = "hold"  # "hold": the inputs stay, the output is kept beside them; "chain": output -> input

  def feedback_on(self, platform: str) -> str:
    """How the timed repetitions feed one another on `platform`."""
    return self.feedback

  def carry(self, x: jax.Array, out_count: int, platform: str) -> tuple[jax.Array, ...]:
    """The loop carry the timed repetitions start from: the inputs, and for "hold" a slot for the output."""
    if self.feedback_on(platform) == "chain":
      return (x,)
    return (x, jnp.zeros((out_count,), x.dtype))

  def step(self, carry: tuple[jax.Array, ...], axes: tuple[str, ...], n: int,
           platform: str) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """One repetition: (the next carry, this repetition's output). The next repetition depends on this one's
    output (so XLA can neither drop, hoist nor merge repetitions); two steps form the loop body, so the
    output of one lands in the buffer the next one frees and the body copies no message."""
    if self.feedback_on(platform) == "chain":
      (x,) = carry
      y = self.op(x, axes, n, platform)
      return (y,), y
    x = carry[0]
    y = self.op(x, axes, n, platform)
    return (hold(x, y), y), y

  def rep_output(self, rank: int, k: int, n: int, platform: str) -> tuple[str, int] | None:
    """The known buffer that group rank `rank`'s output of timed repetition k (1, 2, ...) must equal, as
    ("in", q): rank q's known input, or ("out", q): rank q's checked output of the check program; None where
    no known buffer is (the timed check then says so). "hold": the check output, every time."""
    return ("out", rank)

  def period(self, n: int) -> int:
    """rep_output repeats with this period (in repetitions) in a group of n."""
    return 1

  def digest_each(self, platform: str) -> bool:
    """Whether every repetition's output is digested on `platform` (False where reading it would make XLA
    copy it: an in-place op whose output the next repetition overwrites)."""
    return True

  def final_carry(self, rank: int, reps: int, n: int, platform: str) -> tuple[tuple[str, int] | None, ...]:
    """What each slot of the carry holds after `reps` repetitions (as rep_output names buffers)."""
    if self.feedback_on(platform) == "chain":
      return (self.rep_output(rank, reps, n, platform),)
    return (("in", rank), self.rep_output(rank, reps, n, platform))

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

  def source(self, rank: jax.Array, e: jax.Array, n: int, in_count: int) -> tuple[jax.Array, jax.Array]:
    """Data collectives, on the devices (traced): (source group rank, source element) of output elements e of
    group rank `rank`, the known input that lands there (device_inputs builds the expected output from it)."""
    raise NotImplementedError(f"{self.name}: no `source` (or `reduced_at` for a reduction) for the device check")

  def reduced_at(self, rank: jax.Array, e: jax.Array, n: int, in_count: int) -> jax.Array:
    """Reductions, on the devices (traced): the input element whose value, reduced over the group, lands in
    output element e of group rank `rank`."""
    raise NotImplementedError(f"{self.name}: no `reduced_at` for the device check")

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
  """Held inputs where the platform's all-reduce is out of place (CPU). XLA:GPU runs every all-reduce in place
  (its output takes the operand's buffer), so holding the inputs would add a copy of the message before every
  repetition: there the repetitions chain, which max and min survive exactly (idempotent) and a sum, product
  or average does not (n-fold growth per repetition, rounded): those say their timed output is not known."""
  name, hlo_op = "all_reduce", "all-reduce"

  def feedback_on(self, platform):
    return "chain" if platform == "gpu" else "hold"

  def digest_each(self, platform):
    return platform != "gpu"  # the next in-place all-reduce overwrites the output a digest would read

  def rep_output(self, rank, k, n, platform):
    if self.feedback_on(platform) == "chain" and self.redop not in ("max", "min"):
      return None
    return ("out", rank)

  def op(self, x, axes, n, platform):
    return reduce_ops.all_reduce(x, axes, self.redop)

  def reference(self, xs):
    return np.broadcast_to(self.combine(xs), xs.shape)

  def reduced_at(self, rank, e, n, in_count):
    return e

  def expected(self, inputs, rank, in_count, start, stop):
    return inputs.reduced(start, stop)



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

  def reference(self, xs):
    return np.broadcast_to(xs.reshape(-1), (xs.shape[0], xs.size))

  def source(self, rank, e, n, in_count):
    return e // in_count, e % in_count

  def expected(self, inputs, rank, in_count, start, stop):
    return _from_chunks(in_count, start, stop, lambda q, a, b: inputs.rank(q, a, b))



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

  def reference(self, xs):
    n = xs.shape[0]
    return self.combine(xs).reshape(n, -1)

  def reduced_at(self, rank, e, n, in_count):
    return rank * (in_count // n) + e

  def expected(self, inputs, rank, in_count, start, stop):
    base = rank * (in_count // inputs.n)
    return inputs.reduced(base + start, base + stop)



@register
class AllToAll(Collective):
  """Chained: twice is the identity, so the repetitions alternate between the checked output and the input."""
  name, hlo_op, ordered_groups = "all_to_all", "all-to-all", True
  feedback = "chain"

  def count_multiple(self, n):
    return n

  def op(self, x, axes, n, platform):
    return lax.all_to_all(x, axes, 0, 0, tiled=True)

  def reference(self, xs):
    n = xs.shape[0]
    return xs.reshape(n, n, -1).transpose(1, 0, 2).reshape(n, -1)

  def source(self, rank, e, n, in_count):
    chunk = in_count // n
    return e // chunk, rank * chunk + e % chunk

  def expected(self, inputs, rank, in_count, start, stop):
    chunk = in_count // inputs.n  # output chunk j is chunk `rank` of rank j's input
    return _from_chunks(chunk, start, stop, lambda j, a, b: inputs.rank(j, rank * chunk + a, rank * chunk + b))

  def period(self, n):
    return 2

  def rep_output(self, rank, k, n, platform):
    return ("out", rank) if k % 2 else ("in", rank)


@register
class Broadcast(Collective):
  """From group rank 0. Where XLA lowers `collective-broadcast` (GPUs) that is what runs; elsewhere the
  masked all-reduce JAX documents as its equivalent, recorded as the record's `impl`. `native` is the one
  place that decides, from the mesh's platform."""
  name, hlo_op, ordered_groups = "broadcast", "collective-broadcast", True
  feedback = "chain"  # every repetition after the first broadcasts rank 0's input again

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

  def source(self, rank, e, n, in_count):
    return jnp.zeros_like(e), e

  def expected(self, inputs, rank, in_count, start, stop):
    return inputs.rank(0, start, stop)



@register
class PPermute(Collective):
  """Point-to-point, as nccl-tests' sendrecv: each rank sends its buffer to the next rank of its group.
  Chained: after k repetitions rank r holds rank r-k's input."""
  name, hlo_op = "ppermute", "collective-permute"
  feedback = "chain"


  def pairs(self, n: int) -> list[tuple[int, int]]:
    """(source, target) group ranks."""
    return [(i, (i + 1) % n) for i in range(n)]

  def op(self, x, axes, n, platform):
    return lax.ppermute(x, axes, self.pairs(n))

  def reference(self, xs):
    return np.roll(xs, 1, axis=0)

  def source(self, rank, e, n, in_count):
    return jnp.broadcast_to((rank - 1 + n) % n, e.shape), e

  def expected(self, inputs, rank, in_count, start, stop):
    return inputs.rank((rank - 1) % inputs.n, start, stop)

  def period(self, n):
    return n

  def rep_output(self, rank, k, n, platform):
    return ("in", (rank - k) % n)


def hold(x: jax.Array, y: jax.Array) -> jax.Array:
  """The next repetition's input for "hold" collectives: `x` unchanged in value, but its first element
  rewritten in place from the output's first element, through a comparison with a value no correct output
  holds (the dtype's lowest finite number). One element orders the repetitions (the next can't start, be
  hoisted out of the loop or merged with this one before this output exists) and keeps every repetition's
  expected output the check program's; rewriting the whole input would add a message-sized write."""
  lowest = jnp.iinfo(x.dtype).min if jnp.issubdtype(x.dtype, jnp.integer) else jnp.finfo(x.dtype).min
  first = jnp.where(y[:1] == jnp.asarray(lowest, y.dtype), x[:1] + jnp.ones((1,), x.dtype), x[:1])
  return lax.dynamic_update_slice(x, first.astype(x.dtype), (0,))


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
