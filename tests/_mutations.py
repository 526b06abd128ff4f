"""Deliberately wrong collectives, run through the benchmark's own build/check path (test-only).

Run in its own process with 72 CPU devices (tests/test_mutations.py starts it), over group sizes 2, 3, 18,
32 and 72 (as many groups as fit in 72 devices) and every dtype: each mutant must give wrong > 0 and each
real collective wrong == 0 (the narrower-type mutant only where a narrower type exists). The real collectives
run in every dtype at every group size (a false alarm is what stops users); each mutant runs in every dtype
and at every group size, though not in every pair of them: the cells are a Latin walk (mutant i's k-th cell is
dtype (i + k) mod 4 at group size k), so every (mutant, dtype) and every (mutant, group size) pair is covered
and no dtype or size is favoured. That is 22x4x5 programs instead of 92x4x5 (each costs ~0.7 s on 2 cores).
A mutant is checked with the comparison programs of the real collective it imitates (`Mutant`), run just before
it: 106 instead of 155 CPU-seconds for the run.
Prints one JSON object: {"<mutant>/<dtype>/<n>": wrong}.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["JAX_NUM_CPU_DEVICES"] = "72"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402,F401  pylint: disable=wrong-import-position,unused-import
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from microbench.meshes.mesh import build_mesh, ordered_devices  # noqa: E402
from microbench.meshes.scopes import plan_scopes  # noqa: E402
from microbench.meshes.topology import Topology  # noqa: E402
from microbench.bench import collectives, hlo_check, program, reduce_ops  # noqa: E402

GROUP_SIZES = (2, 3, 18, 32, 72)
OP_GROUP_SIZES = (2, 3, 18)  # the operators' mutants (37 programs per size and dtype): the suite's time
DTYPES = ("float32", "bfloat16", "float16", "int32")


class Mutant:
  """A wrong collective, checked against the real collective it imitates (`real`: the same class and operator;
  it changes only its op). It compares equal to that collective, and to the other mutants of it, and hashes
  like it, so the check's comparison programs (cached by collective) are the real one's: what a broken
  collective in a sweep would meet, and one XLA:CPU compile less per cell. A mutant that changes anything the
  expected output reads (RingByTwo's pairs) imitates nothing (`imitated`) and keeps programs of its own."""
  real = None

  def __eq__(self, other):
    if other is self:
      return True
    return self.real is not None and (other is self.real or getattr(other, "real", None) is self.real)

  def __hash__(self):
    return id(self) if self.real is None else hash(self.real)


def _rank(axes):
  return lax.axis_index(axes)


class MissingRank(Mutant, collectives.AllReduce):
  name = "all_reduce missing the last rank"

  def op(self, x, axes, n, platform):
    return lax.psum(jnp.where(_rank(axes) == n - 1, jnp.zeros_like(x), x), axes)


class DoubledRank(Mutant, collectives.AllReduce):
  name = "all_reduce counting rank 1 twice"

  def op(self, x, axes, n, platform):
    return lax.psum(jnp.where(_rank(axes) == 1, x + x, x), axes)


class ScatterMissingRank(Mutant, collectives.ReduceScatter):
  name = "reduce_scatter missing rank 0"

  def op(self, x, axes, n, platform):
    return lax.psum_scatter(jnp.where(_rank(axes) == 0, jnp.zeros_like(x), x), axes, scatter_dimension=0,
                            tiled=True)


class ScatterDoubledRank(Mutant, collectives.ReduceScatter):
  name = "reduce_scatter counting the last rank twice"

  def op(self, x, axes, n, platform):
    return lax.psum_scatter(jnp.where(_rank(axes) == n - 1, x + x, x), axes, scatter_dimension=0, tiled=True)


def _swap_chunks(y, n):
  order = [1, 0, *range(2, n)]
  return y.reshape(n, -1)[jnp.array(order)].reshape(-1)


class GatherSwapped(Mutant, collectives.AllGather):
  name = "all_gather with chunks 0 and 1 swapped"

  def op(self, x, axes, n, platform):
    return _swap_chunks(lax.all_gather(x, axes, tiled=True), n)


class AllToAllSwapped(Mutant, collectives.AllToAll):
  name = "all_to_all with the blocks of ranks 0 and 1 swapped"

  def op(self, x, axes, n, platform):
    return _swap_chunks(lax.all_to_all(x, axes, 0, 0, tiled=True), n)


class WrongRoot(Mutant, collectives.Broadcast):
  name = "broadcast from rank 1"

  def op(self, x, axes, n, platform):
    return lax.psum(jnp.where(_rank(axes) == 1, x, jnp.zeros_like(x)), axes)


class RingByTwo(Mutant, collectives.PPermute):
  name = "ppermute shifted by two"

  def pairs(self, n):
    return [(i, (i + 2) % n) for i in range(n)]


class _NoHlo:
  """A mutant whose program is not the collective's HLO (zeros, a slice of an all-reduce, another type): only
  the data check is under test."""
  skip_hlo = True


class NeverRan(Mutant, _NoHlo, collectives.AllReduce):
  name = "all_reduce that never ran (zeros)"

  def op(self, x, axes, n, platform):
    return jnp.zeros_like(x)


class MeanForSum(Mutant, collectives.AllReduce):
  name = "all_reduce computing the mean"

  def op(self, x, axes, n, platform):
    return (lax.psum(x.astype(jnp.float32), axes) / n).astype(x.dtype) if x.dtype != jnp.int32 else \
        lax.psum(x, axes) // n


class MaxForSum(Mutant, _NoHlo, collectives.AllReduce):
  name = "all_reduce computing the max"

  def op(self, x, axes, n, platform):
    return lax.pmax(x, axes)


class NegatedSum(Mutant, collectives.AllReduce):
  name = "all_reduce negating the sum"

  def op(self, x, axes, n, platform):
    return -lax.psum(x, axes)


class ShiftedSum(Mutant, collectives.AllReduce):
  name = "all_reduce output shifted by one element"

  def op(self, x, axes, n, platform):
    return jnp.roll(lax.psum(x, axes), 1)


class StaleLast(Mutant, collectives.AllReduce):
  name = "all_reduce leaving its last element stale"

  def op(self, x, axes, n, platform):
    return lax.psum(x, axes).at[-1].set(x[-1])


class ScatterNextChunk(Mutant, _NoHlo, collectives.ReduceScatter):
  name = "reduce_scatter delivering rank r+1's chunk"

  def op(self, x, axes, n, platform):
    c = x.shape[0] // n
    return lax.dynamic_slice(lax.psum(x, axes), (((_rank(axes) + 1) % n) * c,), (c,))


NARROWER = {"float16": jnp.bfloat16, "float32": jnp.bfloat16, "int32": jnp.float32}


class NarrowSum(Mutant, _NoHlo, collectives.AllReduce):
  name = "all_reduce summing in a narrower type"
  dtypes = tuple(NARROWER)

  def op(self, x, axes, n, platform):
    return lax.psum(x.astype(NARROWER[str(x.dtype)]), axes).astype(x.dtype)


def _op_dtypes(*ops):
  return tuple(d for d in DTYPES if not (d == "int32" and "avg" in ops))


class OpSwap(Mutant, collectives.AllReduce):
  """An all-reduce running operator `run` where `expect` is asked (max instead of sum, and the other way)."""

  def __init__(self, expect, run):
    super().__init__(expect)
    self.run_op, self.name, self.dtypes = run, f"all_reduce computing {run} for {expect}", _op_dtypes(expect, run)

  def op(self, x, axes, n, platform):
    return reduce_ops.all_reduce(x, axes, self.run_op)


class ScatterOpSwap(Mutant, collectives.ReduceScatter):
  def __init__(self, expect, run):
    super().__init__(expect)
    self.run_op, self.name, self.dtypes = run, f"reduce_scatter computing {run} for {expect}", _op_dtypes(expect, run)

  def op(self, x, axes, n, platform):
    return reduce_ops.reduce_scatter(x, axes, n, self.run_op)


def _identity(op, dtype):
  if op in ("sum", "avg"):
    return 0
  if op == "prod":
    return 1
  info = jnp.iinfo(dtype) if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype)
  return info.min if op == "max" else info.max


