"""Transformer building blocks shared by the decoder (GPT-2 / Llama-3 shapes) and ViT.

Parameters are float32 and carry logical dimension names (`nnx.with_partitioning`). Where a layer uses a
weight it takes it through `weight`: cast to the compute dtype on the shard, then gathered over FSDP
(ZeRO-3), so the gather moves compute-dtype bytes and the full weight lives only inside the layer.
Activations are pinned with `constrain` at block boundaries so the sharding the rules give holds whatever
XLA would otherwise propagate. The blocks of a model are one `BlockStack`: parameters stacked along a
leading `layers` dimension and run under `jax.lax.scan`, so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from microbench.meshes.parallelism import constrain, constrain_for_use, vary
from microbench.models import context, pipeline_schedule

ACT_BTD = ("batch", "act_seq", "act_embed")
ACT_BTNH = ("batch", "act_seq", "act_heads", "act_head_dim")
ACT_BTKH = ("batch", "act_seq", "act_kv_heads", "act_head_dim")
ACT_BTF = ("batch", "act_seq", "act_mlp")

GATHERED = "gathered_weight"  # checkpoint name of every weight as gathered for use
EXCHANGED = "exchanged"  # checkpoint name of what a collective brought (MoE tokens after their all-to-all)

_VIEWS = frozenset({"sharding_constraint", "reshape", "transpose", "convert_element_type", "squeeze",
                    "broadcast_in_dim", "name"})


def _everything_but_views(prim, *_, **params) -> bool:
  """`--remat=none`: keep every intermediate except views of other values (layout, shape and dtype changes,
  names), whose inputs are kept instead: the same bytes (or fewer) for an activation, but for a gathered
  weight only its at-rest shard, so the backward pass gathers it again (a policy that only refused the
  `GATHERED` name would keep the weight's reshaped copy instead)."""
  del params
  return prim.name not in _VIEWS


# --remat: what a block keeps from its forward pass for the backward pass; the rest is recomputed. No policy
# keeps a gathered weight (ZeRO-3: the backward pass gathers it again).
REMAT_POLICIES = {
    # no rematerialisation: every intermediate the backward pass needs is kept, except the gathered weights
    "none": _everything_but_views,
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each block's input
    "dots_saveable": jax.checkpoint_policies.dots_saveable,  # keep every matmul output (XLA attention's too)
    # keep the projections' outputs (matmuls without batch dimensions), recompute attention and
    # element-wise work (MaxText's "minimal")
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # keep the QKV projections and the attention output (named in `Attention`), recompute the MLP
    "save_qkv_attention": jax.checkpoint_policies.save_only_these_names("qkv", "attention"),
}
ATTENTION_IMPLS = ("xla", "cudnn")
CONTEXT_IMPLS = context.IMPLS  # attention over a sequence split by `context`
PIPELINE_SCHEDULES = pipeline_schedule.SCHEDULES
# Timing arms (values meaningless, only durations used): the pipeline without its idle ticks, the MoE layers
# without their token exchange.
WITHOUT = (None, "bubble", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Execution:
  """How the layers run (not what they compute): rematerialisation, scan, attention kernels, and the
  pipeline's schedule when the mesh splits the layers over `stage`."""
  remat: str = "dots_with_no_batch_dims_saveable"
  scan: bool = True  # False: the same stacked parameters, layers unrolled in the program
  attention: str = "xla"  # a concrete implementation; "auto" is resolved by the trainer
  context_impl: str = "ring"  # with context parallelism
  schedule: str = "1f1b"  # with pipeline parallelism
  microbatches: int = 1  # pipeline microbatches per step
  virtual_stages: int = 1  # layer chunks per pipeline stage (interleaved); parameters stacked [V, L/V, ...]
  without: str | None = None  # a timing arm (WITHOUT); never for training

  def __post_init__(self):
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat policy {self.remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f"attention {self.attention!r}: choose one of {', '.join(ATTENTION_IMPLS)}")
    if self.context_impl not in CONTEXT_IMPLS:
      raise ValueError(f"context_impl {self.context_impl!r}: choose one of {', '.join(CONTEXT_IMPLS)}")
    if self.schedule not in PIPELINE_SCHEDULES:
      raise ValueError(f"schedule {self.schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if self.microbatches < 1 or self.virtual_stages < 1:
      raise ValueError(f"microbatches ({self.microbatches}) and virtual_stages ({self.virtual_stages}) must be >= 1")
    if self.without not in WITHOUT:
      raise ValueError(f"without {self.without!r}: choose one of {WITHOUT}")


def project(x: jax.Array, w: jax.Array, in_dims: int = 1) -> jax.Array:
  """`x[..., *in] @ w[*in, *out]` as one 2-D matmul `[rows, prod(in)] x [prod(in), prod(out)]`.

  Why: XLA's CPU matmuls are much slower on 3-D operands (a GPT-2 MLP forward+backward took 158 ms with
  [B, T, D] activations and 93 ms with [B*T, D]); the reshapes are bitcasts, and merging a sharded major
  dimension with unsharded minor ones keeps the sharding, so the SPMD partitioning is unchanged.
  """
  lead, ins, outs = x.shape[:-in_dims], x.shape[x.ndim - in_dims:], w.shape[in_dims:]
  k = math.prod(ins)
  return (x.reshape(-1, k) @ w.reshape(k, -1)).reshape(*lead, *outs)


def weight(v: nnx.Variable, dtype) -> jax.Array:
  """A parameter as a layer uses it: cast to `dtype` on its shard, then gathered over FSDP (ZeRO-3).

  The cast shard is pinned to the weight's at-rest sharding before the use layout is applied, so the cast
  happens before the all-gather (otherwise sharding propagation hands the use layout back to the cast's
  float32 operand and the gather moves float32 bytes). Differentiation transposes the two constraints in
  reverse: the gradient is summed over the batch shards in the use layout (one reduction), then sliced to
  this device's shard (all-reduce + dynamic-slice, which XLA's GPU pipeline, ReduceScatterCreator, makes a
  reduce-scatter), then cast to float32 on the slice. The gathered weight is named `GATHERED`, which no remat
  policy keeps, so a block's backward pass gathers its weights again. Inside a scan over a `BlockStack` the
  stacked `layers` dimension is already sliced off, so only the trailing names apply.
  """
  names = tuple(v.get_metadata().get("out_sharding") or ())
  value = v[...]
  names = names[len(names) - value.ndim:] if names else (None,) * value.ndim
  return checkpoint_name(constrain_for_use(constrain(value.astype(dtype), names), names), GATHERED)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  d_model: int
  num_heads: int
  num_kv_heads: int
  d_ff: int
  norm: str = "layernorm"  # or "rmsnorm"
  mlp: str = "gelu"  # or "swiglu"
  rope: bool = False
  rope_theta: float = 10000.0
  use_bias: bool = True
  causal: bool = True
  norm_eps: float = 1e-5

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean cross-entropy over every position, in float32 whatever the compute dtype."""
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def param(rngs: nnx.Rngs, shape: Sequence[int], names: Sequence[str | None], init=None) -> nnx.Param:
  """A float32 parameter annotated with logical dimension names."""
  init = init or jax.nn.initializers.normal(0.02)
  return nnx.Param(nnx.with_partitioning(init, tuple(names))(rngs.params(), tuple(shape), jnp.float32))


class Norm(nnx.Module):
  """LayerNorm (with bias) or RMSNorm, computed in float32."""

  def __init__(self, dim: int, kind: str, eps: float, rngs: nnx.Rngs):
    self.kind, self.eps = kind, eps
    self.scale = param(rngs, (dim,), ("norm",), jax.nn.initializers.ones)
    self.bias = param(rngs, (dim,), ("norm",), jax.nn.initializers.zeros) if kind == "layernorm" else None

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    if self.kind == "layernorm":
      x32 = x32 - x32.mean(-1, keepdims=True)
    y = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + self.eps) * weight(self.scale, jnp.float32)
    if self.bias is not None:
      y = y + weight(self.bias, jnp.float32)
    return y.astype(x.dtype)


def rotary(x_BTNH: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (Llama's half-split form), angles in float32."""
  t, h = x_BTNH.shape[1], x_BTNH.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
  ang_TH = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  cos, sin = jnp.cos(ang_TH)[None, :, None, :], jnp.sin(ang_TH)[None, :, None, :]
  x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)


class Attention(nnx.Module):
  """Multi-head / grouped-query attention; QKV split by heads (TP columns), output by rows."""

  def __init__(self, cfg: BlockConfig, rngs: nnx.Rngs, out_std: float, execution: Execution = Execution()):
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg, self.impl, self.context_impl = cfg, execution.attention, execution.context_impl
    self.wq = param(rngs, (d, n, h), ("embed", "heads", "head_dim"))
    self.wk = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"))
    self.wv = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"))
    self.wo = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), jax.nn.initializers.normal(out_std))
    if cfg.use_bias:
      zeros = jax.nn.initializers.zeros
      self.bq = param(rngs, (n, h), ("heads", "head_dim"), zeros)
      self.bk = param(rngs, (k, h), ("kv_heads", "head_dim"), zeros)
      self.bv = param(rngs, (k, h), ("kv_heads", "head_dim"), zeros)
      self.bo = param(rngs, (d,), ("embed",), zeros)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    cfg, dt = self.cfg, x_BTD.dtype
    q = project(x_BTD, weight(self.wq, dt))
    k = project(x_BTD, weight(self.wk, dt))
    v = project(x_BTD, weight(self.wv, dt))
    if cfg.use_bias:
      q, k, v = q + weight(self.bq, dt), k + weight(self.bk, dt), v + weight(self.bv, dt)
    if cfg.rope:
      q, k = rotary(q, cfg.rope_theta), rotary(k, cfg.rope_theta)
    q_BTNH, k_BTKH, v_BTKH = constrain(q, ACT_BTNH), constrain(k, ACT_BTKH), constrain(v, ACT_BTKH)
    q_BTNH, k_BTKH, v_BTKH = (checkpoint_name(a, "qkv") for a in (q_BTNH, k_BTKH, v_BTKH))
    # Ring or all-to-all attention when the sequence is split over `context`, XLA's or cuDNN's otherwise.
    o_BTNH = context.attention(q_BTNH, k_BTKH, v_BTKH, cfg.causal, self.context_impl, implementation=self.impl)
    o_BTNH = checkpoint_name(constrain(o_BTNH, ACT_BTNH), "attention")
    out = project(o_BTNH, weight(self.wo, dt), in_dims=2)
    if cfg.use_bias:
      out = out + weight(self.bo, dt)
    return out


