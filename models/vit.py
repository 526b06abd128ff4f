"""Vision Transformer (ViT-H/14 shape and a tiny one): patches -> encoder blocks -> class token head.

Uses the decoder's blocks without the causal mask, so every strategy the rules give the decoder (DP,
FSDP, TP) applies to ViT too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from microbench.meshes.parallelism import constrain
from microbench.models import pipeline
from microbench.models.layers import (ACT_BTD, BlockConfig, BlockStack, Execution, Norm, Stats, cross_entropy,
                                      param, project, weight)


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  block: BlockConfig
  num_layers: int
  image_size: int
  patch: int
  num_classes: int = 1000
  channels: int = 3

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch) ** 2

  @property
  def seq_len(self) -> int:
    return self.num_patches + 1  # + class token


def _vit(d: int, layers: int, heads: int, ff: int, image: int, patch: int, classes: int) -> ViTConfig:
  block = BlockConfig(d_model=d, num_heads=heads, num_kv_heads=heads, d_ff=ff, causal=False, norm_eps=1e-6)
  return ViTConfig(block, layers, image, patch, classes)


SIZES: dict[str, ViTConfig] = {
    "tiny": _vit(64, 2, 4, 128, image=32, patch=8, classes=10),
    "h14": _vit(1280, 32, 16, 5120, image=224, patch=14, classes=1000),
}


class ViT(nnx.Module):
  """images [B, H, W, C] -> class logits [B, classes]."""

  def __init__(self, cfg: ViTConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, execution: Execution = Execution()):
    d = cfg.block.d_model
    self.cfg, self.dtype = cfg, dtype
    self.patch_embed = param(rngs, (cfg.patch * cfg.patch * cfg.channels, d), ("patch", "embed"))
    self.patch_bias = param(rngs, (d,), ("embed",), jax.nn.initializers.zeros)
    self.cls = param(rngs, (1, 1, d), (None, None, "embed"), jax.nn.initializers.zeros)
    self.pos = param(rngs, (cfg.seq_len, d), ("pos", "embed"))
    self.blocks = BlockStack(cfg.block, cfg.num_layers, rngs, execution)
    self.norm = Norm(d, "layernorm", cfg.block.norm_eps, rngs)
    self.head = param(rngs, (d, cfg.num_classes), ("embed", "classes"), jax.nn.initializers.zeros)
    self.head_bias = param(rngs, (cfg.num_classes,), ("classes",), jax.nn.initializers.zeros)

  def _embed(self, images_BHWC: jax.Array) -> jax.Array:
    cfg, dt = self.cfg, self.dtype
    b, p, g = images_BHWC.shape[0], cfg.patch, cfg.image_size // cfg.patch
    x = images_BHWC.astype(dt).reshape(b, g, p, g, p, cfg.channels).transpose(0, 1, 3, 2, 4, 5)
    patches_BNP = x.reshape(b, g * g, p * p * cfg.channels)
    x_BND = project(patches_BNP, weight(self.patch_embed, dt)) + weight(self.patch_bias, dt)
    cls = jnp.broadcast_to(weight(self.cls, dt), (b, 1, x_BND.shape[-1]))
    x_BTD = jnp.concatenate([cls, x_BND], axis=1) + weight(self.pos, dt)
    return constrain(x_BTD, ACT_BTD)

  def __call__(self, images_BHWC: jax.Array) -> jax.Array:
    dt = self.dtype
    x_BD = self.norm(self.blocks(self._embed(images_BHWC)))[:, 0]
    return x_BD @ weight(self.head, dt) + weight(self.head_bias, dt)

  def loss(self, images_BHWC: jax.Array, labels_B: jax.Array) -> tuple[jax.Array, Stats]:
    """(mean cross-entropy, {}), through the pipeline when the mesh has stages (patch embedding before it,
    the final norm, class head and loss on its last stage)."""
    if pipeline.stages() == 1:
      return cross_entropy(self(images_BHWC), labels_B), {}
    dt = self.dtype
    norm_def, norm_state = nnx.split(self.norm)
    head_params = {"norm": pipeline.values(norm_state), "w": self.head[...], "b": self.head_bias[...]}

    def head_fn(hp, y_bTD, labels_b):
      x_bD = nnx.merge(norm_def, hp["norm"])(y_bTD)[:, 0]
      return cross_entropy(x_bD @ hp["w"].astype(dt) + hp["b"].astype(dt), labels_b)

    return pipeline.stack_loss(self.blocks, self._embed(images_BHWC), labels_B, head_fn, head_params)
