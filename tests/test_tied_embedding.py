"""GPT-2's tied embedding against an independent reference: the table's gradient is the lookup's gradient
(scattered to the tokens' rows) plus the LM head's (logits = h @ E^T), the head's part computed token by
token in float64 NumPy from the final hidden states, never through the model's head.

Why: the equivalence tests compare the model with itself on 1 and N devices, so a head that stops training
the table (its gradient dropped) passed every GPT-2 gradient test. Each head path is checked: one device
(`project`), batch-sharded (the per-shard table copy's einsum) and the pipeline's last stage; and the
planted bug (a stop-gradient on the head's use of the table, `transformer.tied_head`) must fail each.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from _trainers import leaf, make_trainer, reference_state, sgd_run  # noqa: E402
from microbench.models import transformer  # noqa: E402
from microbench.models.layers import Execution  # noqa: E402
from microbench.models.optimizer import sgd  # noqa: E402

RTOL = 1e-5  # relative to the table gradient's largest entry (measured: docs/measured-figures.md)
STRATEGIES = {
    "dp:1": None,  # head: project(h, E^T)
    "dp:2": None,  # head: einsum over the per-batch-shard copy of the table
    "pp:2": Execution(microbatches=2, schedule="gpipe"),  # head on the last stage, per microbatch
}


@functools.cache
def reference() -> tuple[float, np.ndarray, np.ndarray]:
  """(mean cross-entropy, d loss / d table, the head's part of it), float64, from the shared seeded start.

  The model runs only its trunk (positions, blocks, final norm) and that trunk's backward; the head, the
  loss, the head's table gradient and the lookup's scatter are per-token NumPy here."""
  t = make_trainer("gpt2", "dp:1", tx=sgd(0.0))
  params_h, rest_h, batches_h = reference_state("gpt2")
  tokens_BT, targets_BT = batches_h[0]["inputs"], batches_h[0]["targets"]
  table_VD = np.asarray(params_h["embed"][...], np.float32)

  def trunk(x0_BTD):
    m = nnx.merge(t.graphdef, jax.tree.map(jnp.asarray, params_h), jax.tree.map(jnp.asarray, rest_h))
    x_BTD, _, _ = m.blocks.run(m._positioned(x0_BTD))  # pylint: disable=protected-access
    return m.norm(x_BTD)

  with t.context():
    h_BTD, trunk_vjp = jax.vjp(jax.jit(trunk), jnp.asarray(table_VD[tokens_BT]))
  h_ND = np.asarray(h_BTD, np.float64).reshape(-1, table_VD.shape[1])
  e_VD = table_VD.astype(np.float64)
  n = h_ND.shape[0]
  loss, head_VD, dh_ND = 0.0, np.zeros_like(e_VD), np.zeros_like(h_ND)
  for i, target in enumerate(targets_BT.reshape(-1)):
    logits_V = e_VD @ h_ND[i]
    top = logits_V.max()
    lse = top + np.log(np.sum(np.exp(logits_V - top)))
    loss += (lse - logits_V[target]) / n
    dlogits_V = np.exp(logits_V - lse)
    dlogits_V[target] -= 1.0
    dlogits_V /= n
    head_VD += np.outer(dlogits_V, h_ND[i])  # d logits_V / d E[v] = h: the head's use of the table
    dh_ND[i] = dlogits_V @ e_VD
  (dx0_BTD,) = trunk_vjp(jnp.asarray(dh_ND.reshape(h_BTD.shape), jnp.float32))
  lookup_VD = np.zeros_like(e_VD)
  for token, g_D in zip(tokens_BT.reshape(-1), np.asarray(dx0_BTD, np.float64).reshape(n, -1)):
    lookup_VD[token] += g_D  # the lookup's use: each token's row gets its input gradient
  return loss, lookup_VD + head_VD, head_VD


def _model_table_grad(strategy: str) -> tuple[float, np.ndarray]:
  """(loss, d loss / d table) of the model's own gradient function under `strategy`."""
  ex = STRATEGIES[strategy]
  losses, grads = sgd_run(make_trainer("gpt2", strategy, tx=sgd(0.0), **({"execution": ex} if ex else {})),
                          "gpt2", steps=1)
  return losses[0], leaf(grads, "embed")


def table_mismatch(strategy: str) -> float:
  """Largest |model - reference| entry of the table gradient over the reference's largest entry."""
  loss, got_VD = _model_table_grad(strategy)
  want_loss, want_VD, _ = reference()
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  return float(np.max(np.abs(got_VD - want_VD)) / np.max(np.abs(want_VD)))


def test_the_head_carries_much_of_the_table_gradient():
  """The reference's premise: neither use is negligible, so losing either shows (the head's part alone is
  a sizeable share of the whole)."""
  _, whole_VD, head_VD = reference()
  assert np.max(np.abs(head_VD)) > 0.1 * np.max(np.abs(whole_VD))
  assert np.max(np.abs(whole_VD - head_VD)) > 0.1 * np.max(np.abs(whole_VD))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_table_gradient_is_lookup_plus_head(strategy):
  assert table_mismatch(strategy) <= RTOL


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_planted_dropped_head_gradient_fails_the_reference(strategy, monkeypatch):
  monkeypatch.setattr(transformer, "tied_head", jax.lax.stop_gradient)
  mismatch = table_mismatch(strategy)
  print(f"tied head's gradient dropped ({strategy}): table gradient mismatch {mismatch:.3g}")
  assert mismatch > RTOL
