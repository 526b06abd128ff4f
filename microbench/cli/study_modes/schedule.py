"""a proxy's bytes per iteration and compute, without running it (--proxy_from: beside the hand-written one).

  microbench-study schedule --strategy=fsdp --gpus=16
  microbench-study schedule --proxy_from=llama3-8b,fsdp --gpus=64 [--target=h100]
"""

from __future__ import annotations

import json

from absl import app, flags

from microbench.cli import cluster_flags  # pylint: disable=unused-import  (defines --target)
from microbench.cli.study_modes import common
from microbench.study import rank_programs, workloads

FLAGS = flags.FLAGS

common.define_schedule()
common.define_scales()
common.define_dtype()
flags.DEFINE_integer("gpus", 8, "Ranks in the job.", lower_bound=1)


def main(argv: list[str]) -> int:
  """Bytes per iteration of a proxy (and, with --proxy_from, of the hand-written one for the same strategy,
  with the difference), without running anything; --proxy_from compiles the step on virtual CPU devices, or
  with --target for that GPU kind's compile-only devices (XLA:GPU's HLO: what the GPUs would move)."""
  del argv
  gpus = FLAGS.gpus
  job, full = common.schedule(gpus, _devices(gpus))
  full = full or job  # a congestor or point has no full-scale version: it is what runs
  out = {"proxy": _describe(full, gpus)}
  if FLAGS.proxy_from:
    from microbench.study import step_collectives  # pylint: disable=g-import-not-at-top  (imports JAX)
    strategy = step_collectives.parse_proxy_from(FLAGS.proxy_from)[2]
    try:
      hand = rank_programs.build(strategy, gpus, FLAGS.gpu, FLAGS.model)
    except workloads.WorkloadError as e:
      raise app.UsageError(str(e)) from None
    out["hand_written"] = _describe(hand, gpus)
    out["comparison"] = step_collectives.compare(hand, full)
    out["comparison"]["derived"].pop("meta")
  print(json.dumps(out, indent=1, default=str))
  return 0


def _describe(job, gpus: int) -> dict:
  rows = []
  for r in sorted({0, gpus - 1}):
    per = rank_programs.bytes_per_iteration(job, r)
    rows.append({"rank": r, "bytes_per_iteration": per, "total_bytes": sum(per.values()),
                 "compute_s": rank_programs.compute_seconds(job, r)})
  return {"schedule": job.name, "gpus": gpus, "meta": job.meta, "ranks": rows}


def _devices(gpus: int) -> list | None:
  """The devices --proxy_from's step compiles for: --target's compile-only ones, or virtual CPU devices; None
  for a hand-written schedule (nothing compiles). JAX is imported only here: a hand-written one needs none."""
  if FLAGS.target:
    if not FLAGS.proxy_from:
      raise app.UsageError("--target compiles the training step of --proxy_from=MODEL,STRATEGY for the GPU kind;"
                           " a hand-written proxy has nothing to compile")
    if FLAGS["gpu"].present and FLAGS.gpu.strip().lower() != FLAGS.target.strip().lower():
      raise app.UsageError(f"--gpu={FLAGS.gpu} contradicts --target={FLAGS.target}: the roofline times the"
                           " target's own GPU; drop --gpu (or give the same kind)")
    return _target_devices(FLAGS.target, gpus)
  if not FLAGS.proxy_from:
    return None
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
  from microbench.meshes.topology import Topology  # pylint: disable=g-import-not-at-top
  machine.prepare_cpu_devices(Topology(1, 1, gpus), False)
  import jax  # pylint: disable=g-import-not-at-top
  if len(jax.devices()) < gpus:
    raise app.UsageError(f"--gpus={gpus} but only {len(jax.devices())} devices here (JAX_NUM_CPU_DEVICES)")
  return jax.devices()[:gpus]


def _target_devices(kind: str, gpus: int) -> list:
  """`gpus` compile-only devices of GPU kind `kind`, in hosts of the kind's usual node size; for a TPU kind,
  `gpus` chips as the most cube-like slice its hosts tile (64 v5p chips: 4x4x4), in the pod's mesh order."""
  from microbench.aot import gpu_compile  # pylint: disable=g-import-not-at-top
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
  from microbench.fabric import gpu_kinds  # pylint: disable=g-import-not-at-top
  if machine.is_tpu_target(kind):
    from microbench.aot import tpu_compile  # pylint: disable=g-import-not-at-top
    from microbench.fabric import tpu_kinds  # pylint: disable=g-import-not-at-top
    from microbench.meshes import tpu_slice  # pylint: disable=g-import-not-at-top
    try:
      target = tpu_compile.make_target(kind, tpu_compile.slice_for(tpu_kinds.target(kind), gpus))
      return tpu_slice.slices_from_devices(target.devices)[1]
    except (tpu_compile.TargetError, tpu_kinds.KindError, tpu_slice.SliceError) as e:
      raise app.UsageError(str(e)) from None
  try:
    per_host = min(gpus, gpu_kinds.target(kind).gpus_per_node)
    if gpus % per_host:
      raise app.UsageError(f"--gpus={gpus} is not a whole number of {kind} nodes of {per_host} GPUs")
    return list(gpu_compile.make_target(kind, gpus // per_host, per_host).devices)
  except (gpu_compile.TargetError, gpu_compile.KindError) as e:
    raise app.UsageError(str(e)) from None
