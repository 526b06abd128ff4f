"""Optimizers: optax AdamW with a constant learning rate and global-norm clipping (the benchmark's PyTorch
twin uses the same), and plain SGD for equivalence tests (an SGD update is proportional to the gradient, so
a gradient scaled by a wrong factor shows in the losses; Adam's normalised update hides it)."""

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
  clip_norm: float = 1.0  # global gradient-norm clipping (MaxText and Megatron-LM default); 0: off


def clipped(tx: optax.GradientTransformation, clip_norm: float) -> optax.GradientTransformation:
  """`tx` after scaling the gradients down to a global norm of at most `clip_norm` (0: unchanged)."""
  return optax.chain(optax.clip_by_global_norm(clip_norm), tx) if clip_norm > 0 else tx


def adamw(cfg: AdamWConfig = AdamWConfig()) -> optax.GradientTransformation:
  """Decoupled weight decay on every parameter, like torch.optim.AdamW given all parameters."""
  tx = optax.adamw(cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
  return clipped(tx, cfg.clip_norm)


def sgd(learning_rate: float, clip_norm: float = 0.0) -> optax.GradientTransformation:
  """Plain SGD (no momentum): the update is `-learning_rate * gradient`."""
  return clipped(optax.sgd(learning_rate), clip_norm)
