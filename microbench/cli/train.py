"""microbench-train: Flax training throughput under DP/FSDP/TP/PP/EP/CP and the study's presets (flags only; the
work is in microbench.train, the presets in microbench.study.presets)."""

from __future__ import annotations

import dataclasses
import logging
import os

from absl import app, flags

from microbench.cli import absl_app, cluster_flags, store_flags
from microbench.output.train_log import METRICS_FILE
from microbench.cluster import distributed
from microbench.study import presets
from microbench.models import FAMILIES
from microbench.models.layers import REMAT_POLICIES

FLAGS = flags.FLAGS
# Registered under the library's name (cli_runner makes --help list them).
_M = {"module_name": "microbench.train"}

flags.DEFINE_string("model", "gpt2", f"Model family: {', '.join(FAMILIES)}.", **_M)
flags.DEFINE_string("size", None, "Size: " + "; ".join(f"{m}: {', '.join(s)}" for m, s in FAMILIES.items())
                    + ". Default: gpt2 124m, llama3 8b, vit h14, resnet 50, mixtral 8x7b, minerva 7b.", **_M)
flags.DEFINE_integer("layers", None, "Override the size's layer count (run big shapes at small depth).", **_M)
flags.DEFINE_string("parallelism", None, "Degrees, e.g. dp:2,fsdp:2,tp:2 (omitted ones are 1; the product is"
                    " the device count). Default: dp over every device. On CPU without JAX_NUM_CPU_DEVICES,"
                    " that many CPU devices are emulated.", **_M)
flags.DEFINE_string("placement", "tp_inner", "Mesh axis order on the machine: tp_inner (tensor inside a node,"
                    " data/fsdp across nodes), tp_outer, or a comma list of mesh axes, outermost first.", **_M)
flags.DEFINE_integer("batch", 8, "Global batch (examples per step).", **_M)
flags.DEFINE_integer("seq_len", None, "Tokens per example (language models). Default: the model's context.",
                     **_M)
flags.DEFINE_integer("steps", 10, "Training steps, warm-up included.", **_M)
flags.DEFINE_integer("warmup_steps", 2, "First steps left out of the summary.", **_M)
flags.DEFINE_string("dtype", "float32", "Compute dtype: float32 or bfloat16 (parameters stay float32).", **_M)
flags.DEFINE_float("learning_rate", 3e-4, "AdamW learning rate (constant).", **_M)
flags.DEFINE_float("clip_norm", 1.0, "Clip the gradients to this global norm before AdamW (0: no clipping).",
                   **_M)
flags.DEFINE_integer("grad_accum", 1, "Microbatches per step: the global batch is split into this many,"
                     " gradients are accumulated (float32) inside the step.", **_M)
flags.DEFINE_string("remat", "dots_with_no_batch_dims_saveable",
                    f"What each transformer block keeps for the backward pass, one of {', '.join(REMAT_POLICIES)}"
                    " (the rest is recomputed). none: everything but the gathered weights; full: only the"
                    " block's input; dots_saveable: every matmul output; dots_with_no_batch_dims_saveable: the"
                    " projections' outputs (attention recomputed); save_qkv_attention: QKV and the attention"
                    " output (MLP recomputed).", **_M)
flags.DEFINE_bool("scan_layers", True, "Run the transformer blocks under a scan (one block in the program,"
                  " compile time flat in depth); --noscan_layers unrolls them.", **_M)
flags.DEFINE_string("attention", "auto", "Attention kernel: auto (cuDNN's fused flash attention on NVIDIA GPUs"
                    " where it applies, XLA elsewhere), xla, or cudnn.", **_M)
flags.DEFINE_bool("compile_only", False, "Compile the step for the mesh and report memory per device, FLOPs"
                  " and the communication fingerprint without running it.", **_M)
flags.DEFINE_integer("seed", 0, "Seed of the parameters and the synthetic data.", **_M)
flags.DEFINE_float("capacity_factor", None, "Mixture of experts: slots per expert = ceil(factor x tokens x"
                   " top-k / experts) per routing group; tokens past it are dropped (counted). <= 0: never drop."
                   " Default: the model's (1.25).", **_M)
flags.DEFINE_string("moe_dispatch", None, "Mixture of experts: how tokens reach their experts: auto (XLA's"
                    " ragged all-to-all on GPU, the capacity-padded all-to-all elsewhere), all_to_all or"
                    " ragged_all_to_all.", **_M)
