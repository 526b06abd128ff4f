"""Sharded training state and the jitted train step; every sharding comes from the logical-axis rules.

Parameters are created inside `jit` with the rules' shardings as outputs, so a model too big for one
device is never materialised whole. The optimizer state takes its parameter's sharding (FSDP shards
it with the weights). The step donates the state so updates happen in place. With `grad_accum > 1` the
step scans over microbatches, accumulating float32 gradients in the parameters' (sharded) layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from microbench.meshes.parallelism import RULES, LogicalRules, spec_for
from microbench.models.layers import Execution
from microbench.models.pipeline import to_microbatches
from microbench.models.registry import ModelSpec


def variable_spec(v: nnx.Variable, rules: LogicalRules = RULES) -> jax.P:
  """PartitionSpec of a parameter from the dimension names it was created with."""
  names = v.get_metadata().get("out_sharding")
  return spec_for(names, rules) if names else jax.P()


def state_shardings(state: nnx.State, mesh: jax.sharding.Mesh, rules: LogicalRules = RULES) -> nnx.State:
  """NamedShardings with the same tree structure as `state` (Variables holding shardings)."""
  return jax.tree.map(lambda v: v.replace(NamedSharding(mesh, variable_spec(v, rules))), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclasses.dataclass
class Trainer:
  """Everything needed to run training steps of one model on one mesh."""
  spec: ModelSpec
  mesh: jax.sharding.Mesh
  dtype: Any
  tx: optax.GradientTransformation
  batch: int
  seed: int = 0
  rules: LogicalRules = RULES
  execution: Execution = Execution()
  grad_accum: int = 1  # microbatches per step

  def __post_init__(self):
    with nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(lambda: self.spec.make(self.dtype, self.seed, self.execution))
    self.graphdef, self.abstract_params, self.abstract_rest = nnx.split(abstract, nnx.Param, ...)
    self.param_shardings = state_shardings(self.abstract_params, self.mesh, self.rules)
    self.rest_shardings = state_shardings(self.abstract_rest, self.mesh, self.rules)
    replicated = NamedSharding(self.mesh, jax.P())
    abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
    self.opt_shardings = optax.tree_map_params(
        self.tx, lambda _, s: s, abstract_opt, self.param_shardings,
        transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, nnx.Variable))
    self.batch_shardings = {k: NamedSharding(self.mesh, spec_for(names, self.rules))
                            for k, names in self.spec.batch_spec().items()}
    self.state_shardings = (self.param_shardings, self.rest_shardings, self.opt_shardings)
    self._replicated = replicated

  def context(self):
    """Mesh and rules active while tracing, so `constrain` in the models resolves names."""
    mesh, rules = self.mesh, self.rules

    class _Ctx:
      def __enter__(self):
        self._m, self._r = jax.set_mesh(mesh), nnx.logical_axis_rules(rules)
        self._m.__enter__()
        self._r.__enter__()

      def __exit__(self, *exc):
        self._r.__exit__(*exc)
        self._m.__exit__(*exc)
    return _Ctx()

  @property
  def num_params(self) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(self.abstract_params))

  def init_state(self) -> tuple[nnx.State, nnx.State, Any]:
    """(params, rest, opt_state), created sharded on the mesh."""
    def init():
      with nnx.use_eager_sharding(False):
        model = self.spec.make(self.dtype, self.seed, self.execution)
      _, params, rest = nnx.split(model, nnx.Param, ...)
      return params, rest, self.tx.init(params)
    with self.context():
      lowered = jax.jit(init, out_shardings=self.state_shardings).lower()
      # Runs once: skip LLVM's optimisations (several times faster to compile on CPU).
      return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})()

  def batch_fn(self) -> Callable[[int], dict[str, jax.Array]]:
    """step -> synthetic batch, generated on the devices and sharded along `batch`."""
    base = jax.random.key(self.seed + 1)
    fn = jax.jit(lambda step: self.spec.make_batch(jax.random.fold_in(base, step), self.batch),
                 out_shardings=self.batch_shardings)
    return lambda step: fn(jnp.int32(step))

  def _microbatches(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """[B, ...] -> [N, B/N, ...] where microbatch i takes every N-th example: each device keeps exactly
    its own examples (its contiguous block of B splits into whole groups of N), so no data moves."""
    n, names = self.grad_accum, self.spec.batch_spec()
    out = {}
    for k, a in batch.items():
      a = to_microbatches(a, n)
      out[k] = jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, spec_for((None, *names[k]), self.rules)))
    return out

  def loss_and_grads(self, params, rest, batch):
    """(mean loss, float32 gradients in the parameters' shardings, new rest, stats) over the whole batch;
    stats (a mixture of experts' router counts) are summed over microbatches."""
    graphdef, spec = self.graphdef, self.spec

    def loss_fn(p, r, b):  # `r` passed in, not closed over: BatchNorm updates it inside this trace
      model = nnx.merge(graphdef, p, r, copy=True)
      loss, stats = spec.loss(model, b)
      _, _, new_rest = nnx.split(model, nnx.Param, ...)
      return loss, (new_rest, stats)

    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
    if self.grad_accum == 1:
      (loss, (rest, stats)), grads = value_and_grad(params, rest, batch)
      return loss, grads, rest, stats

    def pin(tree):
      return jax.tree.map(jax.lax.with_sharding_constraint, tree, self.param_shardings)

    def body(carry, micro):
      loss_sum, grad_sum, r = carry
      (loss, (r, stats)), grads = value_and_grad(params, r, micro)
      return (loss_sum + loss, pin(jax.tree.map(jnp.add, grad_sum, grads)), r), stats

    zeros = pin(jax.tree.map(jnp.zeros_like, params))
    (loss_sum, grad_sum, rest), stats = jax.lax.scan(body, (jnp.float32(0), zeros, rest), self._microbatches(batch))
    stats = jax.tree.map(lambda a: jnp.sum(a, axis=0), stats)
    n = self.grad_accum  # equal microbatches: the mean of their means is the batch mean
    return loss_sum / n, jax.tree.map(lambda g: g / n, grad_sum), rest, stats

  def step_fn(self) -> Callable:
    """(params, rest, opt_state, batch) -> (params, rest, opt_state, {loss, grad_norm, stats...}), jitted and
    donating."""
    tx = self.tx

    def step(params, rest, opt_state, batch):
      loss, grads, new_rest, stats = self.loss_and_grads(params, rest, batch)
      grad_norm = optax.tree.norm(grads)  # before clipping, as MaxText and Megatron-LM log it
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), new_rest, opt_state,
              {"loss": loss, "grad_norm": grad_norm, **stats})

    return jax.jit(step, in_shardings=(*self.state_shardings, self.batch_shardings),
                   out_shardings=(*self.state_shardings, self._replicated), donate_argnums=(0, 1, 2))

  def grads_fn(self) -> Callable:
    """(params, rest, batch) -> (loss, gradients), jitted with the step's shardings (for equivalence tests
    and the overhead timings: it donates nothing)."""
    def grads(params, rest, batch):
      loss, g, _, _ = self.loss_and_grads(params, rest, batch)
      return loss, g

    return jax.jit(grads, in_shardings=(self.param_shardings, self.rest_shardings, self.batch_shardings),
                   out_shardings=(self._replicated, self.param_shardings))

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    return jax.eval_shape(lambda: self.spec.make_batch(jax.random.key(0), self.batch))

  def compile_step(self, compiler_options: dict[str, Any] | None = None):
    """The step lowered and compiled ahead of time (for compile time, memory and HLO)."""
    with self.context():
      abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
      args = (self.abstract_params, self.abstract_rest, abstract_opt, self.abstract_batch())
      return self.step_fn().lower(*args).compile(compiler_options=compiler_options)
