"""Activation memory per device of attention forward + backward against the context-parallel degree.

Compiles (does not run) the gradient of a causal attention layer's output at a long sequence for
C = 1, 2, 4, 8 devices on the `context` axis, each form, and prints XLA's temp (activation) bytes per
device: the point of context parallelism is that this falls about as 1/C.

  python scripts/bench_context_memory.py --seq_len=4096 --heads=8 --head_dim=64
"""

from __future__ import annotations

import json
import os

from absl import app, flags

flags.DEFINE_integer("seq_len", 4096, "Tokens per example.")
flags.DEFINE_integer("heads", 8, "Attention heads (= KV heads).")
flags.DEFINE_integer("head_dim", 64, "Head dimension.")
flags.DEFINE_integer("batch", 1, "Examples.")
flags.DEFINE_list("degrees", ["1", "2", "4", "8"], "Context-parallel degrees.")
flags.DEFINE_string("out", None, "Also write the results as JSON here.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(max(int(c) for c in FLAGS.degrees)))
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  from microbench.meshes import parallelism as par  # pylint: disable=g-import-not-at-top
  from microbench.models import context  # pylint: disable=g-import-not-at-top

  shape = (FLAGS.batch, FLAGS.seq_len, FLAGS.heads, FLAGS.head_dim)
  rows = []
  for impl in context.IMPLS:
    for c in (int(x) for x in FLAGS.degrees):
      sizes = {a: (c if a == "context" else 1) for a in par.MESH_AXES}
      mesh = jax.sharding.Mesh(np.array(jax.devices()[:c], dtype=object).reshape(tuple(sizes.values())),
                               par.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))
      fn = jax.grad(lambda q, k, v: jnp.sum(context.attention(q, k, v, True, impl)), argnums=(0, 1, 2))
      with jax.set_mesh(mesh), nnx.logical_axis_rules(par.RULES):
        sharding = NamedSharding(mesh, par.spec_for(("batch", "act_seq", "act_heads", "act_head_dim")))
        args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)] * 3
        mem = jax.jit(fn).lower(*args).compile().memory_analysis()
      rows.append({"impl": impl if c > 1 else "none (C=1)", "context": c, "temp_bytes": mem.temp_size_in_bytes})
      print(f"{rows[-1]['impl']:12s} C={c}  temp {mem.temp_size_in_bytes / 2**20:9.2f} MiB per device")
  if FLAGS.out:
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      json.dump({"shape_BTNH": shape, "results": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
