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
import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from microbench.bench import ragged_sizes, reduce_ops
from microbench.bench.known_inputs import FILL, FP8, GroupInputs, as_dtype
from microbench.fabric import conventions

BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}  # an element's bits, by its width in bytes
REGISTRY: dict[str, "Collective"] = {}


def register(cls: type["Collective"]) -> type["Collective"]:
  REGISTRY[cls.name] = cls()
  return cls


def get(name: str) -> "Collective":
  """The collective `name`: a registered one, or a variant named by suffix, made on first use: `_inplace` (the
  output aliases the input: `with_inplace`), `broadcast_root<R>` (`with_root`). Raises KeyError."""
  if name in REGISTRY:
    return REGISTRY[name]
  if name not in _VARIANTS:
    _VARIANTS[name] = _variant(name)
  return _VARIANTS[name]


_VARIANTS: dict[str, "Collective"] = {}  # made by `get` on first use (REGISTRY keeps the built-in ones)


INPLACE = "_inplace"


def _variant(name: str) -> "Collective":
  base, inplace = (name[:-len(INPLACE)], True) if name.endswith(INPLACE) else (name, False)
  m = re.fullmatch(r"broadcast_root(\d+)", base)
  if m and int(m[1]) > 0:
    coll = copy.copy(get("broadcast"))
    coll.root, coll.name = int(m[1]), base
  elif inplace and not base.endswith(INPLACE):
    coll = get(base).in_place_form()
  else:
    raise KeyError(name)
  if inplace:
    coll.inplace, coll.name = True, name
  return coll


def with_inplace(name: str) -> "Collective":
  """`name` run in place (nccl-tests' in-place columns): its input donated, its output in the input's buffer."""
  return get(name + INPLACE)


def with_root(name: str, root: int) -> "Collective":
  """Broadcast from group rank `root` (nccl-tests' -r); other collectives have no root: themselves."""
  if name != "broadcast" or root == 0:
    return get(name)
  return get(f"broadcast_root{root}")