class Mlp(nnx.Module):
  """GELU MLP (GPT-2, ViT) or SwiGLU (Llama); up/gate split by columns, down by rows."""

  def __init__(self, cfg: BlockConfig, rngs: nnx.Rngs, out_std: float):
    d, f = cfg.d_model, cfg.d_ff
    self.cfg = cfg
    self.w_up = param(rngs, (d, f), ("embed", "mlp"))
    self.w_gate = param(rngs, (d, f), ("embed", "mlp")) if cfg.mlp == "swiglu" else None
    self.w_down = param(rngs, (f, d), ("mlp", "embed"), jax.nn.initializers.normal(out_std))
    if cfg.use_bias:
      self.b_up = param(rngs, (f,), ("mlp",), jax.nn.initializers.zeros)
      self.b_down = param(rngs, (d,), ("embed",), jax.nn.initializers.zeros)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    dt = x_BTD.dtype
    h_BTF = project(x_BTD, weight(self.w_up, dt))
    if self.cfg.use_bias:
      h_BTF = h_BTF + weight(self.b_up, dt)
    if self.w_gate is not None:
      h_BTF = jax.nn.silu(project(x_BTD, weight(self.w_gate, dt))) * h_BTF
    else:
      h_BTF = jax.nn.gelu(h_BTF, approximate=True)
    h_BTF = constrain(h_BTF, ACT_BTF)
    out = project(h_BTF, weight(self.w_down, dt))
    if self.cfg.use_bias:
      out = out + weight(self.b_down, dt)
    return out


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: BlockConfig, rngs: nnx.Rngs, num_layers: int, execution: Execution = Execution()):
    out_std = 0.02 / (2 * num_layers) ** 0.5  # GPT-2's scaled init of the residual projections
    self.norm1 = Norm(cfg.d_model, cfg.norm, cfg.norm_eps, rngs)
    self.attn = Attention(cfg, rngs, out_std, execution)
    self.norm2 = Norm(cfg.d_model, cfg.norm, cfg.norm_eps, rngs)
    self.mlp = Mlp(cfg, rngs, out_std)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    x_BTD = constrain(x_BTD + self.attn(self.norm1(x_BTD)), ACT_BTD)
    return constrain(x_BTD + self.mlp(self.norm2(x_BTD)), ACT_BTD)


