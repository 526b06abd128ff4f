"""Decoder-only transformer: GPT-2 shapes (LayerNorm, GELU, learned positions, tied embeddings) and
Llama-3 shapes (RMSNorm, SwiGLU, rotary, grouped-query attention, untied head).

The GPT-2 family follows the GPT-3 paper's size table (125M/350M/1.3B rows) with GPT-2's architecture
and 1024 context; the vocabulary is padded from 50257 to 50304 (a multiple of 64, as nanoGPT/llm.c do)
so it splits evenly for tensor parallelism.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from microbench.meshes.parallelism import constrain, mesh_degree
from microbench.models import pipeline
from microbench.models.layers import (ACT_BTD, BlockConfig, BlockStack, Execution, Norm, Stats, cross_entropy,
                                      param, project, weight)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  block: BlockConfig
  vocab_size: int
  num_layers: int
  max_seq_len: int
  learned_positions: bool = True
  tie_embeddings: bool = True


def _gpt2(d: int, layers: int, heads: int, vocab: int = 50304, seq: int = 1024) -> TransformerConfig:
  block = BlockConfig(d_model=d, num_heads=heads, num_kv_heads=heads, d_ff=4 * d)
  return TransformerConfig(block, vocab, layers, seq)


def _llama3(d: int, layers: int, heads: int, kv: int, ff: int, vocab: int = 128256,
            seq: int = 8192) -> TransformerConfig:
  block = BlockConfig(d_model=d, num_heads=heads, num_kv_heads=kv, d_ff=ff, norm="rmsnorm", mlp="swiglu",
                      rope=True, rope_theta=500000.0, use_bias=False)
  return TransformerConfig(block, vocab, layers, seq, learned_positions=False, tie_embeddings=False)


SIZES: dict[str, dict[str, TransformerConfig]] = {
    "gpt2": {
        "tiny": _gpt2(64, 2, 4, vocab=256, seq=128),
        "124m": _gpt2(768, 12, 12),
        "350m": _gpt2(1024, 24, 16),
        "1.3b": _gpt2(2048, 24, 16),
    },
    "llama3": {
        "tiny": _llama3(64, 2, 4, 2, 192, vocab=256, seq=128),
        # 4 KV heads: tensor parallelism up to 4, as the study's 70B runs it (its CPU rehearsal shape)
        "small": _llama3(128, 4, 8, 4, 448, vocab=512, seq=256),
        "8b": _llama3(4096, 32, 32, 8, 14336),
        "70b": _llama3(8192, 80, 64, 8, 28672),
    },
    # The study's DP+PP model (Minerva-7B, Mistral-shaped): Llama-3-8B's blocks with a 51,264-token
    # vocabulary (Minerva's 51,200 padded to a multiple of 64) and untied embeddings give the study's
    # 7,399,542,784 parameters; context 4096.
    "minerva": {
        "7b": _llama3(4096, 32, 32, 8, 14336, vocab=51264, seq=4096),
    },
}


def tied_head(table: jax.Array) -> jax.Array:
  """The tied embedding table where the LM head reads it (the identity). Every head use of the table goes
  through here, so that use is one named place: tests plant a stop-gradient here to show the tied-gradient
  reference test (tests/test_tied_embedding.py) sees a head that stops training the table."""
  return table


class Transformer(nnx.Module):
  """tokens [B, T] -> logits [B, T, V]; `loss` gives the training objective (pipelined over `stage` when the
  mesh has stages)."""

  def __init__(self, cfg: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs,
               execution: Execution = Execution()):
    d = cfg.block.d_model
    self.cfg, self.dtype = cfg, dtype
    self.embed = param(rngs, (cfg.vocab_size, d), ("vocab", "embed"))
    self.pos = param(rngs, (cfg.max_seq_len, d), ("pos", "embed"), jax.nn.initializers.normal(0.01)) \
        if cfg.learned_positions else None
    self.blocks = BlockStack(cfg.block, cfg.num_layers, rngs, execution, self._block_maker(cfg, execution))
    self.norm = Norm(d, cfg.block.norm, cfg.block.norm_eps, rngs)
    self.head = None if cfg.tie_embeddings else param(rngs, (d, cfg.vocab_size), ("embed", "vocab"))

  def _block_maker(self, cfg: TransformerConfig, execution: Execution):
    """One block from its rngs; None: the dense `Block` (a mixture-of-experts model gives its own)."""
    del cfg, execution
    return None

  def _positioned(self, x_BTD: jax.Array) -> jax.Array:
    if self.pos is not None:
      x_BTD = x_BTD + weight(self.pos, self.dtype)[:x_BTD.shape[1]]
    return constrain(x_BTD, ACT_BTD)

  def forward(self, tokens_BT: jax.Array) -> tuple[jax.Array, jax.Array, Stats]:
    """(logits [B, T, V], the blocks' summed aux loss, their stats)."""
    b, t = tokens_BT.shape
    # The table is used gathered over FSDP (vocabulary split only, by TP): XLA partitions a lookup into
    # a vocab-sharded table as local lookups plus an all-reduce of the activations.
    table_VD = weight(self.embed, self.dtype)
    shards = mesh_degree(("batch",))
    tied_split = self.head is None and shards > 1 and b % shards == 0
    if tied_split:
      # Tied table: both uses read a per-batch-shard copy [S, V, D] (each device holds its own slice, so
      # no more memory than the gathered table). Both gradient contributions then add up on the device
      # and the sum over S reduces them once; used directly, XLA reduces the lookup's and the head's
      # [V, D] gradients separately (twice the bytes of that table).
      table_SVD = constrain(jnp.broadcast_to(table_VD[None], (shards, *table_VD.shape)), ("batch", "vocab", None))
      tokens_SBT = constrain(tokens_BT.reshape(shards, b // shards, t), ("batch", None, None))
      x_BTD = jax.vmap(lambda tab, tok: jnp.take(tab, tok, axis=0))(table_SVD, tokens_SBT).reshape(b, t, -1)
    else:
      x_BTD = jnp.take(table_VD, tokens_BT, axis=0)
    x_BTD = self._positioned(x_BTD)
    x_BTD, aux, stats = self.blocks.run(x_BTD)
    x_BTD = self.norm(x_BTD)
    if tied_split:
      x_SND = x_BTD.reshape(shards, -1, x_BTD.shape[-1])
      logits_SNV = jnp.einsum("snd,svd->snv", x_SND, tied_head(table_SVD))
      logits_BTV = logits_SNV.reshape(b, t, -1)
    else:
      logits_BTV = project(x_BTD, self._head_weight(table_VD))
    return constrain(logits_BTV, ("batch", "act_seq", "act_vocab")), aux, stats

  def _head_weight(self, table_VD: jax.Array) -> jax.Array:
    return tied_head(table_VD).T if self.head is None else weight(self.head, self.dtype)

  def __call__(self, tokens_BT: jax.Array) -> jax.Array:
    return self.forward(tokens_BT)[0]

  def loss(self, tokens_BT: jax.Array, targets_BT: jax.Array) -> tuple[jax.Array, Stats]:
    """(mean cross-entropy + the blocks' aux losses, their stats), through the pipeline when the mesh has
    stages: the embedding before it, the final norm, LM head and loss on its last stage, per microbatch."""
    if pipeline.stages() == 1:
      logits_BTV, aux, stats = self.forward(tokens_BT)
      return cross_entropy(logits_BTV, targets_BT) + aux, stats
    dt, tied = self.dtype, self.head is None
    # Used whole on the last stage: the FSDP gather of the head happens once per step at the pipeline's edge.
    head_w = self.embed if tied else self.head
    norm_def, norm_state = nnx.split(self.norm)
    head_params = {"norm": pipeline.values(norm_state), "w": head_w[...]}
    x_BTD = self._positioned(jnp.take(weight(self.embed, dt), tokens_BT, axis=0))

    def head_fn(hp, y_bTD, targets_bT):
      w = hp["w"].astype(dt)
      logits = project(nnx.merge(norm_def, hp["norm"])(y_bTD), tied_head(w).T if tied else w)
      return cross_entropy(logits, targets_bT)

    return pipeline.stack_loss(self.blocks, x_BTD, targets_BT, head_fn, head_params)
