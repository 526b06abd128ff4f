"""Every parallel strategy computes the single-device gradients: compared elementwise in float32 with a tight
relative tolerance, and losses over several SGD steps (an SGD update is proportional to the gradient; Adam's
first update depends only on each gradient's sign, so a loss check after AdamW steps passed even with every
gradient multiplied by 8). DP, FSDP and TP; pipeline (gpipe, interleaved), expert and context (ring,
all-to-all) parallelism alone and composed (dp+pp, dp+pp+tp, dp+pp+ep, fsdp+tp+cp). Planted bugs prove the
checks see what they claim to: gradients scaled by the data-parallel degree, one tensor-parallel all-reduce
done twice, the tied embedding's gradient reduced twice, two pipeline microbatches swapped, ring attention
without its causal mask, tokens that never reach their experts.
"""

from __future__ import annotations

import dataclasses
import functools
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from _trainers import assert_grads_match, compiled_step, make_trainer, sgd_run  # noqa: E402
from microbench.train.comm_fingerprint import comm_fingerprint  # noqa: E402
from microbench.models import context, layers, moe, pipeline, pipeline_schedule as ps, transformer  # noqa: E402
from microbench.models.layers import Execution  # noqa: E402
from microbench.models.optimizer import sgd  # noqa: E402

CASES = [
    ("gpt2", "dp:8"),
    ("gpt2", "fsdp:8"),
    ("gpt2", "dp:2,tp:4"),
    ("gpt2", "fsdp:2,tp:4"),
    ("gpt2", "dp:2,fsdp:2,tp:2"),
    ("llama3", "dp:8"),
    ("llama3", "fsdp:4,tp:2"),
    ("llama3", "dp:2,fsdp:2,tp:2"),
    ("vit", "dp:8"),
    ("vit", "dp:2,fsdp:2,tp:2"),
    ("resnet", "dp:8"),
    ("resnet", "dp:2,fsdp:4"),
]


@functools.cache
def _run(model: str, strategy: str, **kw) -> tuple[list[float], dict[str, np.ndarray]]:
  """(losses over 3 SGD steps, first-step gradients) under `strategy`, from the shared seeded start."""
  ref_kw = {k: kw[k] for k in ("batch", "layers") if k in kw}
  return sgd_run(make_trainer(model, strategy, tx=sgd(0.0), **kw), model, **ref_kw)


@pytest.mark.slow
@pytest.mark.parametrize("model,strategy", CASES)
def test_gradients_and_sgd_losses_match_single_device(model, strategy):
  losses1, g1 = _run(model, "dp:1")
  losses, g = _run(model, strategy)
  assert_grads_match(g, g1, what=f"{model} {strategy}")
  if model in ("gpt2", "llama3"):
    assert losses[-1] < losses[0]  # it trains (the synthetic sequences are learnable within 3 steps)
  np.testing.assert_allclose(losses, losses1, rtol=2e-6)


# Pipeline, expert and context parallelism, alone and composed: (model, strategy, execution, reference
# grad_accum, layers). The mixture of experts runs without capacity drops, so routing is the same however the
# batch is split; its load-balancing loss is computed per pipeline microbatch, so its one-device reference
# accumulates the same microbatches (a loss over the whole batch would differ: the loss is not linear in it).
PP = Execution(microbatches=4, schedule="gpipe")
PARALLEL_CASES = [
    ("gpt2", "pp:4", PP, 1, 4),  # tied embedding: its lookup before the pipeline, its head on the last stage
    ("mixtral", "ep:8", Execution(), 1, None),
    ("llama3", "cp:8", Execution(context_impl="ring"), 1, None),
    ("gpt2", "cp:4", Execution(context_impl="all_to_all"), 1, None),
    ("llama3", "dp:2,pp:4", PP, 1, 4),
    ("llama3", "dp:2,pp:2,tp:2", Execution(microbatches=2, schedule="interleaved", virtual_stages=2), 1, 4),
    ("mixtral", "dp:2,pp:2,ep:2", Execution(microbatches=2), 2, None),
    ("llama3", "fsdp:2,tp:2,cp:2", Execution(context_impl="ring"), 1, None),
    ("gpt2", "fsdp:2,tp:2,cp:2", Execution(context_impl="all_to_all"), 1, None),
    ("vit", "dp:2,pp:2", Execution(microbatches=2), 1, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,strategy,execution,ref_accum,layers", PARALLEL_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2].context_impl if 'cp' in c[1] else c[2].schedule}"
                              for c in PARALLEL_CASES])
def test_pipeline_expert_and_context_parallel_gradients_match_single_device(model, strategy, execution, ref_accum,
                                                                            layers):
  depth = {"layers": layers} if layers else {}
  losses1, g1 = _run(model, "dp:1", **depth, **({"grad_accum": ref_accum} if ref_accum > 1 else {}))
  losses, g = _run(model, strategy, execution=execution, **depth)
  assert_grads_match(g, g1, what=f"{model} {strategy} {execution}")
  np.testing.assert_allclose(losses, losses1, rtol=2e-6)


@pytest.mark.slow
def test_layout_and_remat_choices_leave_gradients_unchanged():
  """Scan vs unrolled layers and the remat policies are the same computation."""
  _, ref = _run("gpt2", "dp:2,fsdp:2,tp:2")
  for ex in (Execution(scan=False, remat="none"), Execution(remat="full")):
    _, g = _run("gpt2", "dp:2,fsdp:2,tp:2", execution=ex)
    assert_grads_match(g, ref, what=str(ex))