class Collective(abc.ABC):
  """One collective: sizes, cost factor, the op and its repetition step, the expected HLO op, the check."""

  name: str = ""
  hlo_op: str = ""  # the HLO opcode the op must compile to
  inputs: str = "data"  # known-input family: "data" (data only moves) or the reduction's ("sum", "max", ...)
  ordered_groups: bool = False  # output order follows the replica group's order (checked in the HLO)
  redop: str | None = None  # reductions: the operator (nccl-tests' -o)
  inplace: bool = False  # the output aliases the input (donated): nccl-tests' in-place columns
  root: int | None = None  # rooted collectives (broadcast): the source's group rank (nccl-tests' -r)

  def refuses(self, dtype: str) -> str | None:
    """Why this collective can't run in `dtype` (one line), or None."""
    return None

  @property
  def writes_message(self) -> bool:
    """The op itself writes the message besides the collective (avg's multiplication by 1/n)."""
    return False

  def refuses_group(self, n: int) -> str | None:
    """Why this collective can't run over groups of n (one line), or None."""
    return None

  def refuses_platform(self, platform: str) -> str | None:
    """Why this collective can't be measured on devices of `platform` (one line), or None."""
    return None

  def in_place_form(self) -> "Collective":
    """A fresh instance of this collective's in-place form: the same op with its input donated, unless its
    input and output differ in size (all-gather, reduce-scatter: nccl-tests' layouts, their own classes)."""
    return copy.copy(self)

  def op_elements(self, count: int, n: int) -> int:
    """Elements per rank the collective instruction itself produces (the HLO check's count)."""
    return self.out_count(count, n)

  def keeps_input(self, rank: jax.Array, e: jax.Array, n: int, in_count: int) -> jax.Array | None:
    """Reductions in place (reduce-scatter): which output elements e are the rank's own input, unchanged
    (traced); None where the whole output is the collective's."""
    return None

  def hlo_groups(self, groups: np.ndarray) -> np.ndarray:
    """The replica groups the op shows in the HLO, given the scope's groups in group-rank order."""
    return groups

  def count_multiple(self, n: int) -> int:
    """Per-rank element count (of the S buffer) must be a multiple of this."""
    return 1

  def busbw_factor(self, n: int, count: int | None = None) -> float:
    """algbw -> busbw factor for a group of n: nccl-tests' convention for the family (fabric.conventions);
    `count` (elements of S) matters only where the sizes do (the ragged all-to-all)."""
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
    """How the timed repetitions feed one another on `platform`: in place, always a chain (the output takes
    the input's buffer, so the input is gone)."""
    return "chain" if self.inplace else self.feedback

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

  def compared_to_op(self, n: int, platform: str) -> bool:
    """No known buffer holds some repetition's output (a chained sum grows n-fold a repetition, rounded): the
    checked twins' repetitions are then compared with the check program (the operation verified exactly) run on
    its own outputs, and the timed programs replayed beside their twins (program.chain_digests, replay_check)."""
    return any(self.rep_output(0, k, n, platform) is None for k in range(1, self.period(n) + 1))

  def final_carry(self, rank: int, reps: int, n: int, platform: str) -> tuple[tuple[str, int] | None, ...]:
    """What each slot of the carry holds after `reps` repetitions (as rep_output names buffers)."""
    if self.feedback_on(platform) == "chain":
      return (self.rep_output(rank, reps, n, platform),)
    return (("in", rank), self.rep_output(rank, reps, n, platform))

  def slot_sources(self, platform: str) -> tuple[str, ...]:
    """What the timed carry's data slots start as: "in" the known inputs, "alt_in" the second known inputs
    (known_inputs.alt_shift), "fill" a buffer of known_inputs.FILL (an output slot: a value no correct output
    holds, so an element a repetition fails to write can't keep a right value), "zero" zeros (a counter)."""
    return ("in",) if self.feedback_on(platform) == "chain" else ("in", "fill")

  @property
  def alt_inputs(self) -> bool:
    """The repetitions alternate between the known inputs and a second set (the check also runs on it)."""
    return False

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

  def expected_finished(self, inputs: GroupInputs, rank: int, in_count: int, start: int, stop: int,
                        wire_dtype: str) -> np.ndarray:
    """Output elements [start, stop) of group rank `rank` as the program must produce them."""
    return self.finish(inputs, self.expected(inputs, rank, in_count, start, stop), wire_dtype)

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

  def moves_bits(self, platform: str) -> bool:
    """The platform's form of the op moves the dtype's bits as unsigned integers of its width (an emulation
    with no arithmetic, hlo_check.Expectation.bits_ok)."""
    return False

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

  def rep_output(self, rank, k, n, platform):
    """Chained (in place, or XLA:GPU's all-reduce), max and min are fixed points (idempotent); a sum, product
    or average grows each repetition, which no known buffer holds."""
    if self.feedback_on(platform) == "chain" and self.redop not in ("max", "min"):
      return None
    return ("out", rank)

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
    return "chain" if platform == "gpu" or self.inplace else "hold"

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

  def in_place_form(self):
    return _in_place(self, _InPlaceGather)

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

  def in_place_form(self):
    return _in_place(self, _InPlaceScatter)

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
  """From group rank `root` (0 unless `with_root`). Where XLA lowers `collective-broadcast` (GPUs) that is what
  runs, its replica groups led by the root (XLA's form: the first rank of a group is the source); elsewhere the
  masked all-reduce JAX documents as its equivalent, recorded as the record's `impl`. `native` is the one
  place that decides, from the mesh's platform."""
  name, hlo_op, ordered_groups = "broadcast", "collective-broadcast", True
  feedback = "chain"  # every repetition after the first broadcasts the root's input again
  root = 0

  @staticmethod
  def native(platform: str) -> bool:
    return platform == "gpu"

  def hlo_expect(self, platform):
    return "collective-broadcast" if self.native(platform) else "all-reduce"

  def impl(self, platform):
    return "collective-broadcast" if self.native(platform) else "masked all-reduce"

  def refuses_group(self, n):
    if self.root >= n:
      return f"--root={self.root} is not a rank of groups of {n} (roots are group ranks 0..{n - 1})"
    return None

  def hlo_groups(self, groups):
    order = [self.root] + [r for r in range(groups.shape[1]) if r != self.root]
    return groups[:, order]

  def op(self, x, axes, n, platform):
    if self.native(platform):
      return lax.pbroadcast(x, axes, self.root)
    return lax.psum(jnp.where(lax.axis_index(axes) == self.root, x, jnp.zeros_like(x)), axes)

  def reference(self, xs):
    return np.broadcast_to(xs[self.root], xs.shape)

  def source(self, rank, e, n, in_count):
    return jnp.full_like(e, self.root), e

  def expected(self, inputs, rank, in_count, start, stop):
    return inputs.rank(self.root, start, stop)



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


