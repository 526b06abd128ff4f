"""Pipeline parallelism: schedule tables against their theory, and gradients of the pipelined layer stack
against the same stack on one device (elementwise, float32), with planted bugs proving the check."""

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
from microbench.models import pipeline, pipeline_schedule as ps  # noqa: E402
from microbench.models.layers import Block, BlockConfig, Norm  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}
CFG = BlockConfig(d_model=16, num_heads=4, num_kv_heads=2, d_ff=32, norm="rmsnorm", mlp="swiglu", rope=True,
                  use_bias=False)
VOCAB, SEQ, BATCH = 32, 8, 8


# ---------------------------------------------------------------------------------------------------------
# Schedule tables (pure Python)


@pytest.mark.parametrize("kind,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("stages,microbatches", [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)])
def test_schedule_bubble_is_the_textbook_one(kind, virtual, stages, microbatches):
  sched = ps.make_schedule(kind, stages, microbatches, virtual)
  want = ps.theory_bubble(kind, stages, microbatches, virtual)
  for backward_cost in (1.0, 2.0, 3.0):  # lockstep ticks: holds whatever a backward costs
    assert sched.bubble(backward_cost) == pytest.approx(want, abs=1e-12)
  busy = sched.busy()
  assert busy[..., 0].sum() == busy[..., 1].sum() == stages * microbatches * virtual  # every op exactly once


def test_theory_formulas():
  assert ps.theory_bubble("gpipe", 4, 12) == pytest.approx(3 / 15)
  assert ps.theory_bubble("1f1b", 8, 16) == pytest.approx(7 / 23)
  assert ps.theory_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)


def test_schedule_memory_is_what_each_schedule_promises():
  # GPipe keeps every microbatch's stage input; 1F1B a number bounded by the stages, not the microbatches.
  for m in (8, 16, 32):
    assert ps.make_schedule("gpipe", 4, m).x_slots == m
    assert ps.make_schedule("1f1b", 4, m).x_slots == 5  # 2S-3 for device 1 (device 0 reads its input)
  assert ps.make_schedule("interleaved", 4, 32, 2).x_slots == ps.make_schedule("interleaved", 4, 8, 2).x_slots