@pytest.mark.slow
def test_grad_accumulation_equals_the_big_batch():
  big_losses, big = _run("gpt2", "dp:2,fsdp:2", batch=16)
  micro_losses, micro = _run("gpt2", "dp:2,fsdp:2", batch=16, grad_accum=4)
  assert_grads_match(micro, big, what="grad_accum=4")
  np.testing.assert_allclose(micro_losses, big_losses, rtol=2e-6)
  # ... and the check sees a microbatch mistake: gradients summed instead of averaged over microbatches.
  with pytest.raises(AssertionError):
    assert_grads_match({k: 4 * v for k, v in micro.items()}, big)


# ---------------------------------------------------------------------------------------------------------
# Planted bugs: each must fail the checks above.


def _scaled_by_dp(monkeypatch, degree: int) -> None:
  """The classic data-parallel bug: gradients summed over replicas instead of averaged."""
  from microbench.models.train_step import Trainer
  original = Trainer.loss_and_grads

  def buggy(self, params, rest, batch):
    loss, grads, rest, stats = original(self, params, rest, batch)
    return loss, jax.tree.map(lambda g: g * degree, grads), rest, stats
  monkeypatch.setattr(Trainer, "loss_and_grads", buggy)


def test_planted_dp_scaled_gradients_fail_both_checks(monkeypatch):
  ref_losses, ref = _run("gpt2", "dp:1")
  _scaled_by_dp(monkeypatch, 8)
  losses, g = sgd_run(make_trainer("gpt2", "dp:8", tx=sgd(0.0)), "gpt2")
  with pytest.raises(AssertionError):
    assert_grads_match(g, ref)
  with pytest.raises(AssertionError):
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)


def _doubled_tp_all_reduce(monkeypatch) -> None:
  """The MLP's row-parallel output reduced over `tensor` once more: a second psum of an already summed value."""
  original = layers.Mlp.__call__

  def buggy(self, x):
    out = original(self, x)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("tensor", 1) == 1:
      return out
    again = jax.shard_map(lambda y: jax.lax.psum(y, "tensor"), in_specs=jax.P(), out_specs=jax.P(),
                          axis_names={"tensor"}, check_vma=False)
    return again(out)
  monkeypatch.setattr(layers.Mlp, "__call__", buggy)


def test_planted_doubled_tp_all_reduce_fails_the_gradient_check(monkeypatch):
  _, ref = _run("gpt2", "dp:1")
  _doubled_tp_all_reduce(monkeypatch)
  losses, g = sgd_run(make_trainer("gpt2", "dp:4,tp:2", tx=sgd(0.0)), "gpt2", steps=1)
  with pytest.raises(AssertionError):
    assert_grads_match(g, ref)


def _dp_reduce_over_params(model_size: str = "124m") -> float:
  """Bytes every device all-reduces per step under dp:8, over the parameter bytes (float32): 1.0 means each
  gradient is reduced once. GPT-2 124M's width at one layer: the tied [vocab, d] table is 84% of the
  parameters, so reducing it twice shows."""
  t = make_trainer("gpt2", "dp:8", size=model_size, layers=1, tx=sgd(0.1))
  comm = comm_fingerprint(compiled_step(t).as_text(), 8)
  return comm["all-reduce"]["bytes"] / (4 * t.num_params)


def test_tied_embedding_gradient_is_reduced_once(monkeypatch):
  ratio = _dp_reduce_over_params()
  assert 0.95 <= ratio <= 1.02, ratio  # learned positions past seq_len get no gradient, hence < 1
  # Planted: the table used directly by both the lookup and the head (no per-shard copy): XLA reduces the
  # lookup's and the head's [vocab, d] gradients separately.
  monkeypatch.setattr(transformer, "mesh_degree", lambda names: 1)
  assert _dp_reduce_over_params() > 1.5


def _swapped_microbatches(monkeypatch) -> None:
  """The pipeline's table gives the last stage two microbatches' targets in each other's place."""
  good = pipeline.schedule

  def buggy(*args, **kw):
    sched = good(*args, **kw)
    table = sched.table.copy()
    rows = np.nonzero(table[:, -1, ps.F_CHUNK] >= 0)[0][:2]
    table[rows, -1, ps.F_MB] = table[rows[::-1], -1, ps.F_MB]
    return dataclasses.replace(sched, table=table)
  monkeypatch.setattr(pipeline, "schedule", buggy)


PLANTED = [
    # (what, plant, model, strategy, execution, reference grad_accum, layers)
    ("pipeline microbatches swapped", _swapped_microbatches, "llama3", "dp:2,pp:4", PP, 1, 4),
    ("ring attention without its causal mask",
     lambda mp: mp.setattr(context, "block_mask", lambda qb, kb, tq, tk: jnp.ones((tq, tk), bool)),
     "llama3", "fsdp:2,tp:2,cp:2", Execution(context_impl="ring"), 1, None),
    ("tokens never reach their experts' owners", lambda mp: mp.setattr(moe, "exchange", lambda buf, axis: buf),
     "mixtral", "dp:2,pp:2,ep:2", Execution(microbatches=2), 2, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("what,plant,model,strategy,execution,ref_accum,layers", PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_pipeline_context_and_expert_bugs_fail_the_gradient_check(monkeypatch, what, plant, model, strategy,
                                                                          execution, ref_accum, layers):
  depth = {"layers": layers} if layers else {}
  _, ref = _run(model, "dp:1", **depth, **({"grad_accum": ref_accum} if ref_accum > 1 else {}))
  plant(monkeypatch)
  _, g = sgd_run(make_trainer(model, strategy, tx=sgd(0.0), execution=execution, **depth), model, steps=1, **depth)
  with pytest.raises(AssertionError):
    assert_grads_match(g, ref, what=what)
