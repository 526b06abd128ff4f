"""The MoE layer against an independent token-by-token float64 reference (tests/_moe_reference.py): outputs,
which assignments were dropped, the load-balancing and z-losses, and the gradients of the router, the
experts and the input, value by value. Then the planted bugs that the 1-vs-N-device equivalence tests
cannot see (they compare the layer with itself): top-k weights not renormalised, combine weights applied
twice; each must fail here.

Inputs are distinct random values per token (no repeats, so a swapped token or expert changes the numbers)
and the router prefers one expert, so capacity drops first and second choices in the capacity cases.
"""

from __future__ import annotations

import contextlib
import functools
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import _moe_reference as ref  # noqa: E402
from microbench.meshes import parallelism as par  # noqa: E402
from microbench.models import moe  # noqa: E402

B, T, D, F, E = 2, 16, 8, 16, 4
RTOL = 1e-5  # float32 layer vs float64 reference, relative to each tensor's largest value (measured: <= 2e-7)
GRAD_RTOL = 1e-5  # gradients (measured: at most 4e-7 here)
COEFS = dict(aux_loss_coef=0.1, z_loss_coef=0.01)  # larger than the defaults, so the aux gradients weigh in

CASES = {
    # name: (MoeConfig fields, routing groups)
    "top2-capacity": (dict(top_k=2, capacity_factor=1.0), 1),
    "top2-dropless": (dict(top_k=2, capacity_factor=0.0), 1),
    "top1-capacity": (dict(top_k=1, capacity_factor=1.25), 1),
    "top2-ragged": (dict(top_k=2, capacity_factor=0.75, dispatch="ragged_all_to_all"), 1),
    "top2-capacity-2-groups": (dict(top_k=2, capacity_factor=1.0), 2),  # data:2, C per group, aux over both
}


def _inputs() -> dict[str, np.ndarray]:
  """float32 values, float64-exact, distinct per token and expert; expert 0 favoured, so capacity drops."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B * T, D))
  x[:, 0] += 1.0
  router = rng.normal(size=(D, E)) / np.sqrt(D)
  router[0, 0] += 3.0
  values = {"x": x, "router": router, "w_up": rng.normal(size=(E, D, F)) / np.sqrt(D),
            "w_gate": rng.normal(size=(E, D, F)) / np.sqrt(D), "w_down": rng.normal(size=(E, F, D)) / np.sqrt(F),
            "cotangent": rng.normal(size=(B * T, D))}
  return {k: v.astype(np.float32) for k, v in values.items()}


def _cfg(name: str) -> moe.MoeConfig:
  return moe.MoeConfig(num_experts=E, **CASES[name][0], **COEFS)


def _routing(name: str, v: dict[str, np.ndarray]) -> ref.Routing:
  cfg, groups = _cfg(name), CASES[name][1]
  return ref.route(v["x"], v["router"], top_k=cfg.top_k, capacity_factor=cfg.capacity_factor, groups=groups,
                   dispatch=cfg.dispatch if cfg.dispatch != "auto" else "all_to_all")


def _mesh(groups: int) -> jax.sharding.Mesh:
  sizes = {a: (groups if a == "data" else 1) for a in par.MESH_AXES}
  grid = np.array(jax.devices()[:groups], dtype=object).reshape(tuple(sizes.values()))
  return jax.sharding.Mesh(grid, par.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def _where(name: str):
  """The context the layer runs in: one routing group per batch shard of a `data` mesh (one group: none)."""
  groups = CASES[name][1]
  if groups == 1:
    return contextlib.nullcontext()
  stack = contextlib.ExitStack()
  stack.enter_context(jax.set_mesh(_mesh(groups)))
  stack.enter_context(nnx.logical_axis_rules(par.RULES))
  return stack


def _layer(name: str, x_ND, router_DE, w_up, w_gate, w_down):
  """(y [N, D], aux, stats) of `moe.moe_ffn` (run inside `_where(name)`)."""
  y_BTD, aux, stats = moe.moe_ffn(x_ND.reshape(B, T, D), router_DE, w_up, w_gate, w_down, _cfg(name))
  return y_BTD.reshape(B * T, D), aux, stats


PARAMS = ("x", "router", "w_up", "w_gate", "w_down")


def _kept_by_layer(name: str, v: dict[str, np.ndarray], monkeypatch) -> np.ndarray:
  """[N, k] which assignments the layer's dispatch kept: its own `keep` (run eagerly, one group)."""
  seen = []
  for fn_name in ("_padded", "_ragged"):
    good = getattr(moe, fn_name)

    def spy(*a, good=good, **kw):
      y, keep = good(*a, **kw)
      seen.append(np.asarray(keep))
      return y, keep
    monkeypatch.setattr(moe, fn_name, spy)
  _layer(name, *(v[k] for k in PARAMS))  # eagerly: `keep` holds values
  assert len(seen) == 1
  return seen[0].T


def _mismatch(got, want) -> float:
  """Largest |got - want| over the reference's largest magnitude (the tolerance's scale)."""
  want = np.asarray(want, np.float64)
  return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1e-30))


def value_mismatches(name: str) -> dict[str, float]:
  """The layer's outputs and losses against the reference, each as `_mismatch`."""
  v = _inputs()
  r = _routing(name, v)
  assert r.margin > 1e-3  # float32 logits rank the experts as float64 ones do
  y_ref, aux_ref, lb_ref, z_ref = ref.outputs(np, *(v[k].astype(np.float64) for k in PARAMS), r, **COEFS)
  with _where(name):
    y, aux, stats = jax.jit(lambda *p: _layer(name, *p))(*(v[k] for k in PARAMS))
  assert float(stats["moe_dropped"]) == (~r.keep_Nk).sum() and float(stats["moe_assignments"]) == r.keep_Nk.size
  return {"y": _mismatch(y, y_ref), "aux": _mismatch(aux, aux_ref), "load_balance": _mismatch(
      stats["moe_load_balance"], lb_ref), "z_loss": _mismatch(stats["moe_z_loss"], z_ref)}