# A block's extra outputs (a mixture-of-experts block's): its auxiliary loss (float32 scalar, added to the
# objective) and statistics (float32 scalars, summed over layers, never differentiated).
Stats = dict[str, jax.Array]


def run_layers(graphdef: nnx.GraphDef, state: nnx.State, x_BTD: jax.Array, execution: Execution
               ) -> tuple[jax.Array, jax.Array, Stats]:
  """Stacked blocks (`state` leaves lead with the layer dim) in order: (x, summed aux loss, summed stats).

  A block returns `x` or `(x, aux_loss, stats)`. Under a scan (or unrolled), each block rematerialised with
  the execution's policy. The pipeline runs a stage's chunk of layers through this same function.
  """
  def body(carry, layer_state):
    x, aux = carry
    out = nnx.merge(graphdef, layer_state)(x)
    x, a, stats = out if isinstance(out, tuple) else (out, jnp.zeros((), jnp.float32), {})
    return (x, aux + a), stats

  # Every policy but `full` keeps what an exchange brought, so recomputation never repeats an all-to-all.
  policy = REMAT_POLICIES[execution.remat]
  if execution.remat != "full":
    policy = jax.checkpoint_policies.save_from_both_policies(
        policy, jax.checkpoint_policies.save_only_these_names(EXCHANGED))
  # Inside a scan the loop already keeps recomputation apart from the forward pass (JAX's advice).
  body = jax.checkpoint(body, policy=policy, prevent_cse=not execution.scan)
  # The aux-loss carry varies over the same manual mesh axes as the activations (inside a pipeline stage).
  zero = vary(jnp.zeros((), jnp.float32), tuple(jax.typeof(x_BTD).manual_axis_type.varying))
  if execution.scan:
    (x_BTD, aux), stats = jax.lax.scan(body, (x_BTD, zero), state)
  else:
    carry, per_layer = (x_BTD, zero), []
    for i in range(jax.tree.leaves(state)[0].shape[0]):
      carry, st = body(carry, jax.tree.map(lambda a, i=i: a[i], state))
      per_layer.append(st)
    (x_BTD, aux) = carry
    stats = jax.tree.map(lambda *a: jnp.stack(a), *per_layer) if per_layer and per_layer[0] else {}
  return x_BTD, aux, {k: jnp.sum(v, axis=0) for k, v in stats.items()}


