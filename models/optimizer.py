"""The optimizer: optax AdamW with a constant learning rate (the benchmark's PyTorch twin uses the same)."""

from __future__ import annotations

import dataclasses

import optax


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
  learning_rate: float = 3e-4
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1


def adamw(cfg: AdamWConfig = AdamWConfig()) -> optax.GradientTransformation:
  """Decoupled weight decay on every parameter, like torch.optim.AdamW given all parameters."""
  return optax.adamw(cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
