"""Pipeline schedules side by side: measured bubble against theory, and activation memory, per schedule.

A stack of Llama-shaped blocks split over `--stages` devices (pipeline only, no other axis) runs its
forward and backward under each schedule; `microbench.train.overheads` times it with and without
the bubble (alternating; the median of the per-round shares with its 95% interval, "not resolved" when the
interval includes 0 or is wider than the figure). The compiled temp memory shows what 1F1B saves over GPipe.

  python scripts/bench_pipeline.py --stages=4 --microbatches=8 --layers=8 --rounds=12

On CPU the devices are virtual (JAX_NUM_CPU_DEVICES, set here to --stages when unset).
"""

from __future__ import annotations

import json
import os

from absl import app, flags

flags.DEFINE_integer("stages", 4, "Pipeline stages (devices).")
flags.DEFINE_integer("microbatches", 8, "Microbatches per step.")
flags.DEFINE_integer("virtual", 2, "Chunks per device for the interleaved schedule.")
flags.DEFINE_integer("layers", 8, "Blocks in the stack (a multiple of stages x virtual).")
flags.DEFINE_integer("d_model", 128, "Model width.")
flags.DEFINE_integer("seq_len", 64, "Tokens per example.")
flags.DEFINE_integer("micro_batch", 2, "Examples per microbatch.")
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved"], "Schedules to compare.")
flags.DEFINE_integer("rounds", 12, "Alternating timed rounds per schedule (at least 6 for an interval).")
flags.DEFINE_string("out", None, "Also write the results as JSON here.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(FLAGS.stages))
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  from microbench.train.overheads import Share, measure_bubble  # pylint: disable=g-import-not-at-top
  from microbench.models import pipeline, pipeline_schedule as ps  # pylint: disable=g-import-not-at-top
  from microbench.models.layers import Block, BlockConfig  # pylint: disable=g-import-not-at-top

  s, m, d = FLAGS.stages, FLAGS.microbatches, FLAGS.d_model
  cfg = BlockConfig(d_model=d, num_heads=max(1, d // 64), num_kv_heads=max(1, d // 64), d_ff=4 * d,
                    norm="rmsnorm", mlp="swiglu", rope=True, use_bias=False)
  devices = jax.devices()[:s]
  mesh = jax.sharding.Mesh(np.array(devices).reshape(s, 1), ("stage", "data"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)

  @nnx.split_rngs(splits=FLAGS.layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return Block(cfg, rngs, FLAGS.layers)
  with nnx.use_eager_sharding(False):
    graphdef, layers = nnx.split(create(nnx.Rngs(0)))
  layers = jax.tree.map(lambda v: v[...], layers, is_leaf=lambda x: isinstance(x, nnx.Variable))
  head = {"w": jax.random.normal(jax.random.key(1), (d, 256)) * 0.02}
  x = jax.random.normal(jax.random.key(2), (m, FLAGS.micro_batch, FLAGS.seq_len, d))
  targets = jax.random.randint(jax.random.key(3), (m, FLAGS.micro_batch, FLAGS.seq_len), 0, 256)

  def stage_fn(p, x):
    return jax.lax.scan(lambda x, lp: (nnx.merge(graphdef, lp)(x), None), x, p)[0], jnp.zeros(()), {}

  def head_fn(h, y, t):
    return optax.softmax_cross_entropy_with_integer_labels(y @ h["w"], t).mean()

  results = []
  for kind in FLAGS.schedules:
    v = FLAGS.virtual if kind == "interleaved" else 1
    pipeline.check_layers(FLAGS.layers, s, v)
    sched = ps.make_schedule(kind, s, m, v)
    lp = jax.device_put(pipeline.stack_chunks(layers, v), NamedSharding(mesh, jax.P(None, "stage")))
    memory = {}

    def run_with(table, lp=lp, memory=memory):
      def loss(lp, hp, x):
        return pipeline.pipeline_loss(stage_fn, head_fn, table, lp, hp, x, targets)[0]
      with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(lp, head, x).compile()
      memory[table.kind] = compiled.memory_analysis().temp_size_in_bytes
      return lambda: jax.block_until_ready(compiled(lp, head, x))

    fig = measure_bubble(run_with, sched, FLAGS.rounds)
    row = {**fig.as_dict(), "temp_bytes": memory[kind], "x_slots": sched.x_slots, "ticks": sched.ticks}
    results.append(row)
    measured = Share(fig.measured, *(fig.measured_ci or (None, None)), fig.rounds).text()
    print(f"{kind:12s} S={s} M={m} V={v}  bubble theory {fig.theory:6.3f}, measured {measured}"
          f"  step {fig.step_time_s * 1e3:8.2f} ms (no bubble {fig.no_bubble_time_s * 1e3:8.2f} ms)"
          f"  stash {sched.x_slots:2d} microbatches  temp {memory[kind] / 2**20:7.2f} MiB")
  if FLAGS.out:
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      json.dump({"flags": {k: FLAGS[k].value for k in ("stages", "microbatches", "virtual", "layers", "d_model",
                                                      "seq_len", "micro_batch", "rounds")},
                 "devices": f"{len(devices)} x {devices[0].device_kind}", "results": results}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