_IN_PLACE_CLASSES: dict[tuple[type, type], type] = {}


def _in_place(coll: Collective, mixin: type) -> Collective:
  """`coll` in nccl-tests' in-place layout: a copy whose class puts `mixin` before the collective's own class
  (a user's registered subclass stays itself: its op and step are the ones run, in place)."""
  cls = type(coll)
  if issubclass(cls, mixin):
    return copy.copy(coll)
  key = (cls, mixin)
  if key not in _IN_PLACE_CLASSES:
    known = {(AllGather, _InPlaceGather): InPlaceAllGather, (ReduceScatter, _InPlaceScatter): InPlaceReduceScatter}
    _IN_PLACE_CLASSES[key] = known.get(key) or type(f"InPlace{cls.__name__}", (mixin, cls),
                                                    {"__module__": cls.__module__})
  out = copy.copy(coll)
  out.__class__ = _IN_PLACE_CLASSES[key]
  return out


class _InPlaceGather(AllGather):
  """nccl-tests' in-place all-gather: one buffer of S per rank, whose slice `rank` is the rank's input (the
  known input is S long; its own slice is what the rank sends). XLA reads the slice with a dynamic-slice (a
  write of S/n, reported as the loop body's write) and gathers into the donated buffer with the collective's
  own op. Chained, the output is a fixed point: its slice `rank` is the input's."""

  def in_count(self, count, n):
    return count

  def op(self, x, axes, n, platform):
    chunk = x.shape[0] // n
    return super().op(lax.dynamic_slice(x, (lax.axis_index(axes) * chunk,), (chunk,)), axes, n, platform)

  def reference(self, xs):
    n = xs.shape[0]
    chunk = xs.shape[1] // n
    gathered = np.concatenate([xs[q, q * chunk:(q + 1) * chunk] for q in range(n)])
    return np.broadcast_to(gathered, xs.shape)

  def source(self, rank, e, n, in_count):
    return e // (in_count // n), e

  def expected(self, inputs, rank, in_count, start, stop):
    chunk = in_count // inputs.n
    return _from_chunks(chunk, start, stop, lambda j, a, b: inputs.rank(j, j * chunk + a, j * chunk + b))


class InPlaceAllGather(_InPlaceGather, AllGather):
  """The built-in all-gather in place."""


