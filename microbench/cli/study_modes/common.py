"""What several of `microbench-study`'s modes share: groups of flags (defined when a mode calls its `define_*`,
so a mode lists only the groups it uses) and the helpers that read them.

microbench/cli/study.py finds which mode owns a flag by reading the modes' sources (a `define_*` call here
counts as the mode's), so keep each flag's DEFINE call literal: `flags.DEFINE_x("name", ...)`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from absl import app, flags

from microbench.cluster import launch
from microbench.cluster import testbed as tbm
from microbench.study import backends, congestors, predict, rank_programs, workloads

FLAGS = flags.FLAGS
NAME = "microbench-study"


def say(msg: str) -> None:
  print(f"{NAME}: {msg}", file=sys.stderr, flush=True)


def define_scales() -> None:
  """Rehearsal scales: every mode that times or predicts a proxy multiplies by them."""
  flags.DEFINE_float("compute_scale", 1.0, "Multiply every emulated compute time (rehearsals: < 1).", lower_bound=0)
  flags.DEFINE_float("bytes_scale", 1.0, "Multiply every message size (rehearsals on slow networks: < 1).",
                     lower_bound=0)


def define_dtype() -> None:
  flags.DEFINE_enum("proxy_dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Element type of the proxy's"
                    " buffers.")


def define_compute() -> None:
  """How a running proxy emulates compute (modes that start proxies)."""
  flags.DEFINE_enum("compute", "sleep", ["sleep", "busy"], "Emulated compute: the host waits (sleep: no CPU used, "
                    "collectives overlap) or a calibrated device kernel runs (busy).")


def define_machine() -> None:
  """The machine a mix is laid out on (plan, place, gpcnet)."""
  flags.DEFINE_string("machine", "testbed", "leonardo, lumi, alps, jupiter, dgx, testbed or custom, with options: "
                      "leonardo:nodes=64; testbed:racks=4,hosts_per_rack=2,gpus_per_node=1,groups=1,"
                      "host_rate=400mbit,uplink_rate=100mbit; custom:gpus_per_node=4,nodes_per_l1=10,l1_per_group=18,"
                      "nodes=64,gpu=H100.")
  flags.DEFINE_string("node_map", None, "File of `hostname group l1` lines describing the allocation's nodes.")


def define_backend() -> None:
  """Where jobs run, and how a unit's kill sequence ends them (run, gpcnet)."""
  flags.DEFINE_enum("backend", "local", ["local", "testbed", "slurm"], "Where jobs run: local processes, the "
                    "emulated cluster (root; built for the plan's testbed machine unless --testbed_id), or srun steps "
                    "inside the current SLURM allocation.")
  flags.DEFINE_string("testbed_id", None, "--backend=testbed: use this running testbed instead of building one.")
  flags.DEFINE_string("srun_args", "", "--backend=slurm: extra srun arguments (Alps: --mpi=cray_shasta "
                      "--accel-bind=g).")
  flags.DEFINE_string("slurm_gpu_flag", "--gres=gpu:{n}", "--backend=slurm: how a step asks for its GPUs per node "
                      "({n}); empty: ask for none.")
  flags.DEFINE_float("grace", 30, "Seconds between SIGUSR1 and SIGKILL in the kill sequence.", lower_bound=0)


