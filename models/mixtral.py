"""Mixtral-style mixture-of-experts decoder: Llama-shaped attention (RMSNorm, rotary, grouped-query) with
a top-2 MoE MLP in every block (`microbench.models.moe`).

It is the decoder of `microbench.models.transformer` with other blocks: the same embedding, stacked and scanned
blocks (so pipeline parallelism splits them over `stage` the same way), final norm and untied head.
8x7B follows the published config (d 4096, 32 layers, 32 heads / 8 KV heads, 8 experts of d_ff 14336,
vocabulary 32000, rope theta 1e6): 46,702,792,704 parameters.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from microbench.meshes.parallelism import constrain
from microbench.models.layers import ACT_BTD, Attention, BlockConfig, Execution, Norm, Stats
from microbench.models.moe import MoeConfig, MoeMlp
from microbench.models.transformer import Transformer, TransformerConfig


@dataclasses.dataclass(frozen=True)
class MixtralConfig(TransformerConfig):
  moe: MoeConfig = MoeConfig(num_experts=8)  # block.d_ff is each expert's hidden size


def _mixtral(d: int, layers: int, heads: int, kv: int, ff: int, experts: int, vocab: int,
             seq: int) -> MixtralConfig:
  block = BlockConfig(d_model=d, num_heads=heads, num_kv_heads=kv, d_ff=ff, norm="rmsnorm", mlp="swiglu",
                      rope=True, rope_theta=1e6, use_bias=False)
  return MixtralConfig(block, vocab, layers, seq, learned_positions=False, tie_embeddings=False,
                       moe=MoeConfig(num_experts=experts))


SIZES: dict[str, MixtralConfig] = {
    "tiny": _mixtral(64, 2, 4, 2, 64, 8, vocab=256, seq=128),
    "8x7b": _mixtral(4096, 32, 32, 8, 14336, 8, vocab=32000, seq=32768),
}


class MixtralBlock(nnx.Module):
  """x + attn(norm(x)), then x + moe(norm(x)); also returns the block's aux loss and router stats."""

  def __init__(self, cfg: MixtralConfig, rngs: nnx.Rngs, execution: Execution = Execution()):
    b = cfg.block
    out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
    self.norm1 = Norm(b.d_model, b.norm, b.norm_eps, rngs)
    self.attn = Attention(b, rngs, out_std, execution)
    self.norm2 = Norm(b.d_model, b.norm, b.norm_eps, rngs)
    self.moe = MoeMlp(b.d_model, b.d_ff, cfg.moe, rngs, out_std, exchange=execution.without != "all_to_all")

  def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, Stats]:
    x_BTD = constrain(x_BTD + self.attn(self.norm1(x_BTD)), ACT_BTD)
    y_BTD, aux, stats = self.moe(self.norm2(x_BTD))
    return constrain(x_BTD + y_BTD, ACT_BTD), aux, stats


class Mixtral(Transformer):
  """tokens [B, T] -> (logits [B, T, V], {"aux_loss", router stats}); `loss` as the dense decoder's."""

  def _block_maker(self, cfg: MixtralConfig, execution: Execution):
    return lambda r: MixtralBlock(cfg, r, execution)

  def __call__(self, tokens_BT: jax.Array) -> tuple[jax.Array, Stats]:
    logits_BTV, aux, stats = self.forward(tokens_BT)
    return logits_BTV, {"aux_loss": aux, **stats}
