"""one proxy job, one process per GPU (what `run` launches): process 0 appends its records to --records.

  microbench-launch --num_processes=2 -- microbench-study proxy --strategy=fsdp --records=fsdp.jsonl
"""

from __future__ import annotations

import os
import signal

from absl import app, flags

from microbench.cli import cluster_flags
from microbench.cli.study_modes import common
from microbench.cluster import distributed
from microbench.study import workloads

FLAGS = flags.FLAGS

common.define_schedule()
common.define_scales()
common.define_dtype()
common.define_compute()
flags.DEFINE_integer("gpus", None, "Ranks in the job (default: the process count).", lower_bound=1)
flags.DEFINE_integer("iters", None, "Timed iterations (default: the study's runs per strategy; a congestor loops "
                     "until stopped).", lower_bound=1)
flags.DEFINE_integer("warmup", None, "Untimed first iterations (default: the study's, 1).", lower_bound=0)
flags.DEFINE_string("records", None, "The JSONL file process 0 appends its records to (a header, then one line per "
                    "iteration; default: none written).")
flags.DEFINE_string("label", "", "A label copied into the header record.")

# Spellings this mode once had (the dispatcher's refusal names the new one).
RENAMED = {"out": "records"}


def main(argv: list[str]) -> int:
  del argv
  try:
    st = workloads.strategy(FLAGS.strategy)
  except workloads.WorkloadError as e:
    raise app.UsageError(str(e)) from None
  out = open(FLAGS.records, "a", encoding="utf-8") if FLAGS.records else None  # pylint: disable=consider-using-with

  def stop(signum, frame):  # the study's kill sequence: SIGUSR1 ends a job at once, records already flushed
    del signum, frame
    if out:
      out.flush()
    os._exit(0)  # pylint: disable=protected-access
  signal.signal(signal.SIGUSR1, stop)
  distributed.initialize(cluster_flags.settings())
  # JAX only now: the SIGUSR1 handler above must be in place before the slow imports.
  import jax  # pylint: disable=g-import-not-at-top
  from microbench.study import proxy  # pylint: disable=g-import-not-at-top
  job, full = common.schedule(FLAGS.gpus or jax.process_count())
  try:
    iters = FLAGS.iters or (10 ** 9 if FLAGS.congestor else st.runs)  # a congestor loops until stopped
    proxy.run(job, iters=iters, warmup=st.warmup if FLAGS.warmup is None else FLAGS.warmup,
              out=out, compute=FLAGS.compute, dtype=FLAGS.proxy_dtype, label=FLAGS.label, full=full,
              say=common.say)
  except proxy.ProxyError as e:
    raise app.UsageError(str(e)) from None
  finally:
    if out:
      out.close()
  return 0
