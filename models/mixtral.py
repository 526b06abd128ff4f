"""Mixtral-style mixture-of-experts decoder: Llama-shaped attention (RMSNorm, rotary, grouped-query) with
a top-2 MoE MLP in every block (`models.moe`).

The blocks are stacked (parameters with a leading `layers` dim, created with `nnx.vmap`) and run under
`lax.scan`, so pipeline parallelism can split them over `stage`. 8x7B follows the published config
(d 4096, 32 layers, 32 heads / 8 KV heads, 8 experts of d_ff 14336, vocabulary 32000, rope theta 1e6):
46,702,792,704 parameters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from meshes.parallelism import constrain
from models.layers import ACT_BTD, Attention, BlockConfig, Norm, param, project
from models.moe import MoeConfig, MoeMlp


@dataclasses.dataclass(frozen=True)
class MixtralConfig:
  block: BlockConfig  # d_ff is each expert's hidden size
  moe: MoeConfig
  vocab_size: int
  num_layers: int
  max_seq_len: int
  learned_positions: bool = False
  tie_embeddings: bool = False


def _mixtral(d: int, layers: int, heads: int, kv: int, ff: int, experts: int, vocab: int,
             seq: int) -> MixtralConfig:
  block = BlockConfig(d_model=d, num_heads=heads, num_kv_heads=kv, d_ff=ff, norm="rmsnorm", mlp="swiglu",
                      rope=True, rope_theta=1e6, use_bias=False)
  return MixtralConfig(block, MoeConfig(num_experts=experts), vocab, layers, seq)


SIZES: dict[str, MixtralConfig] = {
    "tiny": _mixtral(64, 2, 4, 2, 64, 8, vocab=256, seq=128),
    "8x7b": _mixtral(4096, 32, 32, 8, 14336, 8, vocab=32000, seq=32768),
}


class MixtralBlock(nnx.Module):
  """x + attn(norm(x)), then x + moe(norm(x)); also returns the block's aux loss and router stats."""

  def __init__(self, cfg: MixtralConfig, rngs: nnx.Rngs):
    b = cfg.block
    out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
    self.norm1 = Norm(b.d_model, b.norm, b.norm_eps, rngs)
    self.attn = Attention(b, rngs, out_std)
    self.norm2 = Norm(b.d_model, b.norm, b.norm_eps, rngs)
    self.moe = MoeMlp(b.d_model, b.d_ff, cfg.moe, rngs, out_std)

  def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    x_BTD = constrain(x_BTD + self.attn(self.norm1(x_BTD)), ACT_BTD)
    y_BTD, aux, stats = self.moe(self.norm2(x_BTD))
    return constrain(x_BTD + y_BTD, ACT_BTD), aux, stats


def run_blocks(graphdef: nnx.GraphDef, stacked: nnx.State, x_BTD: jax.Array
               ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """The stacked blocks (leading dim: layers) in order: (x, summed aux loss, summed stats)."""
  def body(carry, layer):
    x, aux = carry
    x, a, stats = nnx.merge(graphdef, layer)(x)
    return (x, aux + a), stats
  # The aux-loss carry varies over the same manual mesh axes as the activations (inside a pipeline stage).
  varying = tuple(jax.typeof(x_BTD).manual_axis_type.varying)
  zero = jnp.zeros((), jnp.float32)
  zero = jax.lax.pcast(zero, varying, to="varying") if varying else zero
  (x_BTD, aux), stats = jax.lax.scan(body, (x_BTD, zero), stacked)
  return x_BTD, aux, {k: jnp.sum(v, axis=0) for k, v in stats.items()}


class Mixtral(nnx.Module):
  """tokens [B, T] -> (logits [B, T, V], {"aux_loss", router stats})."""

  def __init__(self, cfg: MixtralConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
    d = cfg.block.d_model
    self.cfg, self.dtype = cfg, dtype
    self.embed = param(rngs, (cfg.vocab_size, d), ("vocab", "embed"))

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r: nnx.Rngs) -> MixtralBlock:
      return MixtralBlock(cfg, r)
    self.blocks = make(rngs)
    self.norm = Norm(d, cfg.block.norm, cfg.block.norm_eps, rngs)
    self.head = param(rngs, (d, cfg.vocab_size), ("embed", "vocab"))

  def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
    table_VD = constrain(self.embed[...], ("vocab", None))
    return constrain(jnp.take(table_VD, tokens_BT, axis=0).astype(self.dtype), ACT_BTD)

  def logits(self, x_BTD: jax.Array) -> jax.Array:
    logits_BTV = project(self.norm(x_BTD), self.head[...].astype(self.dtype))
    return constrain(logits_BTV, ("batch", "act_seq", "act_vocab"))

  def __call__(self, tokens_BT: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    graphdef, stacked = nnx.split(self.blocks)
    x_BTD, aux, stats = run_blocks(graphdef, stacked, self.embed_tokens(tokens_BT))
    return self.logits(x_BTD), {"aux_loss": aux, **stats}