def define_schedule() -> None:
  """What one proxy job replays: a strategy's schedule, one derived from a training step, a congestor or a
  point (proxy, schedule)."""
  flags.DEFINE_string("strategy", "dp", "dp, fsdp, dp+pp, dp+pp+tp or dp+pp+ep.")
  flags.DEFINE_string("model", None, "The proxy's model shape (default: the study's for the strategy: vit-h, "
                      "llama3-8b, minerva-7b, llama3-70b, mixtral-8x7b).")
  flags.DEFINE_string("gpu", "A100", "GPU whose roofline times the emulated compute: "
                      f"{', '.join(workloads.GPUS)} (the GPU kinds' peaks; MI250X and GB300 as the seed study).")
  flags.DEFINE_string("proxy_from", None, "MODEL,STRATEGY (e.g. llama3-8b,fsdp or gpt2-tiny,dp): take the "
                      "collective schedule from the compiled HLO of microbench-train's step instead.")
  flags.DEFINE_integer("batch", None, "--proxy_from: global batch of the training step (default 16 per data rank).",
                       lower_bound=1)
  flags.DEFINE_integer("seq_len", None, "--proxy_from: tokens per example (default: the model's context).",
                       lower_bound=1)
  flags.DEFINE_integer("layers", None, "--proxy_from: override the model's depth.", lower_bound=1)
  flags.DEFINE_string("congestor", None, "Run a congestor instead of a strategy: alltoall, incast, broadcast or "
                      "permutation (one round per iteration, --message_bytes per rank; --seed for permutation).")
  flags.DEFINE_string("point", None, "Run one collective point instead of a strategy: all_reduce, all_gather, "
                      "reduce_scatter or all_to_all of --message_bytes.")
  flags.DEFINE_string("message_bytes", None, "--congestor/--point: message size per rank (bytes, or 4M, 512K).")
  flags.DEFINE_integer("seed", 42, "Seed of --congestor=permutation's pairing.")


def roofline_gpu() -> str:
  """The GPU whose roofline times the compute: --gpu, or with --target (and no --gpu) the target's kind (the
  caller's mode imports cluster_flags, which defines --target)."""
  if FLAGS.target and not FLAGS["gpu"].present:
    return FLAGS.target.strip().upper()
  return FLAGS.gpu


def schedule(gpus: int, devices: list | None = None) -> tuple:
  """The job's schedule (hand-written, derived from --proxy_from, a congestor or a point) and its unscaled
  version (None for a congestor or a point: what runs is all there is)."""
  if FLAGS.congestor or FLAGS.point:
    if FLAGS.congestor and FLAGS.point or FLAGS.proxy_from:
      raise app.UsageError("--congestor, --point and --proxy_from each choose the proxy's schedule: give one")
    if not FLAGS.message_bytes:
      raise app.UsageError("--congestor and --point need --message_bytes (e.g. 4M)")
    eb = predict.ELEMENT_BYTES[FLAGS.proxy_dtype]
    try:
      size = congestors.parse_size(FLAGS.message_bytes)
      job = (congestors.build(FLAGS.congestor, gpus, size, eb, FLAGS.seed) if FLAGS.congestor
             else congestors.point(FLAGS.point, gpus, size, eb))
    except congestors.CongestorError as e:
      raise app.UsageError(str(e)) from None
    return job, None
  try:
    if FLAGS.proxy_from:
      from microbench.study import step_collectives  # pylint: disable=g-import-not-at-top  (imports JAX)
      full = step_collectives.derive(FLAGS.proxy_from, gpus, gpu=roofline_gpu(), batch=FLAGS.batch,
                                    seq_len=FLAGS.seq_len, layers=FLAGS.layers, devices=devices)
    else:
      full = rank_programs.build(FLAGS.strategy, gpus, FLAGS.gpu, FLAGS.model)
  except (workloads.WorkloadError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  return full.scaled(FLAGS.bytes_scale, FLAGS.compute_scale), full


def on_backend(machine, work: Callable, interrupted: str, errors: tuple = ()) -> tuple[int, object]:
  """(exit code, work(backend)) on the --backend for `machine`, opened and then closed whatever happens; a
  backend's failure is one line and exit 1, an interrupt exit 128 + signal (`interrupted` says what resumes)."""
  try:
    backend = backends.make(FLAGS.backend, machine, testbed_id=FLAGS.testbed_id, srun_args=FLAGS.srun_args,
                            gpu_flag=FLAGS.slurm_gpu_flag, say=say)
  except backends.BackendError as e:
    raise app.UsageError(str(e)) from None
  launch.install_signal_handlers()
  try:
    backend.open()
    return 0, work(backend)
  except (backends.BackendError, tbm.TestbedError, *errors) as e:
    say(f"error: {e}")
    return 1, None
  except launch.Interrupted as e:
    say(f"interrupted ({e}){interrupted}")
    return 128 + e.signum, None
  finally:
    backend.close()
