"""Model families by name: how to build one, feed it, score it and count its FLOPs.

The trainer only talks to `ModelSpec`; adding a model is one entry in `FAMILIES` and one builder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from microbench.models import data, flops, mixtral, moe, resnet, transformer, vit
from microbench.models.layers import Execution, cross_entropy


class ModelError(ValueError):
  """Unknown model or size, or a shape override the model can't take; one line saying what is allowed."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  family: str
  size: str
  config: Any
  kind: str  # "lm" or "image"
  seq_len: int  # tokens per example (LM) or patches+1 (ViT); 0 for ResNet
  build: Callable[..., nnx.Module]  # (config, dtype=, rngs=[, execution=]) -> model
  flops_formula: str

  @property
  def item_name(self) -> str:
    return "tokens" if self.kind == "lm" else "images"

  @property
  def has_blocks(self) -> bool:
    """Transformer blocks (stacked, scanned, rematerialised); ResNet has none."""
    return self.family != "resnet"

  def make(self, dtype: jnp.dtype, seed: int, execution: Execution | None = None) -> nnx.Module:
    kw = {"execution": execution} if (execution is not None and self.has_blocks) else {}
    return self.build(self.config, dtype=dtype, rngs=nnx.Rngs(seed), **kw)

  def items_per_step(self, batch: int) -> int:
    return batch * self.seq_len if self.kind == "lm" else batch

  def batch_spec(self) -> dict[str, tuple[str | None, ...]]:
    """Logical names of each batch array's dimensions."""
    if self.kind == "lm":
      return {"inputs": ("batch", None), "targets": ("batch", None)}
    return {"images": ("batch", None, None, None), "labels": ("batch",)}

  def make_batch(self, key: jax.Array, batch: int) -> dict[str, jax.Array]:
    c = self.config
    if self.kind == "lm":
      return data.lm_batch(key, batch, self.seq_len, c.vocab_size)
    return data.image_batch(key, batch, c.image_size, c.channels, c.num_classes)

  def loss(self, model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(objective, stats): mean cross-entropy in float32 whatever the compute dtype, plus a mixture of
    experts' auxiliary losses (its router statistics as stats); pipelined when the mesh has stages."""
    if self.kind == "lm":
      return model.loss(batch["inputs"], batch["targets"])
    if self.has_blocks:
      return model.loss(batch["images"], batch["labels"])
    return cross_entropy(model(batch["images"]), batch["labels"]), {}

  def step_flops(self, batch: int, causal_half: bool = True) -> float:
    """Model FLOPs per step (the MFU numerator); causal attention counted half unless `causal_half=False`."""
    if self.family in transformer.SIZES:
      return flops.decoder_step_flops(self.config, batch, self.seq_len, causal_half)
    if self.family == "vit":
      return flops.vit_step_flops(self.config, batch)
    if self.family == "mixtral":
      return flops.moe_step_flops(self.config, batch, self.seq_len, causal_half)
    return flops.resnet_step_flops(self.config, batch)

  def tp_dims(self) -> dict[str, int]:
    """Dimensions tensor parallelism splits, for a clear error before anything is built."""
    if self.family == "resnet":
      return {}
    b = self.config.block
    dims = {"attention heads": b.num_heads, "kv heads": b.num_kv_heads, "mlp dim": b.d_ff}
    if self.kind == "lm":
      dims["vocab"] = self.config.vocab_size
    return dims


FAMILIES = {
    "gpt2": tuple(transformer.SIZES["gpt2"]),
    "llama3": tuple(transformer.SIZES["llama3"]),
    "vit": tuple(vit.SIZES),
    "resnet": tuple(resnet.SIZES),
    "mixtral": tuple(mixtral.SIZES),
    "minerva": tuple(transformer.SIZES["minerva"]),
}
DEFAULT_SIZE = {"gpt2": "124m", "llama3": "8b", "minerva": "7b", "vit": "h14", "resnet": "50", "mixtral": "8x7b"}


def get_model(family: str, size: str | None = None, layers: int | None = None,
              seq_len: int | None = None, capacity_factor: float | None = None,
              moe_dispatch: str | None = None) -> ModelSpec:
  """The model `family` at `size` (default per family), optionally with fewer/more layers, another
  sequence length or (MoE) another expert capacity factor or token exchange."""
  if family not in FAMILIES:
    raise ModelError(f"unknown model {family!r}; choose one of {', '.join(FAMILIES)}")
  size = (size or DEFAULT_SIZE[family]).lower()
  if size not in FAMILIES[family]:
    raise ModelError(f"unknown size {size!r} for {family}; choose one of {', '.join(FAMILIES[family])}")
  if layers is not None and layers < 1:
    raise ModelError(f"--layers must be >= 1, got {layers}")
  for flag, value in (("capacity_factor", capacity_factor), ("moe_dispatch", moe_dispatch)):
    if value is not None and family != "mixtral":
      raise ModelError(f"--{flag} applies to mixtral (a mixture of experts); {family} has no experts")
  if moe_dispatch is not None and moe_dispatch not in moe.DISPATCHES:
    raise ModelError(f"unknown --moe_dispatch={moe_dispatch!r}; choose one of {', '.join(moe.DISPATCHES)}")
  if family in transformer.SIZES:
    cfg = transformer.SIZES[family][size]
    if layers:
      cfg = dataclasses.replace(cfg, num_layers=layers)
    t = seq_len or cfg.max_seq_len
    if t < 1:
      raise ModelError(f"--seq_len must be >= 1, got {t}")
    if cfg.learned_positions and t > cfg.max_seq_len:
      raise ModelError(f"--seq_len={t} exceeds {family}-{size}'s {cfg.max_seq_len} learned positions")
    return ModelSpec(family, size, cfg, "lm", t, transformer.Transformer, flops.DECODER_FORMULA)
  if family == "mixtral":
    cfg = mixtral.SIZES[size]
    if layers:
      cfg = dataclasses.replace(cfg, num_layers=layers)
    if capacity_factor is not None:
      cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=capacity_factor))
    if moe_dispatch is not None:
      cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch=moe_dispatch))
    t = seq_len or cfg.max_seq_len
    if t < 1:
      raise ModelError(f"--seq_len must be >= 1, got {t}")
    return ModelSpec(family, size, cfg, "lm", t, mixtral.Mixtral, flops.MOE_FORMULA)
  if family == "vit":
    cfg = vit.SIZES[size]
    if layers:
      cfg = dataclasses.replace(cfg, num_layers=layers)
    return ModelSpec(family, size, cfg, "image", cfg.seq_len, vit.ViT, flops.VIT_FORMULA)
  if layers:
    raise ModelError("--layers applies to gpt2, llama3, vit and mixtral; resnet has a fixed depth per size")
  return ModelSpec(family, size, resnet.SIZES[size], "image", 0, resnet.ResNet, flops.RESNET_FORMULA)
