"""GPCNeT's congestion impact factor: the canary alone, then beside congestors, with the model's prediction.

  microbench-study gpcnet --machine=testbed --canary=all_reduce:1M@0,2 --congestors=alltoall@1,3 --out=g/
"""

from __future__ import annotations

import sys

from absl import app, flags

from microbench.cli.study_modes import common
from microbench.study import gpcnet, machines

FLAGS = flags.FLAGS
say = common.say

common.define_machine()
common.define_backend()
common.define_scales()
common.define_dtype()
common.define_compute()
flags.DEFINE_string("canary", None, "STRATEGY[:MODEL]@NODES (dp@0,2) or OP:SIZE@NODES (all_reduce:1M@0,2) "
                    "(required).")
flags.DEFINE_multi_string("congestors", None, "KIND[:SIZE]@NODES (alltoall@1,3), repeatable, or KIND[:SIZE],KIND... "
                          "spread over the nodes left free; kinds: alltoall, incast, broadcast, permutation "
                          "(required).")
flags.DEFINE_string("out", None, "The folder for report.md, gpcnet.json and the runs' logs (required).")
flags.DEFINE_float("congestor_seconds", 1.0, "Size unsized congestors so one round alone lasts this long on the "
                   "described links.", lower_bound=1e-3)
flags.DEFINE_bool("measure", True, "Run the canary and congestors (--nomeasure: the prediction only).")
flags.DEFINE_integer("resamples", 2000, "Bootstrap resamples of the impact factors' intervals.", lower_bound=100)
flags.DEFINE_integer("iters", 40, "Timed iterations per run.", lower_bound=1)
flags.DEFINE_integer("warmup", 1, "Untimed first iterations per run.", lower_bound=0)
flags.DEFINE_integer("seed", 42, "Seed of the permutation congestors' pairings.")
flags.DEFINE_float("call_us", 0.0, "The model's fixed cost per collective call on top of the fabric's latencies "
                   "(software: ~10 us for NCCL, ms for gloo on the emulated cluster).", lower_bound=0)
flags.DEFINE_float("walltime", 600, "Seconds a run may take before the kill sequence.", lower_bound=1)


def settings() -> gpcnet.Settings:
  return gpcnet.Settings(out_dir=FLAGS.out, iters=FLAGS.iters, warmup=FLAGS.warmup, dtype=FLAGS.proxy_dtype,
                         compute=FLAGS.compute, bytes_scale=FLAGS.bytes_scale, compute_scale=FLAGS.compute_scale,
                         congestor_seconds=FLAGS.congestor_seconds, seed=FLAGS.seed, call_us=FLAGS.call_us,
                         grace=FLAGS.grace, walltime=FLAGS.walltime, resamples=FLAGS.resamples,
                         backend=FLAGS.backend if FLAGS.measure else "")


def main(argv: list[str]) -> int:
  """The flow model's prediction first (written before anything runs), then the canary alone and beside the
  congestors on --backend; OUT/report.md and OUT/gpcnet.json."""
  del argv
  if not FLAGS.canary or not FLAGS.congestors or not FLAGS.out:
    raise app.UsageError("--canary=SPEC, --congestors=KIND[@NODES] and --out=FOLDER are required, e.g. "
                         "--canary=all_reduce:1M@0,2 --congestors=alltoall@1,3")
  s = settings()
  try:
    machine = machines.parse(FLAGS.machine, FLAGS.node_map)
    canary = gpcnet.parse_canary(FLAGS.canary, machine)
    congs = gpcnet.size_congestors(machine, gpcnet.parse_congestors(FLAGS.congestors, machine, canary), s)
    predicted = gpcnet.prediction(machine, canary, congs, s)
  except (gpcnet.GpcnetError, machines.MachineError) as e:
    raise app.UsageError(str(e)) from None
  command_line = " ".join([common.NAME] + sys.argv[1:])
  say(f"predicted CIF {predicted['cif']:.3f} (canary {predicted['alone_s'] * 1e3:.2f} ms alone, "
      f"{predicted['beside_s'] * 1e3:.2f} ms beside); shared links: {', '.join(predicted['shared_links']) or 'none'}")
  gpcnet.write(FLAGS.out, gpcnet.result(machine, canary, congs, s, predicted, None, command_line))
  if not FLAGS.measure:
    print(gpcnet.markdown(gpcnet.result(machine, canary, congs, s, predicted, None, command_line)))
    return 0
  rc, measured = common.on_backend(machine, lambda backend: gpcnet.measure(machine, canary, congs, s, backend,
                                                                           say=say), "", errors=(gpcnet.GpcnetError,))
  if rc:
    return rc
  try:
    res = gpcnet.result(machine, canary, congs, s, predicted, measured, command_line)
  except ValueError as e:
    say(f"error: {e} (see {FLAGS.out}/logs)")
    return 1
  print(gpcnet.write(FLAGS.out, res))
  return 0