class _InPlaceScatter(ReduceScatter):
  """nccl-tests' in-place reduce-scatter: the rank's reduced block (the collective's own op) is written over
  slice `rank` of its input (a dynamic-update-slice of S/n into the donated buffer); the rest of the buffer is
  the rank's input, unchanged, and checked as such."""

  def out_count(self, count, n):
    return count

  def op_elements(self, count, n):
    return count // n

  def op(self, x, axes, n, platform):
    y = super().op(x, axes, n, platform)
    return lax.dynamic_update_slice(x, y, (lax.axis_index(axes) * y.shape[0],))

  def reference(self, xs):
    n = xs.shape[0]
    chunk = xs.shape[1] // n
    out = np.array(xs, copy=True).astype(np.result_type(xs, self.combine(xs)))
    reduced = self.combine(xs)
    for r in range(n):
      out[r, r * chunk:(r + 1) * chunk] = reduced[r * chunk:(r + 1) * chunk]
    return out

  def reduced_at(self, rank, e, n, in_count):
    return e

  def keeps_input(self, rank, e, n, in_count):
    chunk = in_count // n
    return (e < rank * chunk) | (e >= (rank + 1) * chunk)

  def expected(self, inputs, rank, in_count, start, stop):
    chunk = in_count // inputs.n
    lo, hi = max(start, rank * chunk), min(stop, (rank + 1) * chunk)
    own = np.array(inputs.rank(rank, start, stop), dtype=np.int64, copy=True)
    if lo < hi:
      own[lo - start:hi - start] = inputs.reduced(lo, hi)
    return own

  def expected_finished(self, inputs, rank, in_count, start, stop, wire_dtype):
    """Only the reduced block is finished (avg's rounding); the rest is the input as it was."""
    chunk = in_count // inputs.n
    lo, hi = max(start, rank * chunk), min(stop, (rank + 1) * chunk)
    out = self.expected(inputs, rank, in_count, start, stop).astype(np.float64)
    if lo < hi:
      out[lo - start:hi - start] = self.finish(inputs, out[lo - start:hi - start], wire_dtype)
    return out


class InPlaceReduceScatter(_InPlaceScatter, ReduceScatter):
  """The built-in reduce-scatter in place."""


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