def test_schedule_respects_dependencies():
  """Replays every table: a forward only after its input arrived, a backward only after its gradient."""
  for kind, s, m, v in [("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3)]:
    sched = ps.make_schedule(kind, s, m, v)
    done_f, done_b = {}, {}
    for t, row in enumerate(sched.table):
      for d, r in enumerate(row):
        if r[ps.F_CHUNK] >= 0:
          vs, mb = r[ps.F_CHUNK] * s + d, r[ps.F_MB]
          assert vs == 0 or done_f[(vs - 1, mb)] < t
          done_f[(vs, mb)] = t
      for d, r in enumerate(row):
        if r[ps.B_CHUNK] >= 0:
          vs, mb = r[ps.B_CHUNK] * s + d, r[ps.B_MB]
          assert done_f[(vs, mb)] <= t and (vs == s * v - 1 or done_b[(vs + 1, mb)] < t)
          done_b[(vs, mb)] = t
    assert len(done_f) == len(done_b) == s * v * m


@pytest.mark.parametrize("args,line", [
    (("pipedream", 2, 4), "unknown --schedule='pipedream'; choose one of gpipe, 1f1b, interleaved"),
    (("interleaved", 4, 6, 2), "--schedule=interleaved needs --microbatches a multiple of the pipeline stages (4)"),
    (("1f1b", 4, 8, 2), "--virtual_stages=2 needs --schedule=interleaved"),
    (("interleaved", 4, 8, 1), "--schedule=interleaved needs --virtual_stages >= 2"),
])
def test_schedule_refusals(args, line):
  with pytest.raises(ps.ScheduleError, match=None) as e:
    ps.make_schedule(*args)
  assert str(e.value).startswith(line) and "\n" not in str(e.value)


@pytest.mark.slow
def test_schedule_and_mesh_must_agree():
  with pytest.raises(ps.ScheduleError, match="the schedule is for 4 stages but the mesh's `stage` axis has 2"):
    _pipelined(4, {"stage": 2}, ps.make_schedule("1f1b", 4, 4), lower_only=True)


def test_uneven_layer_split_is_refused():
  pipeline.check_layers(8, 4)
  pipeline.check_layers(8, 2, 2)
  with pytest.raises(ps.ScheduleError, match="pp:3 does not divide the model's 8 layers"):
    pipeline.check_layers(8, 3)
  with pytest.raises(ps.ScheduleError, match="pp:4 x 2 virtual stages does not divide the model's 4 layers"):
    pipeline.check_layers(4, 4, 2)


# ---------------------------------------------------------------------------------------------------------
# The executor against one device


def _stacked_blocks(num_layers: int):
  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def create(rngs):
    return Block(CFG, rngs, num_layers)
  with nnx.use_eager_sharding(False):
    return nnx.split(create(nnx.Rngs(0)))


def _problem(num_layers: int):
  """Stacked block params [L, ...], head params, input activations and targets (random, distinct)."""
  graphdef, layers = _stacked_blocks(num_layers)
  k = jax.random.split(jax.random.key(1), 4)
  with nnx.use_eager_sharding(False):
    norm_def, norm = nnx.split(Norm(CFG.d_model, CFG.norm, CFG.norm_eps, nnx.Rngs(2)))
  head = {"norm": norm, "w": jax.random.normal(k[0], (CFG.d_model, VOCAB)) * 0.3}
  x = jax.random.normal(k[1], (BATCH, SEQ, CFG.d_model))
  targets = jax.random.randint(k[2], (BATCH, SEQ), 0, VOCAB)
  return graphdef, norm_def, layers, head, x, targets


def _fns(graphdef, norm_def):
  def stage_fn(p, x):
    def body(x, lp):
      return nnx.merge(graphdef, lp)(x), None
    return jax.lax.scan(body, x, p)[0], jnp.zeros((), jnp.float32), {}

  def head_fn(h, y, t):
    logits = nnx.merge(norm_def, h["norm"])(y) @ h["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()
  return stage_fn, head_fn


def _reference_grads(num_layers: int):
  graphdef, norm_def, layers, head, x, targets = _problem(num_layers)
  stage_fn, head_fn = _fns(graphdef, norm_def)

  def loss(lp, hp, x):
    return head_fn(hp, stage_fn(lp, x)[0], targets)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(layers, head, x)


def _mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
  sizes = {a: axes.get(a, 1) for a in par.MESH_AXES}
  n = int(np.prod(list(sizes.values())))
  grid = np.array(jax.devices()[:n], dtype=object).reshape(tuple(sizes.values()))
  return jax.sharding.Mesh(grid, par.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def _pipelined(num_layers: int, axes: dict[str, int], sched: ps.Schedule, lower_only: bool = False):
  """(loss, (layer grads [L,...], head grads, input grads)) of the pipelined stack on `axes`."""
  graphdef, norm_def, layers, head, x, targets = _problem(num_layers)
  stage_fn, head_fn = _fns(graphdef, norm_def)
  mesh = _mesh(axes)
  v, m = sched.virtual, sched.microbatches

  def place(var):
    spec = par.spec_for(var.get_metadata()["out_sharding"])
    return NamedSharding(mesh, jax.P(None, *spec))
  layers_v = pipeline.stack_chunks(layers, v)
  layer_shard = jax.tree.map(place, layers, is_leaf=lambda a: isinstance(a, nnx.Variable))

  def loss(lp, hp, x):
    x_m, t_m = pipeline.to_microbatches(x, m), pipeline.to_microbatches(targets, m)
    return pipeline.pipeline_loss(stage_fn, head_fn, sched, lp, hp, x_m, t_m)[0]

  with jax.set_mesh(mesh), nnx.logical_axis_rules(par.RULES):
    layers_v = jax.device_put(layers_v, layer_shard)
    x = jax.device_put(x, NamedSharding(mesh, par.spec_for(("batch", None, None))))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = step.lower(layers_v, head, x).compile(FAST)
    if lower_only:
      return compiled
    value, (gl, gh, gx) = compiled(layers_v, head, x)
  return value, (pipeline.unstack_chunks(gl), gh, gx)


def _assert_same(got, want):
  value, grads = got
  ref_value, ref_grads = want
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    r = dict(jax.tree_util.tree_leaves_with_path(ref_grads))[path]
    scale = float(np.abs(r).max())
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6 * scale,
                               err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def reference():
  cache = {}
  return lambda layers: cache.setdefault(layers, _reference_grads(layers))


@pytest.mark.slow
@pytest.mark.parametrize("kind,axes,m,v,layers", [
    ("gpipe", {"stage": 4, "data": 2}, 4, 1, 4),  # pp + dp
    ("1f1b", {"stage": 2, "data": 2, "tensor": 2}, 4, 1, 4),  # pp + dp + tp
    ("1f1b", {"stage": 2, "fsdp": 2, "tensor": 2}, 4, 1, 4),  # pp + fsdp + tp
    ("interleaved", {"stage": 4, "data": 2}, 4, 2, 8),  # 2 chunks per device
])
def test_pipelined_gradients_match_one_device(reference, kind, axes, m, v, layers):
  sched = ps.make_schedule(kind, axes["stage"], m, v)
  _assert_same(_pipelined(layers, axes, sched), reference(layers))


def _broken(sched: ps.Schedule, mutate) -> ps.Schedule:
  table = sched.table.copy()
  mutate(table)
  return dataclasses.replace(sched, table=table)


def _drop_last_backward_of_stage0(t):
  rows = np.nonzero(t[:, 0, ps.B_CHUNK] >= 0)[0]
  t[rows[-1], 0, ps.B_CHUNK] = -1


def _swap_two_microbatches_on_stage1(t):
  rows = np.nonzero(t[:, 1, ps.F_CHUNK] >= 0)[0][:2]
  t[rows, 1, ps.F_MB] = t[rows[::-1], 1, ps.F_MB]


@pytest.mark.slow
@pytest.mark.parametrize("mutate", [_drop_last_backward_of_stage0, _swap_two_microbatches_on_stage1])
def test_planted_schedule_bugs_fail_the_check(reference, mutate):
  sched = _broken(ps.make_schedule("1f1b", 2, 4), mutate)
  with pytest.raises(AssertionError):
    _assert_same(_pipelined(4, {"stage": 2}, sched), reference(4))


@pytest.mark.slow
def test_planted_transfer_off_by_one_fails_the_check(reference, monkeypatch):
  good = pipeline.transfer_pairs
  monkeypatch.setattr(pipeline, "transfer_pairs",  # activations skip a stage
                      lambda s, v, step: good(s, v, 2 * step) if step > 0 else good(s, v, step))
  sched = ps.make_schedule("1f1b", 4, 4)
  with pytest.raises(AssertionError):
    _assert_same(_pipelined(4, {"stage": 4}, sched), reference(4))


@pytest.mark.slow
def test_stage_transfers_in_the_compiled_program():
  """Inside the tick loop: exactly one activation forward and one gradient back (collective-permutes of a
  microbatch's b*T*D floats between neighbouring stages) and nothing else; data-parallel gradients are
  reduced, and FSDP weights gathered, once per step outside the loop."""
  from microbench.hlo import parse as hlo  # pylint: disable=g-import-not-at-top

  sched = ps.make_schedule("1f1b", 2, 2)
  text = _pipelined(4, {"stage": 2, "data": 2, "fsdp": 2}, sched, lower_only=True).as_text()
  fp = comm_fingerprint.comm_fingerprint(text, 8)
  micro = BATCH // 2 // 4 * SEQ * CFG.d_model * 4  # per device: microbatch / 4 batch shards, float32
  cp = fp["collective-permute"]  # the loop body's two, counted once or once per tick (fingerprint convention)
  assert cp["count"] in (2, 2 * sched.ticks) and cp["bytes"] == cp["count"] * micro
  in_loop = [c for c in hlo.find_collectives(text) if "/while/body/" in c.text]
  assert sorted(c.op for c in in_loop) == ["collective-permute"] * 2
  # mesh (stage=2, data=2, fsdp=2): device = 4*stage + 2*data + fsdp; each batch shard has its own chain.
  forward = {(0, 4), (1, 5), (2, 6), (3, 7)}
  assert sorted(set(c.groups) for c in in_loop) == sorted([forward, {(b, a) for a, b in forward}])
  assert fp["all-gather"]["count"] >= 1 and fp["all-reduce"]["count"] >= 1  # FSDP gathers, gradient sums


# ---------------------------------------------------------------------------------------------------------
# The trainer's refusals: one line each, before anything compiles


@pytest.mark.parametrize("kw,line", [
    (dict(model="resnet", size="tiny", parallelism="pp:2,dp:4"),
     "pp:2 splits a model's stack of layers and resnet has none to split"),
    (dict(model="llama3", size="tiny", parallelism="pp:4,dp:2"), "pp:4 does not divide the model's 2 layers"),
    (dict(model="llama3", size="tiny", layers=4, parallelism="pp:2,dp:4", schedule="interleaved",
          virtual_stages=2, microbatches=3), "--schedule=interleaved needs --microbatches a multiple of the"
                                             " pipeline stages (2); got 3"),
    (dict(model="llama3", size="tiny", layers=4, parallelism="pp:2,dp:4", schedule="interleaved",
          virtual_stages=4), "pp:2 x 4 virtual stages does not divide the model's 4 layers"),
    (dict(model="llama3", size="tiny", parallelism="pp:2,dp:4", schedule="zero-bubble"),
     "unknown --schedule='zero-bubble'; choose one of gpipe, 1f1b, interleaved"),
    (dict(model="llama3", size="tiny", parallelism="dp:8", microbatches=4),
     "--microbatches applies to pipeline parallelism (pp:S in --parallelism)"),
    (dict(model="llama3", size="tiny", parallelism="pp:2,dp:4", grad_accum=2),
     "--grad_accum=2 with pp:2: the pipeline's microbatches are its gradient accumulation"),
    (dict(model="llama3", size="tiny", parallelism="pp:2,cp:2,dp:2", seq_len=32), "cp with pp is not supported"),
])
def test_bad_pipeline_requests_get_one_line(kw, line):
  from microbench import train  # pylint: disable=g-import-not-at-top
  with pytest.raises(train.ConfigError) as e:
    train.check_request(train.TrainConfig(**kw))
  assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_batch_must_split_into_microbatches_on_every_batch_shard():
  from microbench import train  # pylint: disable=g-import-not-at-top
  cfg = train.TrainConfig(model="llama3", size="tiny", parallelism="pp:2,dp:4", batch=8, microbatches=4)
  with pytest.raises(train.ConfigError, match=r"^--batch=8 is not divisible by microbatches x batch shards = 4 x 4"):
    train.plan(cfg, jax.devices()[:8])
  assert train.plan(dataclasses.replace(cfg, batch=16), jax.devices()[:8]).microbatches == 4


@pytest.mark.slow
def test_summary_counts_loops_nested_in_the_tick_loop_per_step():
  """The scanned layers run inside each tick: the summary's loop line gives their iterations per step (trip
  count x runs of the enclosing tick loop), not the trip count alone (the bug: 'x2 per step' for 8)."""
  from microbench import train  # pylint: disable=g-import-not-at-top

  cfg = train.TrainConfig(model="llama3", size="tiny", layers=4, parallelism="pp:2,dp:2,tp:2", batch=8, seq_len=16,
                          microbatches=2, schedule="1f1b", compile_only=True, write=False, verbose=False)
  r = train.run(cfg, train.plan(cfg, jax.devices()[:8]))
  ticks = ps.make_schedule("1f1b", 2, 2).ticks
  loops = r.summary["comm_loops"]
  nested = [lp for lp in loops if lp["times"] > 1]
  assert nested and all(lp["trip_count"] == 2 and lp["times"] == ticks for lp in nested), loops
  text = train.format_table(r.summary)
  assert f"x{2 * ticks} (2 x {ticks} runs, nested) per step" in text, text