class OpMissingRank(Mutant, collectives.AllReduce):
  """The operator's all-reduce without the last rank (its input replaced by the operator's identity)."""

  def __init__(self, op):
    super().__init__(op)
    self.name, self.dtypes = f"all_reduce missing the last rank ({op})", _op_dtypes(op)

  def op(self, x, axes, n, platform):
    fill = jnp.asarray(_identity(self.redop, x.dtype), x.dtype)
    return reduce_ops.all_reduce(jnp.where(_rank(axes) == n - 1, fill, x), axes, self.redop)


OPS = reduce_ops.OPS
OP_MUTANTS = (*(OpSwap(a, b) for a in OPS for b in OPS if a != b),
              *(ScatterOpSwap(a, b) for a, b in (("sum", "max"), ("max", "sum"), ("min", "max"), ("prod", "sum"),
                                                 ("avg", "sum"))),
              *(OpMissingRank(op) for op in OPS[1:]))
REAL_OPS = tuple(collectives.with_op(b, op) for b in ("all_reduce", "reduce_scatter") for op in OPS[1:])
REALS = tuple(collectives.get(c) for c in collectives.NAMES)

MUTANTS = (MissingRank(), DoubledRank(), ScatterMissingRank(), ScatterDoubledRank(), GatherSwapped(),
           AllToAllSwapped(), WrongRoot(), RingByTwo(), NeverRan(), MeanForSum(), MaxForSum(), NegatedSum(),
           ShiftedSum(), StaleLast(), ScatterNextChunk(), NarrowSum(), *OP_MUTANTS)