flags.DEFINE_string("preset", None, "The multi-tenancy study's strategies as training runs: study-dp (ViT-H,"
                    " DP), study-fsdp (Llama-3-8B, FSDP over min(g,8)), study-dp-pp (Minerva-7B, PP S=2 up to 8"
                    " devices else 8), study-dp-pp-tp (Llama-3-70B, S=8, M=16, TP=4), study-dp-pp-ep (Mixtral-8x7B,"
                    " S=8, M=16, EP=8). Sets model, shape, degrees, microbatches, schedule and batch, scaled to"
                    " the devices present (printed); flags given explicitly win.", **_M)
flags.DEFINE_integer("microbatches", None, "Pipeline parallelism: microbatches per step (default: the stage"
                     " count); the global batch must divide into microbatches x batch shards.", **_M)
flags.DEFINE_string("schedule", None, "Pipeline parallelism: gpipe, 1f1b (default) or interleaved (with"
                    " --virtual_stages).", **_M)
flags.DEFINE_integer("virtual_stages", 1, "Pipeline parallelism, --schedule=interleaved: layer chunks per"
                     " stage (the stages x virtual stages must divide the layers).", **_M)
flags.DEFINE_string("context_impl", "ring", "Context parallelism: ring (K/V passed round the ring, online"
                    " softmax) or all_to_all (DeepSpeed-Ulysses: heads re-split over the context axis).", **_M)
flags.DEFINE_bool("measure_overheads", True, "After the timed steps, time the forward+backward without the"
                  " pipeline bubble (pp) and without the MoE token exchange (ep), alternating with the real"
                  " one, and report each overhead's share.", **_M)
flags.DEFINE_string("outdir", None, "Run folder (JSONL, TensorBoard, profile). Default:"
                    " runs/train/<model>-<size>_<parallelism>_<UTC time>.", **_M)
flags.DEFINE_integer("profile_steps", 0, "Trace this many extra steps after the timed ones with"
                     " jax.profiler into the run folder (TensorBoard's Profile tab).", **_M)
flags.DEFINE_string("topology", None, "Machine shape racks:R,nodes:N,gpus:G (a TPU --target: its slice, e.g."
                    " 4x4x4 or 16x16, and slices:S for several). Default: from the processes' hosts (a TPU target:"
                    " one host's chips).", **_M)
flags.DEFINE_string("xla_perf_table", None, "With a GPU --target: compile the step with this collective"
                    " performance table (microbench-report --xla_perf_table writes one from sweeps) and say what it"
                    " changed in the schedule: each collective's async windows against --xla_perf_table_baseline's;"
                    " a table XLA cannot use (wrong device key, unreadable) is named.", **_M)
flags.DEFINE_string("xla_perf_table_baseline", None, "With --xla_perf_table: the table the schedule is compared"
                    " against (default: XLA's built-in table).", **_M)

