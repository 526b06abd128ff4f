"""`microbench-study`: the multi-tenancy interference study (flags only; the work is in microbench.study).

  microbench-study plan   --machine=leonardo --patterns=A,E --out=plan/          # job mixes, one JSON each
  microbench-study run    --plan=plan/ --backend=testbed|local|slurm --out=res/   # baselines + concurrent runs
  microbench-study report --results=res/                                          # sigma, CIs, PNGs, Markdown
  microbench-study proxy  --strategy=fsdp --gpus=16 ...   # one proxy job (what `run` launches; one process per GPU)
  microbench-study schedule --strategy=fsdp --gpus=16 [--proxy_from=llama3-8b,fsdp]  # bytes per iteration
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from absl import app, flags

from microbench.cli import cluster_flags, runner

FLAGS = flags.FLAGS
NAME = "microbench-study"
MODES = ("plan", "run", "report", "proxy", "schedule")

# --- proxy / schedule
flags.DEFINE_string("strategy", "dp", "proxy/schedule: dp, fsdp, dp+pp, dp+pp+tp or dp+pp+ep.")
flags.DEFINE_string("model", None, "proxy/schedule: the proxy's model shape (default: the study's for the "
                    "strategy: vit-h, llama3-8b, minerva-7b, llama3-70b, mixtral-8x7b).")
flags.DEFINE_string("gpu", "A100", "GPU whose roofline times the emulated compute: A100, H100, H200, GH200, "
                    "B200, B300, GB300, MI250X.")
flags.DEFINE_integer("gpus", None, "proxy/schedule: ranks in the job (proxy default: the process count).",
                     lower_bound=1)
flags.DEFINE_string("proxy_from", None, "proxy/schedule: MODEL,STRATEGY (e.g. llama3-8b,fsdp or gpt2-tiny,dp): "
                    "take the collective schedule from the compiled HLO of microbench-train's step instead.")
flags.DEFINE_integer("batch", None, "proxy_from: global batch of the training step (default 16 per data rank).",
                     lower_bound=1)
flags.DEFINE_integer("seq_len", None, "proxy_from: tokens per example (default: the model's context).",
                     lower_bound=1)
flags.DEFINE_integer("layers", None, "proxy_from: override the model's depth.", lower_bound=1)
flags.DEFINE_integer("iters", None, "proxy: timed iterations (default: the study's runs per strategy).",
                     lower_bound=1)
flags.DEFINE_integer("warmup", None, "proxy: untimed first iterations (default: the study's, 1).", lower_bound=0)
flags.DEFINE_enum("compute", "sleep", ["sleep", "busy"], "Emulated compute: the host waits (sleep: no CPU used, "
                  "collectives overlap) or a calibrated device kernel runs (busy).")
flags.DEFINE_float("compute_scale", 1.0, "Multiply every emulated compute time (rehearsals: < 1).", lower_bound=0)
flags.DEFINE_float("bytes_scale", 1.0, "Multiply every message size (rehearsals on slow networks: < 1).",
                   lower_bound=0)
flags.DEFINE_string("proxy_dtype", "bfloat16", "Element type of the proxy's buffers: bfloat16, float16, float32.")
flags.DEFINE_string("out", None, "proxy: JSONL records (process 0). plan: plan folder. run: results folder.")
flags.DEFINE_string("label", "", "proxy: a label copied into the header record.")


def say(msg: str) -> None:
  print(f"{NAME}: {msg}", file=sys.stderr, flush=True)


def _schedule(gpus: int):
  """The job's schedule (hand-written or derived) and its unscaled version."""
  from microbench.study import schedules, workloads  # pylint: disable=g-import-not-at-top
  try:
    if FLAGS.proxy_from:
      from microbench.study import hlo_schedule  # pylint: disable=g-import-not-at-top
      full = hlo_schedule.derive(FLAGS.proxy_from, gpus, gpu=FLAGS.gpu, batch=FLAGS.batch, seq_len=FLAGS.seq_len,
                                 layers=FLAGS.layers)
    else:
      full = schedules.build(FLAGS.strategy, gpus, FLAGS.gpu, FLAGS.model)
  except (workloads.WorkloadError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  return full.scaled(FLAGS.bytes_scale, FLAGS.compute_scale), full


def _proxy() -> int:
  from microbench.cluster import distributed  # pylint: disable=g-import-not-at-top
  from microbench.study import workloads  # pylint: disable=g-import-not-at-top
  try:
    st = workloads.strategy(FLAGS.strategy)
  except workloads.WorkloadError as e:
    raise app.UsageError(str(e)) from None
  if FLAGS.proxy_dtype not in ("bfloat16", "float16", "float32"):
    raise app.UsageError(f"--proxy_dtype={FLAGS.proxy_dtype}: choose bfloat16, float16 or float32")
  out = open(FLAGS.out, "a", encoding="utf-8") if FLAGS.out else None  # pylint: disable=consider-using-with

  def stop(signum, frame):  # the study's kill sequence: SIGUSR1 ends a job at once, records already flushed
    del signum, frame
    if out:
      out.flush()
    os._exit(0)  # pylint: disable=protected-access
  signal.signal(signal.SIGUSR1, stop)
  distributed.initialize(cluster_flags.settings())
  import jax  # pylint: disable=g-import-not-at-top
  from microbench.study import proxy  # pylint: disable=g-import-not-at-top
  job, full = _schedule(FLAGS.gpus or jax.process_count())
  try:
    proxy.run(job, iters=FLAGS.iters or st.runs, warmup=st.warmup if FLAGS.warmup is None else FLAGS.warmup,
              out=out, compute=FLAGS.compute, dtype=FLAGS.proxy_dtype, label=FLAGS.label, full=full,
              say=lambda m: say(m))
  except proxy.ProxyError as e:
    raise app.UsageError(str(e)) from None
  finally:
    if out:
      out.close()
  return 0


def _schedule_report() -> int:
  from microbench.study import schedules  # pylint: disable=g-import-not-at-top
  gpus = FLAGS.gpus or 8
  _, full = _schedule(gpus)
  rows = []
  for r in sorted({0, gpus - 1}):
    per = schedules.bytes_per_iteration(full, r)
    rows.append({"rank": r, "bytes_per_iteration": per, "total_bytes": sum(per.values()),
                 "compute_s": schedules.compute_seconds(full, r)})
  print(json.dumps({"schedule": full.name, "gpus": gpus, "meta": full.meta, "ranks": rows}, indent=1))
  return 0


def main(argv: list[str]) -> int:
  args = argv[1:]
  mode = args.pop(0) if args and args[0] in MODES else None
  if mode is None or args:
    raise app.UsageError(f"want one mode of {', '.join(MODES)} (got {argv[1:] or 'none'}); see --help")
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  return {"proxy": _proxy, "schedule": _schedule_report}[mode]()


def run() -> None:
  """Console-script entry point."""
  runner.run(main, NAME, [__name__, cluster_flags.__name__])


if __name__ == "__main__":
  run()
