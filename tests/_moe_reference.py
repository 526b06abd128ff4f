"""An independent reference for the mixture-of-experts layer (`models/moe.py`), token by token in float64.

Why: the equivalence tests compare the layer with itself on 1 and N devices, so a mistake in its own
arithmetic passes them. Nothing here calls the layer's code; it is the layer's documented semantics,
written as loops over tokens:

- routing: logits = x_t @ router, probabilities = softmax(logits); the k experts with the largest logits
  (ties to the lower index, as `lax.top_k`), first choice first; combine weights = their probabilities
  renormalised over the k (Mixtral; always, the config has no switch).
- groups: tokens are routed per batch shard (GShard); each group of G tokens, in (batch, position) order.
- capacity (padded dispatch): C = ceil(cf * G * k / E) slots per expert per group (G when cf <= 0). Slots go
  first to every token's first choice in token order, then to every second choice, and so on
  (Switch/GShard priority); an assignment finding its expert full is dropped.
- capacity (ragged dispatch, one device): R = ceil(cf * k * G) rows (k * G when cf <= 0); the assignments
  sorted by expert (in the priority order above within an expert) and the first R kept.
- expert e: SwiGLU, (silu(x W_gate[e]) * (x W_up[e])) W_down[e].
- combine: y_t = sum over t's kept choices of weight * expert(x_t); a dropped choice adds nothing.
- load balancing (Switch's E * sum_e f_e P_e, generalised to k choices): f_e = assignments routed to e,
  kept or dropped, over N * k (so f sums to 1 and the loss is 1 when routing is uniform; Hugging Face's
  Mixtral loss divides by N only, k times this), P_e = mean probability of e over all N tokens of the
  batch (not per group). f is a count: it carries no gradient.
- router z-loss (ST-MoE): mean over the N tokens of logsumexp(logits)^2.
- aux = aux_loss_coef * load balance + z_loss_coef * z-loss.

Routing decisions are discrete: `route` makes them once in NumPy; `outputs` is written against an array
module `xp` so the same per-token code gives values in NumPy and, under `jax.enable_x64`, a float64
reference gradient with `jax.grad` (the routing held fixed, as it is in the layer's gradient).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Routing:
  experts_Nk: np.ndarray  # int, each token's choices, first choice first
  keep_Nk: np.ndarray  # bool, the assignment got a slot
  margin: float  # smallest logit gap that decides a choice or its rank (float32 rounding must not flip it)


def _softmax(xp, v):
  e = xp.exp(v - xp.max(v))
  return e / xp.sum(e)


def route(x_ND: np.ndarray, router_DE: np.ndarray, *, top_k: int, capacity_factor: float, groups: int,
          dispatch: str = "all_to_all") -> Routing:
  """Choices and drops of the N tokens, split into `groups` equal consecutive groups."""
  n, e = x_ND.shape[0], router_DE.shape[1]
  assert n % groups == 0
  g = n // groups
  experts_Nk = np.zeros((n, top_k), np.int64)
  margin = np.inf
  for t in range(n):
    logits_E = x_ND[t].astype(np.float64) @ router_DE.astype(np.float64)
    order = sorted(range(e), key=lambda i: (-logits_E[i], i))
    experts_Nk[t] = order[:top_k]
    ranked = logits_E[order[:min(top_k + 1, e)]]
    margin = min(margin, float(np.min(-np.diff(ranked)))) if len(ranked) > 1 else margin
  keep_Nk = np.zeros((n, top_k), bool)
  for first in range(0, n, g):
    # Priority order: (choice, token) -- every first choice of the group before any second choice.
    assignments = [(j, t) for j in range(top_k) for t in range(first, first + g)]
    if dispatch == "all_to_all":
      slots = g if capacity_factor <= 0 else max(1, math.ceil(capacity_factor * g * top_k / e))
      used = [0] * e
      for j, t in assignments:
        ex = experts_Nk[t, j]
        keep_Nk[t, j] = used[ex] < slots
        used[ex] += 1
    elif dispatch == "ragged_all_to_all":
      assert groups == 1, "the reference's ragged rule is the one-device one"
      rows = g * top_k if capacity_factor <= 0 else max(1, math.ceil(capacity_factor * g * top_k))
      by_expert = sorted(assignments, key=lambda a: experts_Nk[a[1], a[0]])  # stable: priority within expert
      for j, t in by_expert[:rows]:
        keep_Nk[t, j] = True
    else:
      raise ValueError(dispatch)
  return Routing(experts_Nk, keep_Nk, margin)


def outputs(xp: Any, x_ND, router_DE, w_up_EDF, w_gate_EDF, w_down_EFD, routing: Routing, *,
            aux_loss_coef: float, z_loss_coef: float) -> tuple[Any, Any, Any, Any]:
  """(y [N, D], aux, load balance, z-loss), token by token; `xp` is numpy or jax.numpy."""
  n, e = x_ND.shape[0], router_DE.shape[1]
  k = routing.experts_Nk.shape[1]
  rows, prob_sum_E, z_sum = [], xp.zeros((e,), x_ND.dtype), 0.0
  for t in range(n):
    logits_E = x_ND[t] @ router_DE
    probs_E = _softmax(xp, logits_E)
    prob_sum_E = prob_sum_E + probs_E
    z_sum = z_sum + (xp.max(logits_E) + xp.log(xp.sum(xp.exp(logits_E - xp.max(logits_E))))) ** 2
    chosen = [int(c) for c in routing.experts_Nk[t]]
    mass = sum(probs_E[c] for c in chosen)
    y_D = xp.zeros_like(x_ND[t])
    for j, c in enumerate(chosen):
      if routing.keep_Nk[t, j]:
        h_F = x_ND[t] @ w_up_EDF[c]
        gate_F = x_ND[t] @ w_gate_EDF[c]
        silu_F = gate_F / (1.0 + xp.exp(-gate_F))
        y_D = y_D + (probs_E[c] / mass) * ((silu_F * h_F) @ w_down_EFD[c])
    rows.append(y_D)
  counts_E = np.bincount(routing.experts_Nk.reshape(-1), minlength=e).astype(np.float64)
  share_E = counts_E / (n * k)
  load_balance = e * xp.sum(share_E * (prob_sum_E / n))
  z_loss = z_sum / n
  aux = aux_loss_coef * load_balance + z_loss_coef * z_loss
  return xp.stack(rows), aux, load_balance, z_loss
