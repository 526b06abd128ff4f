"""sigma of every job of a plan from the fabric model, before anything runs.

  microbench-study predict --plan=plan/ --out=res/ [--fit_from=runs/nics,runs/uplinks]
"""

from __future__ import annotations

from absl import app, flags

from microbench.cli.study_modes import common
from microbench.study import machines, predict, run_plan

FLAGS = flags.FLAGS
say = common.say

common.define_scales()
common.define_dtype()
flags.DEFINE_string("plan", None, "The plan folder written by `plan` (required).")
flags.DEFINE_string("out", None, "The results folder (required; the one `run` fills).")
flags.DEFINE_list("fit_from", [], "Sweep run folders whose alpha-beta fits replace the machine's link rates and hop"
                  " latencies, level by level (microbench-report --fit_from does the same).")
flags.DEFINE_float("call_us", 0.0, "A fixed cost per collective call on top of the fabric's latencies (software: "
                   "~10 us for NCCL, ms for gloo on the emulated cluster).", lower_bound=0)


def main(argv: list[str]) -> int:
  del argv
  if not FLAGS.plan or not FLAGS.out:
    raise app.UsageError("--plan=PLAN_FOLDER and --out=RESULTS_FOLDER are required (the folder `run` fills)")
  try:
    pred = predict.predict(FLAGS.plan, FLAGS.bytes_scale, FLAGS.compute_scale, FLAGS.proxy_dtype,
                           call_us=FLAGS.call_us, fit_from=FLAGS.fit_from, say=say)
  except (run_plan.RunError, machines.MachineError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  path = predict.write(FLAGS.out, pred)
  print("\n".join(predict.table(pred)))
  for line in predict.key_notes(pred):
    say(line)
  say(f"predicted sigma for {len(pred['keys'])} key(s) -> {path}; `run --out={FLAGS.out}` measures them")
  return 0