# What only a run does (processes, timed and traced steps): refused with --target, which compiles only.
RUN_ONLY_FLAGS = (*cluster_flags.JOB_FLAGS, "steps", "warmup_steps", "profile_steps")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  from microbench import train  # pylint: disable=g-import-not-at-top
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
  from microbench.train.config import TARGET_ERRORS  # pylint: disable=g-import-not-at-top
  from microbench.train.loop import default_run_dir  # pylint: disable=g-import-not-at-top

  cfg = train.TrainConfig(
      model=FLAGS.model, size=FLAGS.size, layers=FLAGS.layers, parallelism=FLAGS.parallelism,
      placement=FLAGS.placement, batch=FLAGS.batch, seq_len=FLAGS.seq_len, steps=FLAGS.steps,
      warmup_steps=FLAGS.warmup_steps, dtype=FLAGS.dtype, learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
      clip_norm=FLAGS.clip_norm, grad_accum=FLAGS.grad_accum, remat=FLAGS.remat, scan_layers=FLAGS.scan_layers,
      attention=FLAGS.attention, compile_only=FLAGS.compile_only,
      capacity_factor=FLAGS.capacity_factor, moe_dispatch=FLAGS.moe_dispatch,
      microbatches=FLAGS.microbatches, schedule=FLAGS.schedule, virtual_stages=FLAGS.virtual_stages,
      context_impl=FLAGS.context_impl, measure_overheads=FLAGS.measure_overheads, preset=FLAGS.preset,
      outdir=FLAGS.outdir, profile_steps=FLAGS.profile_steps, topology=FLAGS.topology,
      nodes_per_rack=FLAGS.nodes_per_rack, target=FLAGS.target, xla_perf_table=FLAGS.xla_perf_table,
      xla_perf_table_baseline=FLAGS.xla_perf_table_baseline)
  cluster_flags.refuse_with_target(RUN_ONLY_FLAGS)
  try:
    if FLAGS.preset is None:
      train.check_request(cfg)  # before any device is touched
    elif FLAGS.preset not in presets.PRESETS:
      raise train.ConfigError(f"unknown --preset={FLAGS.preset!r}; choose one of {', '.join(presets.PRESETS)}")
    if not FLAGS.target:  # compile-only devices need no processes and no CPU emulation
      distributed.initialize(cluster_flags.settings())
      machine.prepare_cpu_devices(train.cpu_devices_wanted(cfg), FLAGS.distributed)
    if FLAGS.preset is not None:
      cfg = _with_preset(cfg)
      train.check_request(cfg)
    cfg = dataclasses.replace(cfg, outdir=cfg.outdir or default_run_dir(cfg))
    _say_table_verdicts(cfg)
    result = train.run(cfg)
    _say_table_effect(result.summary.get("xla_perf_table") if result.summary else None)
  except (train.ConfigError, presets.PresetError, machine.TopologyError, *TARGET_ERRORS) as e:
    raise app.UsageError(str(e)) from None
  finally:
    if cfg.outdir and os.path.exists(os.path.join(cfg.outdir, METRICS_FILE)):
      store_flags.record(cfg.outdir)  # finished or stopped: what it measured is kept


def _with_preset(cfg):
  """The request with the preset's fields for the devices present (flags given explicitly kept)."""

  import jax  # pylint: disable=g-import-not-at-top

  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top

  explicit = {name: FLAGS[name].value for name in presets.FIELDS if FLAGS[name].present}
  if FLAGS.target:  # the target's devices: a GPU or TPU platform with the kind's memory
    topology, target, _, _ = machine.resolve_target(
        FLAGS.target, machine.parse_target_topology(FLAGS.target, FLAGS.topology), FLAGS.nodes_per_rack)
    count = topology.num_devices
    platform, memory = "tpu" if machine.is_tpu_target(FLAGS.target) else "gpu", target.memory_bytes
  else:
    device = jax.devices()[0]
    count, platform, memory = jax.device_count(), device.platform, machine.device_memory(device)
  fields, note = presets.resolve(FLAGS.preset, count, platform, memory, explicit)
  return dataclasses.replace(cfg, **fields, preset_note=note)

def _say_table_verdicts(cfg) -> None:
  """What XLA will do with the table(s) given, before the compile (XLA itself says nothing)."""
  if not cfg.xla_perf_table:
    return
  from microbench.fabric import gpu_kinds  # pylint: disable=g-import-not-at-top
  from microbench.tuning import xla_perf_table, xla_table_check  # pylint: disable=g-import-not-at-top
  kind = gpu_kinds.target(cfg.target)
  key = xla_perf_table.device_key(kind.device_kind)
  for path in (cfg.xla_perf_table, cfg.xla_perf_table_baseline):
    if path and path != "builtin":
      v = xla_table_check.check(path, key, kind.gpus_per_node)
      for line in v.fatal + v.notes:
        print(f"microbench-train: {line}")
      if v.used:
        print(f"microbench-train: {path}: {v.entries} entries for {key} ({', '.join(v.kinds)})")


def _say_table_effect(effect) -> None:
  if not effect:
    return
  for line in effect["lines"]:
    print(f"microbench-train: {line}")
  if effect["same_schedule"] and effect["windows"]:
    print(f"microbench-train: XLA compiled the same schedule with {effect['table']} as with the"
          f" {effect['baseline']} table: it did not read it (see the lines above), or its times agree with it")



def run() -> None:
  """Console-script entry point."""
  absl_app.run(main, "microbench-train", ["microbench.train", cluster_flags.__name__, store_flags.__name__])


if __name__ == "__main__":
  run()

