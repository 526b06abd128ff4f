"""All-reduce and reduce-scatter with any of NCCL's reduction operators (nccl-tests' `-o sum|prod|max|min|avg`).

XLA's `all-reduce` and `reduce-scatter` take any reduction computation, and XLA:GPU hands sum, product, max and
min to NCCL as ncclSum/ncclProd/ncclMax/ncclMin. JAX exposes only some of them (psum, pmax, pmin; psum_scatter
for reduce-scatter), so the missing ones (an all-reduce product, a reduce-scatter max/min/product) are two small
primitives here that lower through JAX's own collective lowerings with another reduction computation: the HLO is
the op a user of NCCL would time, not an emulation (an all-gather followed by a local reduction would move n
times the bytes). They are forward-only (no transpose or batching rule): the benchmark never differentiates them.

`avg` has no XLA reduction: it is the sum followed by a multiplication by 1/n, as `jax.lax.pmean` lowers (XLA
rewrites the division), so its timed op includes one elementwise pass over the output; the record says so.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lax import parallel as _parallel  # the lowerings JAX's own psum/pmax/psum_scatter use
from jax.extend import core
from jax.interpreters import mlir

OPS = ("sum", "max", "min", "prod", "avg")


def _reduction(op: str):
  return {"sum": lax.add_p, "max": lax.max_p, "min": lax.min_p, "prod": lax.mul_p}[op]


all_reduce_prod_p = core.Primitive("microbench_all_reduce_prod")
all_reduce_prod_p.def_effectful_abstract_eval(functools.partial(_parallel._pmin_pmax_abstract_eval, "pmax"))  # pylint: disable=protected-access
mlir.register_lowering(all_reduce_prod_p, functools.partial(_parallel._allreduce_lowering, lax.mul_p,  # pylint: disable=protected-access
                                                            lax.reduce_prod))

reduce_scatter_p = {}
for _op in ("max", "min", "prod"):
  reduce_scatter_p[_op] = core.Primitive(f"microbench_reduce_scatter_{_op}")
  reduce_scatter_p[_op].def_effectful_abstract_eval(_parallel._reduce_scatter_effectful_abstract_eval)  # pylint: disable=protected-access
  mlir.register_lowering(reduce_scatter_p[_op], functools.partial(_parallel._reduce_scatter_lowering,  # pylint: disable=protected-access
                                                                  _reduction(_op)))


def all_reduce(x: jax.Array, axes: tuple[str, ...], op: str) -> jax.Array:
  """All-reduce of `x` over the mesh axes `axes` (inside shard_map) with reduction `op`."""
  if op == "sum":
    return lax.psum(x, axes)
  if op == "max":
    return lax.pmax(x, axes)
  if op == "min":
    return lax.pmin(x, axes)
  if op == "avg":
    return lax.pmean(x, axes)
  return all_reduce_prod_p.bind(x, axes=tuple(axes), axis_index_groups=None)


def reduce_scatter(x: jax.Array, axes: tuple[str, ...], n: int, op: str) -> jax.Array:
  """Tiled reduce-scatter of the 1-D `x` over `axes` (n ranks) with reduction `op`."""
  if op in ("sum", "avg"):
    y = lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
    return y / jnp.asarray(n, y.dtype) if op == "avg" else y
  return reduce_scatter_p[op].bind(x, scatter_dimension=0, axis_name=tuple(axes), axis_index_groups=None,
                                   axis_size=n, tiled=True)
