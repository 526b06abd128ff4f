"""Context parallelism: ring and all-to-all attention against XLA's attention on one device (outputs and
gradients, float32), alone and with fsdp and tp; planted bugs; activation memory falling with C."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from microbench.meshes import parallelism as par  # noqa: E402
from microbench.hlo import parse as hlo  # noqa: E402
from microbench.models import context  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}
ACT = ("batch", "act_seq", "act_heads", "act_head_dim")
KV = ("batch", "act_seq", "act_kv_heads", "act_head_dim")


def _mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
  sizes = {a: axes.get(a, 1) for a in par.MESH_AXES}
  n = int(np.prod(list(sizes.values())))
  grid = np.array(jax.devices()[:n], dtype=object).reshape(tuple(sizes.values()))
  return jax.sharding.Mesh(grid, par.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def _inputs(b=2, t=16, n=8, kh=4, h=8):
  ks = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(ks[0], (b, t, n, h))
  k = jax.random.normal(ks[1], (b, t, kh, h))
  v = jax.random.normal(ks[2], (b, t, kh, h))
  w = jax.random.normal(ks[3], (b, t, n, h))  # distinct weight per output element: every one matters
  return q, k, v, w


def _value_and_grads(axes, impl, causal=True, shape=None, lower_only=False):
  q, k, v, w = _inputs(**(shape or {}))

  def loss(q, k, v):
    return jnp.sum(context.attention(q, k, v, causal, impl) * w)
  fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
  if axes is None:
    return jax.jit(fn)(q, k, v)
  mesh = _mesh(axes)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(par.RULES):
    q = jax.device_put(q, NamedSharding(mesh, par.spec_for(ACT)))
    k, v = (jax.device_put(a, NamedSharding(mesh, par.spec_for(KV))) for a in (k, v))
    compiled = jax.jit(fn).lower(q, k, v).compile(FAST)
    return compiled if lower_only else compiled(q, k, v)


def _assert_same(got, want):
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, r in zip(got[1], want[1]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))


@pytest.fixture(scope="module")
def reference():
  cache = {}
  return lambda causal=True: cache.setdefault(causal, _value_and_grads(None, "ring", causal))


@pytest.mark.slow
@pytest.mark.parametrize("impl,axes,causal", [
    ("ring", {"context": 4}, True),
    ("ring", {"context": 8}, False),
    ("ring", {"fsdp": 2, "tensor": 2, "context": 2}, True),  # fsdp + tp + cp
    ("all_to_all", {"context": 4}, True),
    ("all_to_all", {"fsdp": 2, "tensor": 2, "context": 2}, True),
])
def test_context_parallel_attention_matches_one_device(reference, impl, axes, causal):
  _assert_same(_value_and_grads(axes, impl, causal), reference(causal))


def test_ring_handles_grouped_query_heads():
  shape = {"n": 8, "kh": 2}
  _assert_same(_value_and_grads({"context": 4}, "ring", shape=shape), _value_and_grads(None, "ring", shape=shape))


def test_planted_causal_mask_bug_fails_the_check(reference, monkeypatch):
  good = context.block_mask
  monkeypatch.setattr(context, "block_mask", lambda qb, kb, tq, tk: good(qb, kb, tq, tk) | (qb == kb))  # diag full
  with pytest.raises(AssertionError):
    _assert_same(_value_and_grads({"context": 4}, "ring"), reference())


def test_planted_ring_direction_bug_fails_the_check(reference, monkeypatch):
  monkeypatch.setattr(context, "ring_pairs", lambda c: [(i, (i - 1) % c) for i in range(c)])  # wrong way round
  with pytest.raises(AssertionError):
    _assert_same(_value_and_grads({"context": 4}, "ring"), reference())


def test_planted_missing_exchange_fails_the_check(reference, monkeypatch):
  monkeypatch.setattr(context, "to_heads", lambda x: x)  # each device attends within its own block only
  monkeypatch.setattr(context, "to_sequence", lambda x: x)
  with pytest.raises(AssertionError):
    _assert_same(_value_and_grads({"context": 4}, "all_to_all"), reference())


def test_what_each_form_moves():
  """Ring: K/V blocks (and in the backward their gradients) between ring neighbours, nothing gathered;
  all-to-all: all-to-alls, no collective-permute."""
  ring = _value_and_grads({"context": 4}, "ring", lower_only=True).as_text()
  ops = {c.op for c in hlo.find_collectives(ring)}
  assert "collective-permute" in ops and "all-gather" not in ops and "all-to-all" not in ops
  pairs = {c.groups for c in hlo.find_collectives(ring) if c.op == "collective-permute"}
  assert pairs == {((0, 1), (1, 2), (2, 3), (3, 0))}
  a2a = _value_and_grads({"context": 4}, "all_to_all", lower_only=True).as_text()
  ops = {c.op for c in hlo.find_collectives(a2a)}
  assert "all-to-all" in ops and "collective-permute" not in ops and "all-gather" not in ops


@pytest.mark.parametrize("args,line", [
    (("ring", 3, 16, 8, 4), "cp:3 does not divide the sequence length 16"),
    (("all_to_all", 4, 16, 8, 2), "--context_impl=all_to_all splits heads over cp x tp = 4, which does not divide"
                                  " the 2 kv heads"),
    (("all_to_all", 2, 16, 8, 4, 8), "--context_impl=all_to_all splits heads over cp x tp = 16, which does not"
                                     " divide the 8 attention heads"),
    (("striped", 2, 16, 8, 4), "unknown --context_impl='striped'; choose one of ring, all_to_all"),
])
def test_refusals(args, line):
  with pytest.raises(context.ContextError) as e:
    context.check(*args)
  assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_activation_memory_falls_with_context_degree():
  """Compiled temp memory per device of attention forward + backward at a long sequence: C=4 needs at
  most ~1/C of one device's (ring keeps O(T/C) per device; all-to-all keeps H/C heads' scores)."""
  shape = {"b": 1, "t": 1024, "n": 8, "kh": 8, "h": 16}
  temp = lambda axes, impl: _value_and_grads(axes, impl, shape=shape, lower_only=True).memory_analysis() \
      .temp_size_in_bytes
  one = temp({"context": 1}, "ring")
  for impl in context.IMPLS:
    assert temp({"context": 4}, impl) <= 0.3 * one, impl


@pytest.mark.parametrize("kw,line", [
    (dict(model="llama3", size="tiny", parallelism="cp:8", seq_len=36), "cp:8 does not divide the sequence length 36"),
    (dict(model="llama3", size="tiny", parallelism="cp:2,tp:2,dp:2", seq_len=32, context_impl="all_to_all"),
     "--context_impl=all_to_all splits heads over cp x tp = 4, which does not divide the 2 kv heads"),
    (dict(model="vit", size="tiny", parallelism="cp:2,dp:4"), "cp:2 splits a token sequence over devices; vit is"
                                                               " not a language model"),
    (dict(model="gpt2", size="tiny", parallelism="cp:2,dp:4", context_impl="striped"),
     "unknown --context_impl='striped'; choose one of ring, all_to_all"),
])
def test_bad_context_requests_get_one_line(kw, line):
  from microbench import train  # pylint: disable=g-import-not-at-top
  with pytest.raises(train.ConfigError) as e:
    train.check_request(train.TrainConfig(**kw))
  assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)