def grad_mismatches(name: str) -> dict[str, float]:
  """d(sum(y * cotangent) + aux) by the input, router and expert weights: the layer's float32 `jax.grad`
  against `jax.grad` of the reference in float64 (routing held at the reference's choices)."""
  v = _inputs()
  cot = v["cotangent"]

  def layer_loss(*params):
    y, aux, _ = _layer(name, *params)
    return jnp.sum(y * cot) + aux
  with _where(name):
    got = jax.jit(jax.grad(layer_loss, argnums=range(5)))(*(v[k] for k in PARAMS))

  want = _reference_grads(name)
  assert all(w.dtype == np.float64 for w in want)
  return {k: _mismatch(g, w) for k, g, w in zip(PARAMS, got, want)}


@functools.lru_cache(maxsize=None)
def _reference_grads(name: str) -> tuple[np.ndarray, ...]:
  """`jax.grad` of the float64 reference for a case: it depends on the case's inputs and routing only (not on the
  layer, which planted bugs change), so computed once per case and shared by the tests (read-only)."""
  v = _inputs()
  r = _routing(name, v)
  cot = v["cotangent"]
  with jax.enable_x64(True):
    def ref_loss(*params):
      y, aux, _, _ = ref.outputs(jnp, *params, r, **COEFS)
      return jnp.sum(y * cot.astype(np.float64)) + aux
    want = jax.grad(ref_loss, argnums=range(5))(*(jnp.asarray(v[k], jnp.float64) for k in PARAMS))
  want = tuple(np.asarray(w) for w in want)
  for w in want:
    w.flags.writeable = False
  return want


def _assert_within(mismatches: dict[str, float], tol: float) -> None:
  bad = {k: m for k, m in mismatches.items() if not m <= tol}
  assert not bad, f"layer differs from the reference (max error / max value; tolerance {tol:g}): {bad}"


# ---------------------------------------------------------------------------------------------------------
# The layer matches the reference.


def test_reference_inputs_drop_first_and_second_choices():
  """The capacity cases really drop: first choices (token order decides which) and second choices, and
  keep some of each; the dropless case keeps everything."""
  v = _inputs()
  keep = _routing("top2-capacity", v).keep_Nk
  assert (~keep[:, 0]).any() and (~keep[:, 1]).any() and keep[:, 0].any() and keep[:, 1].any()
  assert (~_routing("top2-capacity-2-groups", v).keep_Nk).any() and (~_routing("top2-ragged", v).keep_Nk).any()
  assert (~_routing("top1-capacity", v).keep_Nk).any() and _routing("top2-dropless", v).keep_Nk.all()
  assert len(np.unique(v["x"])) == v["x"].size  # no repeated value anywhere


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][1] == 1])
def test_layer_drops_the_assignments_the_reference_drops(name, monkeypatch):
  v = _inputs()
  np.testing.assert_array_equal(_kept_by_layer(name, v, monkeypatch), _routing(name, v).keep_Nk)


@pytest.mark.parametrize("name", list(CASES))
def test_layer_outputs_and_losses_match_the_reference(name):
  _assert_within(value_mismatches(name), RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["top2-capacity", "top1-capacity", "top2-capacity-2-groups"])
def test_layer_gradients_match_the_reference(name):
  _assert_within(grad_mismatches(name), GRAD_RTOL)


# ---------------------------------------------------------------------------------------------------------
# Planted bugs that pass the equivalence tests: each must fail the reference.


def _not_renormalised(logits_GE, k):
  """Top-k weights left as the full softmax's probabilities (they sum to less than 1)."""
  _, top_i_Gk = jax.lax.top_k(logits_GE, k)
  return jnp.take_along_axis(jax.nn.softmax(logits_GE, axis=-1), top_i_Gk, axis=-1), top_i_Gk


def _weights_twice(y_kGD, weights_Gk, keep_kG):
  """Combine weights applied to the expert outputs and then again in the combine."""
  return GOOD_COMBINE(y_kGD * weights_Gk.T[..., None], weights_Gk, keep_kG)


GOOD_COMBINE = moe.combine
PLANTS = {
    "top-k weights not renormalised": ("top_k_weights", _not_renormalised),
    "combine weights applied twice": ("combine", _weights_twice),
}


# (With one choice the renormalised weight is 1, so applying it twice is no bug there.)
PLANTED = [("top-k weights not renormalised", "top2-capacity"), ("top-k weights not renormalised", "top1-capacity"),
           ("combine weights applied twice", "top2-capacity"), ("combine weights applied twice", "top2-dropless")]


@pytest.mark.slow
@pytest.mark.parametrize("plant,name", PLANTED)
def test_planted_bugs_fail_the_reference(plant, name, monkeypatch):
  monkeypatch.setattr(moe, *PLANTS[plant])
  values = value_mismatches(name)
  grads = grad_mismatches(name)
  print(f"{plant} ({name}): values {values}; gradients {grads}")
  with pytest.raises(AssertionError):
    _assert_within(values, RTOL)
  with pytest.raises(AssertionError):
    _assert_within(grads, GRAD_RTOL)
