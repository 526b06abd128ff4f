"""sigma with confidence intervals from a results folder: Markdown, JSON, PNGs.

  microbench-study report --results=res/ [--report_dir=DIR] [--noplots]
"""

from __future__ import annotations

import os

from absl import app, flags

from microbench.cli.study_modes import common
from microbench.study import run_plan, sigma_report

FLAGS = flags.FLAGS

flags.DEFINE_string("results", None, "The results folder written by `run` (required).")
flags.DEFINE_string("report_dir", None, "Where to write (default RESULTS/report).")
flags.DEFINE_integer("drop_first", 1, "Timed iterations dropped at the start of every run (the study's parser "
                     "drops 1).", lower_bound=0)
flags.DEFINE_bool("plots", True, "Write the PNGs (needs matplotlib, the `report` extra).")


def main(argv: list[str]) -> int:
  del argv
  if not FLAGS.results:
    raise app.UsageError("--results=RESULTS_FOLDER is required")
  if not os.path.exists(os.path.join(FLAGS.results, run_plan.UNITS_FILE)):
    raise app.UsageError(f"{FLAGS.results} holds no finished unit (no units.jsonl): run the study first")
  out = sigma_report.build(FLAGS.results, FLAGS.report_dir, FLAGS.drop_first, FLAGS.plots, say=common.say)
  print(out["markdown"])
  return 0
