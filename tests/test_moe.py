"""Mixture of experts: routing and capacity, gradients under expert parallelism (alone and with dp, fsdp,
tp) equal to the same model on one device, with planted bugs; the trainer running it. (The 8x7B
parameter count is in test_models.py.)"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from microbench.meshes import parallelism as par  # noqa: E402
from microbench.train import comm_fingerprint  # noqa: E402
from microbench.models import mixtral, moe  # noqa: E402
from microbench.models.train_step import state_shardings  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}
BATCH, SEQ = 8, 8
# No capacity drops: routing is then the same however the batch is split, so sharded and one-device runs compare.
CFG = dataclasses.replace(mixtral.SIZES["tiny"],
                          moe=dataclasses.replace(mixtral.SIZES["tiny"].moe, capacity_factor=0.0))


def _mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
  sizes = {a: axes.get(a, 1) for a in par.MESH_AXES}
  n = int(np.prod(list(sizes.values())))
  grid = np.array(jax.devices()[:n], dtype=object).reshape(tuple(sizes.values()))
  return jax.sharding.Mesh(grid, par.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def _data():
  k1, k2 = jax.random.split(jax.random.key(7))
  return (jax.random.randint(k1, (BATCH, SEQ), 0, CFG.vocab_size),
          jax.random.randint(k2, (BATCH, SEQ), 0, CFG.vocab_size))


def _model(cfg=CFG):
  with nnx.use_eager_sharding(False):
    return nnx.split(mixtral.Mixtral(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), nnx.Param)


def _loss(graphdef, params, tokens, targets):
  logits, aux = nnx.merge(graphdef, params)(tokens)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  return ce + aux["aux_loss"], aux


def _grads(axes: dict[str, int] | None, cfg=CFG, lower_only: bool = False):
  graphdef, params = _model(cfg)
  tokens, targets = _data()
  fn = jax.value_and_grad(lambda p, x, y: _loss(graphdef, p, x, y), has_aux=True)
  if axes is None:
    return jax.jit(fn)(params, tokens, targets)
  mesh = _mesh(axes)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(par.RULES):
    params = jax.device_put(params, state_shardings(params, mesh))
    batch = NamedSharding(mesh, par.spec_for(("batch", None)))
    tokens, targets = jax.device_put(tokens, batch), jax.device_put(targets, batch)
    compiled = jax.jit(fn).lower(params, tokens, targets).compile(FAST)
    if lower_only:
      return compiled
    return compiled(params, tokens, targets)


def _assert_same(got, want):
  (value, aux), grads = got
  (ref_value, ref_aux), ref_grads = want
  np.testing.assert_allclose(value, ref_value, rtol=2e-6)
  for key in ("aux_loss", "moe_dropped", "moe_load_balance", "moe_z_loss"):
    np.testing.assert_allclose(aux[key], ref_aux[key], rtol=2e-6, err_msg=key)
  ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    r = np.asarray(ref[path])
    np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-6 * float(np.abs(r).max()),
                               err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def reference():
  return _grads(None)


def test_capacity():
  cfg = moe.MoeConfig(num_experts=8, top_k=2, capacity_factor=1.25)
  assert moe.capacity(64, cfg) == 20  # ceil(1.25 * 64 * 2 / 8)
  assert moe.capacity(64, dataclasses.replace(cfg, capacity_factor=0)) == 64  # dropless


@pytest.mark.slow
def test_overflowing_tokens_are_dropped_and_counted():
  """Every token prefers experts 0 then 1: each keeps C of its G assignments, the rest are dropped and
  their outputs are zero."""
  g, d, e = 16, 4, 4
  cfg = moe.MoeConfig(num_experts=e, top_k=2, capacity_factor=1.0)  # C = ceil(16 * 2 / 4) = 8
  x = jnp.abs(jax.random.normal(jax.random.key(0), (1, g, d))) + 0.1
  router = jnp.zeros((d, e)).at[:, 0].set(2.0).at[:, 1].set(1.0)
  ones = jnp.ones((e, d, d))
  y, _, stats = moe.moe_ffn(x, router, ones, ones, ones * 0.1, cfg)
  assert float(stats["moe_dropped"]) == 2 * (g - 8) and float(stats["moe_assignments"]) == 2 * g
  assert np.all(np.abs(np.asarray(y[0, :8])) > 0) and np.all(np.asarray(y[0, 8:]) == 0)  # first come first served


@pytest.mark.slow
@pytest.mark.parametrize("axes", [
    {"expert": 8},
    {"data": 2, "expert": 4},
    {"fsdp": 2, "expert": 2, "tensor": 2},
])
def test_expert_parallel_gradients_match_one_device(reference, axes):
  _assert_same(_grads(axes), reference)


def test_planted_misrouting_fails_the_check(reference, monkeypatch):
  monkeypatch.setattr(moe, "exchange", lambda buf, axis: buf)  # tokens never reach their experts' owner
  with pytest.raises(AssertionError):
    _assert_same(_grads({"expert": 4}), reference)


def test_planted_dropped_expert_fails_the_check(reference, monkeypatch):
  good = moe.experts_ffn
  monkeypatch.setattr(moe, "experts_ffn", lambda x, *w: good(x, *w).at[0].set(0))  # first local expert silent
  with pytest.raises(AssertionError):
    _assert_same(_grads({"expert": 8}), reference)


def test_all_to_all_dispatch_in_the_compiled_program():
  """Two all-to-alls per MoE layer forward (dispatch and combine) and two in the backward, each moving
  the capacity-padded [E, C, D] buffer of the local tokens."""
  text = _grads({"expert": 8}, lower_only=True).as_text()
  fp = comm_fingerprint.comm_fingerprint(text, 8)
  g = BATCH // 8 * SEQ
  buf = CFG.moe.num_experts * moe.capacity(g, CFG.moe) * CFG.block.d_model * 4
  a2a = fp["all-to-all"]
  # The layers run under a scan: the loop body holds one layer's four (how often a loop body counts is
  # the fingerprint's convention); each moves exactly one buffer.
  assert a2a["count"] in (4, 4 * CFG.num_layers) and a2a["bytes"] == a2a["count"] * buf


# ---------------------------------------------------------------------------------------------------------
# Ragged dispatch (GPU's): XLA:CPU has no ragged-all-to-all, so its documented semantics are emulated here
# with an all-gather; what is tested is every offset and size the MoE layer computes.


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
  del recv_sizes
  ops = jax.lax.all_gather(operand, axis)
  io, ss, oo = (jax.lax.all_gather(a, axis) for a in (input_offsets, send_sizes, output_offsets))
  me = jax.lax.axis_index(axis)
  r = jnp.arange(output.shape[0])
  for src in range(ops.shape[0]):
    idx = r - oo[src, me]
    valid = (idx >= 0) & (idx < ss[src, me])
    rows = ops[src][jnp.clip(io[src, me] + idx, 0, operand.shape[0] - 1)]
    output = jnp.where(valid[:, None], rows, output)
  return output


RAGGED = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, dispatch="ragged_all_to_all"))


@pytest.mark.slow
@pytest.mark.parametrize("axes", [None, {"expert": 8}, {"data": 2, "expert": 4}])
def test_ragged_dispatch_matches_one_device(reference, monkeypatch, axes):
  monkeypatch.setattr(moe, "ragged_exchange", _emulated_ragged_all_to_all)
  _assert_same(_grads(axes, RAGGED), reference)


@pytest.mark.slow
def test_planted_ragged_offset_bug_fails_the_check(reference, monkeypatch):
  def shifted(operand, output, io, ss, oo, rs, axis):  # every slice lands one row late
    return _emulated_ragged_all_to_all(operand, output, io, ss, oo + 1, rs, axis)
  monkeypatch.setattr(moe, "ragged_exchange", shifted)
  with pytest.raises(AssertionError):
    _assert_same(_grads({"expert": 4}, RAGGED), reference)


def test_ragged_receive_buffer_drops_and_counts():
  g, d, e = 16, 4, 4
  cfg = moe.MoeConfig(num_experts=e, top_k=2, capacity_factor=0.5, dispatch="ragged_all_to_all")  # R = 16 rows
  x = jnp.abs(jax.random.normal(jax.random.key(0), (1, g, d))) + 0.1
  router = jnp.zeros((d, e)).at[:, 0].set(2.0).at[:, 1].set(1.0)
  ones = jnp.ones((e, d, d))
  y, _, stats = moe.moe_ffn(x, router, ones, ones, ones * 0.1, cfg)
  assert float(stats["moe_dropped"]) == 2 * g - 16  # expert 0's 16 rows fill the buffer; expert 1's drop
  assert np.all(np.abs(np.asarray(y)) > 0)  # every token kept its first choice


def test_dispatch_choice():
  assert moe.dispatch_for("gpu") == "ragged_all_to_all" and moe.dispatch_for("cpu") == "all_to_all"
  assert moe.dispatch_for("gpu", "all_to_all") == "all_to_all"


# ---------------------------------------------------------------------------------------------------------
# The trainer


def _train(parallelism: str):
  from microbench import train  # pylint: disable=g-import-not-at-top
  cfg = train.TrainConfig(model="mixtral", size="tiny", parallelism=parallelism, batch=8, seq_len=16, steps=3,
                          warmup_steps=1, capacity_factor=0.0, write=False, verbose=False, compiler_options=FAST)
  n = int(np.prod([int(x.split(":")[1]) for x in parallelism.split(",")]))
  return train.run(cfg, train.plan(cfg, jax.devices()[:n]))


@pytest.mark.slow
def test_trainer_runs_expert_parallel_like_one_device():
  one, ep = _train("dp:1"), _train("dp:2,ep:4")
  assert ep.losses[-1] < ep.losses[0]
  np.testing.assert_allclose(ep.losses, one.losses, rtol=2e-5)
  assert ep.summary["comm"]["all-to-all"]["bytes"] > 0 and "all-to-all" not in one.summary["comm"]


@pytest.mark.parametrize("kw,line", [
    (dict(model="gpt2", parallelism="dp:4,ep:2"), "ep:2 splits experts and gpt2 has none; use --model=mixtral"),
    (dict(model="mixtral", size="tiny", parallelism="ep:3"), "ep:3 does not divide mixtral-tiny's 8 experts"),
    (dict(model="llama3", capacity_factor=1.0), "--capacity_factor applies to mixtral (a mixture of experts)"),
    (dict(model="mixtral", moe_dispatch="nccl"), "unknown --moe_dispatch='nccl'; choose one of auto, all_to_all,"
                                                 " ragged_all_to_all"),
])
def test_bad_expert_configurations_get_one_line(kw, line):
  from microbench import train  # pylint: disable=g-import-not-at-top
  with pytest.raises(train.ConfigError) as e:
    train.check_request(train.TrainConfig(**kw))
  assert str(e.value).startswith(line) and "\n" not in str(e.value)
