"""ResNet-50 (bottleneck v1.5, stride on the 3x3 conv) and a tiny one, for data-parallel vision runs.

BatchNorm uses batch statistics in training; under data parallelism the batch mean spans the global
batch (XLA inserts the all-reduce), i.e. synchronised BatchNorm, so sharded runs match one device.
Conv kernels name their output channels `conv_out`, which FSDP shards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from microbench.meshes.parallelism import constrain


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  stage_blocks: tuple[int, ...]
  width: int  # channels of the first stage's bottleneck
  image_size: int
  num_classes: int = 1000
  channels: int = 3


SIZES: dict[str, ResNetConfig] = {
    "tiny": ResNetConfig((1, 1), width=8, image_size=32, num_classes=10),
    "50": ResNetConfig((3, 4, 6, 3), width=64, image_size=224),
}

_CONV_NAMES = ("conv_h", "conv_w", "conv_in", "conv_out")


def _conv(cin: int, cout: int, k: int, stride: int, dtype, rngs: nnx.Rngs) -> nnx.Conv:
  init = nnx.with_partitioning(jax.nn.initializers.he_normal(), _CONV_NAMES)
  return nnx.Conv(cin, cout, (k, k), (stride, stride), padding="SAME", use_bias=False, dtype=dtype,
                  kernel_init=init, rngs=rngs)


def _bn(c: int, dtype, rngs: nnx.Rngs, zero: bool = False) -> nnx.BatchNorm:
  scale = jax.nn.initializers.zeros if zero else jax.nn.initializers.ones
  return nnx.BatchNorm(c, use_running_average=False, momentum=0.9, dtype=dtype, rngs=rngs,
                       scale_init=nnx.with_partitioning(scale, ("norm",)),
                       bias_init=nnx.with_partitioning(jax.nn.initializers.zeros, ("norm",)))


class Bottleneck(nnx.Module):
  def __init__(self, cin: int, width: int, stride: int, dtype, rngs: nnx.Rngs):
    cout = 4 * width
    self.conv1, self.bn1 = _conv(cin, width, 1, 1, dtype, rngs), _bn(width, dtype, rngs)
    self.conv2, self.bn2 = _conv(width, width, 3, stride, dtype, rngs), _bn(width, dtype, rngs)
    self.conv3, self.bn3 = _conv(width, cout, 1, 1, dtype, rngs), _bn(cout, dtype, rngs, zero=True)
    project = stride != 1 or cin != cout
    self.proj = _conv(cin, cout, 1, stride, dtype, rngs) if project else None
    self.proj_bn = _bn(cout, dtype, rngs) if project else None

  def __call__(self, x: jax.Array) -> jax.Array:
    y = jax.nn.relu(self.bn1(self.conv1(x)))
    y = jax.nn.relu(self.bn2(self.conv2(y)))
    y = self.bn3(self.conv3(y))
    skip = x if self.proj is None else self.proj_bn(self.proj(x))
    return jax.nn.relu(y + skip)


class ResNet(nnx.Module):
  """images [B, H, W, C] -> class logits [B, classes]."""

  def __init__(self, cfg: ResNetConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
    self.cfg, self.dtype = cfg, dtype
    self.stem = _conv(cfg.channels, cfg.width, 7, 2, dtype, rngs)
    self.stem_bn = _bn(cfg.width, dtype, rngs)
    blocks, cin = [], cfg.width
    for i, n in enumerate(cfg.stage_blocks):
      width = cfg.width * 2 ** i
      for j in range(n):
        blocks.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1, dtype, rngs))
        cin = 4 * width
    self.blocks = nnx.List(blocks)
    self.head = nnx.Linear(cin, cfg.num_classes, dtype=dtype, rngs=rngs,
                           kernel_init=nnx.with_partitioning(jax.nn.initializers.zeros, ("embed", "classes")),
                           bias_init=nnx.with_partitioning(jax.nn.initializers.zeros, ("classes",)))

  def __call__(self, images_BHWC: jax.Array) -> jax.Array:
    x = constrain(images_BHWC.astype(self.dtype), ("batch", None, None, None))
    x = jax.nn.relu(self.stem_bn(self.stem(x)))
    x = nnx.max_pool(x, (3, 3), (2, 2), padding="SAME")
    for block in self.blocks:
      x = block(x)
    return self.head(x.mean(axis=(1, 2)))
