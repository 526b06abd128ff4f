"""Shared helpers for the training tests: a Trainer on the first n of the 8 virtual CPU devices, its
gradients as float32 NumPy arrays, SGD losses over a few steps, and the compiled or partitioned program.

Every compile uses `FAST` (LLVM optimisation off): the SPMD partitioning, which decides collectives and
shardings, is unchanged by it, and tiny programs compile several times faster.
"""

from __future__ import annotations

import functools
import glob
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from microbench.meshes import parallelism as par
from microbench.models import get_model
from microbench.models.layers import Execution
from microbench.models.optimizer import adamw, sgd
from microbench.models.train_step import Trainer

FAST = {"xla_backend_optimization_level": 0}
SEQ = {"gpt2": 32, "llama3": 32, "mixtral": 32, "vit": None, "resnet": None}


def make_trainer(model: str, strategy: str, *, size: str = "tiny", layers: int | None = None, batch: int = 8,
                 seq_len: int | None = None, dtype=jnp.float32, tx=None, rules: par.LogicalRules = par.RULES,
                 execution: Execution | None = None, grad_accum: int = 1, capacity_factor: float | None = None
                 ) -> Trainer:
  """`capacity_factor` defaults to 0 (no drops) for the mixture of experts: routing is then the same however
  the batch is split, so every strategy can be compared with one device."""
  p = par.parse_parallelism(strategy)
  assert jax.device_count() >= p.num_devices, "needs 8 CPU devices (JAX_NUM_CPU_DEVICES=8)"
  mesh = par.build_mesh(p, jax.devices()[:p.num_devices], par.axis_order("tp_inner", p))
  if model == "mixtral" and capacity_factor is None:
    capacity_factor = 0.0
  spec = get_model(model, size, layers=layers, seq_len=seq_len or SEQ[model], capacity_factor=capacity_factor)
  kw = {"execution": execution} if execution is not None else {}
  return Trainer(spec, mesh, dtype, tx if tx is not None else adamw(), batch, rules=rules,
                 grad_accum=grad_accum, **kw)


def flat(tree) -> dict[str, np.ndarray]:
  """{path: float32 array} of a gradient or parameter tree (paths as text, the same for every sharding)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(k): np.asarray(v, dtype=np.float32) for k, v in leaves}


@functools.cache
def reference_state(model: str, **kw) -> tuple[Any, Any, list[dict[str, np.ndarray]]]:
  """Seeded parameters, rest and the first synthetic batches of `model`, made once on one device and kept
  on the host: every strategy then starts from the very same values (placed with its own shardings)."""
  t = make_trainer(model, "dp:1", tx=sgd(0.0), **kw)
  params, rest, _ = t.init_state()
  make_batch = t.batch_fn()
  batches = [jax.tree.map(np.asarray, make_batch(i)) for i in range(STEPS)]
  return jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, rest), batches


STEPS = 3  # SGD steps compared
LR = 0.5


def sgd_run(t: Trainer, model: str, steps: int = STEPS, **ref_kw) -> tuple[list[float], dict[str, np.ndarray]]:
  """Losses over `steps` SGD steps (p <- p - LR * g, from the strategy's own gradients) and the first step's
  gradients as float32 arrays; one compiled gradient function serves both."""
  params_h, rest_h, batches_h = reference_state(model, **ref_kw)
  ref_shapes = {k: v.shape for k, v in flat(params_h).items()}
  # An interleaved pipeline stacks the layers [V, L/V, ...]: the same values in the same order as [L, ...].
  shapes, treedef = jax.tree.flatten(t.abstract_params)
  params_h = jax.tree.unflatten(treedef, [np.reshape(a, v.shape) for a, v in zip(jax.tree.leaves(params_h), shapes)])
  params = jax.device_put(params_h, t.param_shardings)
  rest = jax.device_put(rest_h, t.rest_shardings)
  batches = [jax.device_put(b, t.batch_shardings) for b in batches_h]
  with t.context():
    grads_fn = t.grads_fn().lower(params, rest, batches[0]).compile(FAST)
  update = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - LR * b, p, g), out_shardings=t.param_shardings)
  losses, first = [], None
  for i in range(steps):
    loss, grads = grads_fn(params, rest, batches[i])
    losses.append(float(loss))
    first = first or {k: g.reshape(ref_shapes[k]) for k, g in flat(grads).items()}
    params = update(params, grads)
  return losses, first




def compiled_step(t: Trainer):
  return t.compile_step(FAST)


def memory(t: Trainer) -> dict[str, int]:
  m = compiled_step(t).memory_analysis()
  return {"temp": int(m.temp_size_in_bytes), "args": int(m.argument_size_in_bytes)}


def partitioned_hlo(t: Trainer) -> str:
  """The step's HLO right after SPMD partitioning: per-device collectives as the partitioner placed them,
  before backend passes (on CPU, float-normalization-bf16 later widens bfloat16 collectives to float32)."""
  with tempfile.TemporaryDirectory() as d:
    t.compile_step({**FAST, "xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"})
    files = glob.glob(os.path.join(d, "*jit_step*after_spmd-partitioning*"))
    assert len(files) == 1, files
    with open(files[0]) as f:
      return f.read()


def assert_grads_match(got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float = 1e-4,
                       what: str = "") -> None:
  """Elementwise, float32: |got - want| <= rtol * |want| + atol per leaf, with atol = rtol x the leaf's
  largest gradient (entries far below a leaf's scale carry only rounding) plus 1e-7 x the largest gradient
  of the model (leaves that are zero in exact arithmetic, e.g. attention's key bias)."""
  assert got.keys() == want.keys()
  top = max(float(np.abs(w).max()) for w in want.values())
  for k in want:
    atol = rtol * float(np.abs(want[k]).max()) + 1e-7 * top
    np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=f"{what} gradient {k}")


def leaf(grads: dict[str, Any], *parts: str) -> np.ndarray:
  """The gradient whose path contains all `parts`."""
  hits = [v for k, v in grads.items() if all(p in k for p in parts)]
  assert len(hits) == 1, (parts, [k for k in grads if all(p in k for p in parts)])
  return hits[0]