def imitated(m: Mutant):
  """The real collective `m` changes only the op of (its class, operator and every other method and setting),
  else None."""
  base = next(c for c in type(m).__mro__ if c.__module__ == collectives.__name__)
  reals = [c for c in (*REALS, *REAL_OPS) if type(c) is base and getattr(c, "redop", None) == getattr(m, "redop", None)]
  if len(reals) != 1:
    return None
  real, own = reals[0], ("name", "dtypes", "run_op", "real")
  methods = [k for k in dir(base) if callable(getattr(base, k)) and not k.startswith("__") and k != "op"]
  if any(getattr(type(m), k) is not getattr(base, k) for k in methods):
    return None
  return real if {k: v for k, v in vars(m).items() if k not in own} == {
      k: v for k, v in vars(real).items() if k not in own} else None


for _m in MUTANTS:
  _m.real = imitated(_m)


def _verify_for(coll, plan):
  """The HLO check with the mutant's own ring pairs (the data check is what is under test here); a ring
  of self-pairs (shift by two on two ranks) compiles to no collective at all."""
  if getattr(coll, "skip_hlo", False):
    return lambda text, exp: hlo_check.Verified(None, exp.dtype, 1, ())
  if not isinstance(coll, collectives.PPermute):
    return hlo_check.verify
  pairs = frozenset((int(g[s]), int(g[t])) for g in plan.groups for s, t in coll.pairs(plan.group_size))
  if all(a == b for a, b in pairs):
    return lambda text, exp: hlo_check.Verified(None, exp.dtype, 1, ())
  return lambda text, exp: hlo_check.verify(text, exp, want=pairs)


def _among(coll, group) -> bool:
  """Membership by identity: a mutant equals the real collective it imitates (`Mutant`)."""
  return any(coll is c for c in group)


def cells(coll, index: int) -> set[tuple[int, str]]:
  """The (group size, dtype) cells a collective runs in: every cell for a real one; for mutant `index` a walk
  that meets every dtype and every group size it allows (module docstring)."""
  sizes = OP_GROUP_SIZES if _among(coll, (*OP_MUTANTS, *REAL_OPS)) else GROUP_SIZES
  dtypes = [d for d in DTYPES if d in getattr(coll, "dtypes", DTYPES) and not coll.refuses(d)]
  if not _among(coll, MUTANTS):
    return {(n, d) for n in sizes for d in dtypes}
  steps = max(len(sizes), len(dtypes))
  return {(sizes[k % len(sizes)], dtypes[(index + k) % len(dtypes)]) for k in range(steps)}


def main() -> None:
  t0 = time.perf_counter()
  devices = ordered_devices()
  out = {}
  everything = (*MUTANTS, *REALS, *REAL_OPS)
  plan_of = {id(c): cells(c, i) for i, c in enumerate(everything)}
  # Each real collective, then its mutants (they share its comparison programs while jit's cache holds them).
  order = (*(c for r in (*REALS, *REAL_OPS) for c in (r, *(m for m in MUTANTS if m.real is r))),
           *(m for m in MUTANTS if m.real is None))
  assert sorted(map(id, order)) == sorted(map(id, everything))
  for n in GROUP_SIZES:
    groups = len(devices) // n
    topo = Topology(1, groups, n)
    mesh = build_mesh(topo, devices[:groups * n])
    plan = plan_scopes(topo, ["scale_up"])[0]
    for dtype in DTYPES:
      for coll in order:
        if (n, dtype) not in plan_of[id(coll)]:
          continue
        count = 2 * n  # two elements per chunk: tiny, and still every chunk of every rank distinct
        point = program.build_check(coll, mesh, plan, count, dtype, verify=_verify_for(coll, plan))
        out[f"{coll.name}/{dtype}/{n}"] = program.check(point)
        if os.environ.get("MUTATION_TRACE"):
          print(f"{time.perf_counter() - t0:.1f} {coll.name}/{dtype}/{n}", file=sys.stderr, flush=True)
  out["planned"] = sum(len(c) for c in plan_of.values())
  out["seconds"] = time.perf_counter() - t0
  print(json.dumps(out))


if __name__ == "__main__":
  main()