def stack_chunks(tree: Any, virtual: int) -> Any:
  """[L, ...] leaves -> [V, L/V, ...]: chunk c of device d is virtual stage c*S+d when dim 1 is split
  over S stages (for V=1 this only adds the leading dim)."""
  return jax.tree.map(lambda a: a.reshape(virtual, a.shape[0] // virtual, *a.shape[1:]), tree)


def unstack_chunks(tree: Any) -> Any:
  """Inverse of `stack_chunks`: [V, L/V, ...] leaves -> [L, ...] in layer order."""
  return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)



class BlockStack(nnx.Module):
  """`num_layers` blocks whose parameters are stacked along a leading `layers` dimension.

  Run under `jax.lax.scan` (one block in the program whatever the depth: compile time and program size
  stay flat) or, with `Execution(scan=False)`, unrolled over the same stacked parameters. Each block is
  rematerialised with the `Execution.remat` policy. The leading dimension is named `layers` so the
  logical-axis rules can place it (pipeline stages map `layers` to the `stage` axis). `make_block(rngs)`
  builds one block (default: the dense `Block` of `cfg`).
  """

  def __init__(self, cfg: BlockConfig | None, num_layers: int, rngs: nnx.Rngs, execution: Execution = Execution(),
               make_block: Callable[[nnx.Rngs], nnx.Module] | None = None):
    self.num_layers, self.execution = num_layers, execution
    make_block = make_block or (lambda r: Block(cfg, r, num_layers, execution))

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r: nnx.Rngs) -> nnx.Module:
      return make_block(r)

    self.layers = make(rngs)
    v = execution.virtual_stages
    if v > 1:
      # Interleaved pipeline: [L, ...] -> [V, L/V, ...] with dim 1 over `stage`, so device d holds layer
      # chunks d, d+S, ... in place (split as [L] over stage, they would move every step). The values are
      # those of the [L] stack: the same seed gives the same model whatever V.
      if num_layers % v:
        raise ValueError(f"{v} virtual stages do not divide the {num_layers} layers")
      for _, var in nnx.iter_graph(self.layers):
        if isinstance(var, nnx.Variable):
          var.set_value(stack_chunks(var[...], v))
          var.set_metadata(out_sharding=(None, *var.get_metadata()["out_sharding"]))

  def run(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, Stats]:
    """(x, aux loss, stats) after every block, in layer order (a `[V, L/V]` stack read as `[L]`)."""
    graphdef, state = nnx.split(self.layers)
    if self.execution.virtual_stages > 1:
      state = unstack_chunks(state)
    return run_layers(graphdef, state, x_BTD, self.execution)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    return self.run(x_BTD)[0]