class RaggedAllToAll(Collective):
  """`jax.lax.ragged_all_to_all` with one of ragged_sizes' MoE-like send-size distributions (uniform is the
  plain name; `ragged_all_to_all_skewed`, `_hot_expert`, `_empty_sends`): rank r sends sizes[r][d] elements of
  its buffer to rank d, runs packed in source order in d's output (ragged_sizes.Layout).

  S is the per-rank input: the `count` elements every rank sends, its own share included. The output holds
  n x the largest single run (at least the largest receive); what no one sends to stays as the output buffer
  had it, known_inputs.FILL (the check program's buffer is filled with it, and so is the timed carry's output
  slot, whose unused elements each repetition keeps), and is checked like the rest: FILL is no input's value,
  so a run sent one element short, or not at all, leaves a value no correct output holds. busbw counts
  the bytes actually sent (no padding) at the busiest rank: the most any rank sends to or receives from the
  others, over S (fabric.conventions.ragged_busbw_factor; uniform with n | count gives all-to-all's
  (n-1)/n). The sizes differ by count, so the factor does too; without a count, the distribution's exact
  shares give it (the limit the sizes round to).

  Held, alternating: the repetitions send the known inputs and a second set (the letters shifted by M/2,
  known_inputs.alt_shift: different at every element) in turn, each into the previous repetition's output, so
  every repetition must rewrite every run it receives (a run it skips keeps the other set's values: wrong).
  The check program runs on both sets. XLA:GPU runs `ragged-all-to-all-start`/`-done`; XLA:CPU has no ragged-all-to-all
  ("not supported by XLA:CPU ThunkEmitter"), so on CPU it is a dense all-to-all of the runs padded to the
  largest (n x block elements moved, `impl` says so), unpacked into the output buffer: the same output, not
  the same traffic."""
  name, hlo_op, ordered_groups = "ragged_all_to_all", "ragged-all-to-all", True

  def __init__(self, dist: str = "uniform"):
    self.dist = dist
    if dist != "uniform":
      self.name = f"{type(self).name}_{dist}"

  @staticmethod
  def native(platform: str) -> bool:
    return platform == "gpu"

  def refuses(self, dtype):
    if self.inplace:
      return (f"{self.name}: the ragged all-to-all has no in-place form (its output, n x the largest run, and its"
              " input differ in size)")
    return None

  def refuses_platform(self, platform):
    if platform == "tpu":
      return (f"{self.name} on a TPU: XLA:TPU's ragged-all-to-all moves rows (a flat buffer becomes rows of one"
              " element, each padded to a whole tile: 256x the memory), and the padded emulation rewrites its"
              " gather indices every repetition; an expert-parallel dispatch of token rows is what to measure"
              " there (microbench-train --model=mixtral --parallelism=ep:N)")
    return None

  def layout(self, count: int, n: int) -> ragged_sizes.Layout:
    return ragged_sizes.layout(self.dist, n, count)

  def out_count(self, count, n):
    return self.layout(count, n).out_count

  def busbw_factor(self, n, count: int | None = None):
    if count is None:
      return conventions.ragged_busbw_factor(ragged_sizes.weight_shares(self.dist, n))
    return conventions.ragged_busbw_factor(self.layout(count, n).sizes.tolist())

  def hlo_expect(self, platform):
    return "ragged-all-to-all" if self.native(platform) else "all-to-all"

  def moves_bits(self, platform):
    return not self.native(platform)

  def impl(self, platform):
    if self.native(platform):
      return f"ragged-all-to-all ({self.dist} sizes)"
    return f"padded all-to-all ({self.dist} sizes; XLA:CPU has no ragged-all-to-all)"

  def op(self, x, axes, n, platform):
    fill = jnp.full((self.out_count(x.shape[0], n),), FILL[jnp.dtype(x.dtype).name], x.dtype)
    return self.exchange(x, fill, axes, n, platform)

  def carry(self, x, out_count, platform):
    return (x, x, jnp.zeros((out_count,), x.dtype))

  def slot_sources(self, platform):
    return ("in", "alt_in", "fill")

  @property
  def alt_inputs(self):
    return True

  def step(self, carry, axes, n, platform):
    """The inputs stay untouched and swap places: each repetition sends the one in front, into the previous
    one's output, which orders them (the op takes it as its buffer). Rewriting an input element as `hold`
    does made XLA:CPU copy the input in the 2-repetition program (the emulation's gather fused with the
    update)."""
    x, other, buf = carry
    y = self.exchange(x, buf, axes, n, platform)
    return (other, x, y), y

  def period(self, n):
    return 2

  def rep_output(self, rank, k, n, platform):
    return ("out", rank) if k % 2 else ("alt_out", rank)

  def final_carry(self, rank, reps, n, platform):
    if reps % 2:
      return (("alt_in", rank), ("in", rank), ("out", rank))
    return (("in", rank), ("alt_in", rank), ("alt_out", rank))

  def tables(self, count: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the op is told: (sizes, input offsets, output offsets) [source, destination]. The check's
    expectation (`source`, `expected`, `reference`) reads `layout` itself, so a wrong table shows."""
    lay = self.layout(count, n)
    return lay.sizes, lay.input_offsets, lay.output_offsets

  def exchange(self, x: jax.Array, buf: jax.Array, axes: tuple[str, ...], n: int, platform: str) -> jax.Array:
    """The ragged all-to-all of this rank's `x` into `buf` (its output buffer, returned updated)."""
    sizes, in_off, out_off = (jnp.asarray(t, jnp.int32) for t in self.tables(x.shape[0], n))
    r = lax.axis_index(axes)
    if self.native(platform):
      return lax.ragged_all_to_all(x, buf, in_off[r], sizes[r], out_off[r], sizes[:, r], axis_name=axes)
    block = self.layout(x.shape[0], n).block
    # The packing reads the inputs at indices that depend on the buffer's first element (never the dtype's
    # lowest number in a correct output): a loop-invariant gather and all-to-all could be hoisted otherwise.
    # The emulation moves the dtype's bits, as unsigned integers of its width (BITS): XLA:CPU computes in no
    # 8-bit float, and around an fp8 all-to-all it widened each of the n pieces to float16 and back, every one
    # its own convert (n = 48: 2,300 converts, 3x the compile of float32's program). The same bytes move.
    dtype, bits = x.dtype, BITS[x.dtype.itemsize]
    lowest = jnp.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).min
    x, buf = lax.bitcast_convert_type(x, bits), lax.bitcast_convert_type(buf, bits)
    after = buf[0] == lax.bitcast_convert_type(jnp.asarray(lowest, dtype), bits)
    at = jnp.minimum(in_off[r][:, None] + lax.iota(jnp.int32, block)[None, :] + after, x.shape[0] - 1)
    packed = x[at]
    # With one element per rank every index is 0 whatever it adds (a gather from one element is that element),
    # so the bits sent also depend on it, through a select the gather fuses (XLA had hoisted the all-to-all).
    got = lax.all_to_all(jnp.where(after, ~packed, packed), axes, 0, 0, tiled=True)  # [n, block]: row q from q
    q, j, used = self._unpack(out_off[:, r], sizes[:, r], lax.iota(jnp.int32, buf.shape[0]))
    return lax.bitcast_convert_type(jnp.where(used, got[q, jnp.minimum(j, block - 1)], buf), dtype)

  @staticmethod
  def _unpack(off: jax.Array, size: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For output elements e of one receiver (runs at `off`, `size` long, by source): (source, element of the
    source's run, whether any run covers e)."""
    # The last run starting at or before e (n compares per element, one fused pass; jnp.searchsorted's scan is
    # a while loop whose carry XLA:CPU copies, a message-sized write per repetition).
    q = jnp.maximum(jnp.sum((e[:, None] >= off[None, :]).astype(jnp.int32), axis=1) - 1, 0)
    j = e - off[q]
    return q, j, j < size[q]

  def source(self, rank, e, n, in_count):
    lay = self.layout(in_count, n)
    sizes, in_off, out_off = (jnp.asarray(t, jnp.int32) for t in (lay.sizes, lay.input_offsets, lay.output_offsets))
    q, j, used = self._unpack(out_off[:, rank], sizes[:, rank], e)
    return jnp.where(used, q, -1), in_off[q, rank] + j

  def reference(self, xs, fill: float | None = None):
    """`fill`: what the output buffer holds before the op (default: known_inputs.FILL of xs's dtype, else 0)."""
    n, count = xs.shape
    lay = self.layout(count, n)
    fill = fill if fill is not None else FILL.get(np.dtype(xs.dtype).name, 0)
    out = np.full((n, lay.out_count), fill, xs.dtype)
    for r in range(n):
      for d in range(n):
        a, s, o = lay.input_offsets[r, d], lay.sizes[r, d], lay.output_offsets[r, d]
        out[d, o:o + s] = xs[r, a:a + s]
    return out

  def expected(self, inputs, rank, in_count, start, stop):
    lay = self.layout(in_count, inputs.n)
    out = np.full(max(0, stop - start), FILL[inputs.dtype], np.int64)
    for q in range(inputs.n):
      o, s, a = int(lay.output_offsets[q, rank]), int(lay.sizes[q, rank]), int(lay.input_offsets[q, rank])
      lo, hi = max(start, o), min(stop, o + s)
      if lo < hi:
        out[lo - start:hi - start] = inputs.rank(q, a + lo - o, a + hi - o)
    return out


RAGGED = tuple(f"ragged_all_to_all{'' if d == 'uniform' else '_' + d}" for d in ragged_sizes.DISTRIBUTIONS)
for _dist, _name in zip(ragged_sizes.DISTRIBUTIONS, RAGGED):  # run by name only: not in NAMES (`all`)
  REGISTRY[_name] = RaggedAllToAll(_dist)
