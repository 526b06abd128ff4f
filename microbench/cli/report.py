"""microbench-report: plots, tables, comparisons and alpha-beta fits from finished run folders (flags only;
the work is in microbench.report)."""

from __future__ import annotations

import datetime
import os

from absl import app, flags

from microbench.bench import sizes
from microbench.cli import runner

FLAGS = flags.FLAGS

flags.DEFINE_string("out", None, "Report folder. Default: RUN_DIR/report for one run, report_<UTC time> for"
                    " several.")
flags.DEFINE_list("predict", [], "Message sizes (8, 64K, 32M, 1G) to predict each series' time for from its"
                  " alpha-beta fit: printed and added to the report.")


def main(argv: list[str]) -> int:
  paths = argv[1:]
  if not paths:
    raise app.UsageError("give one or more run folders: microbench-report RUN_DIR [RUN_DIR ...] [--out=DIR]")
  predict = []
  for text in FLAGS.predict:
    try:
      size = -1 if text.strip().startswith("-") else sizes.parse_size(text)
    except ValueError as e:
      raise app.UsageError(f"--predict: {e}") from None
    if size <= 0:  # a time for no bytes (or fewer) is not a prediction of anything measured
      raise app.UsageError(f"--predict: {text.strip()} is not a positive size; give bytes above 0 (8, 64K, 1G)")
    predict.append(size)
  try:
    import matplotlib  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise app.UsageError("the report draws with matplotlib, which is not installed:"
                         " pip install -e '.[report]'") from None
  from microbench.report import build, runs  # pylint: disable=g-import-not-at-top

  try:
    found = runs.expand(paths)
  except runs.RunError as e:
    raise app.UsageError(str(e)) from None
  out = FLAGS.out or (os.path.join(found[0], "report") if len(found) == 1 else
                      "report_" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S"))
  try:
    report = build.build(found, out, predict)
  except runs.RunError as e:
    raise app.UsageError(str(e)) from None
  except OSError as e:
    raise app.UsageError(f"{e.filename or out}: {e.strerror or e}") from None
  print(f"microbench-report: {len(report.sweeps)} sweep(s), {len(report.trains)} training run(s);"
        f" wrote {build.REPORT} and {len(report.figures)} figure(s) to {os.path.abspath(out)}")
  if predict:
    from microbench.report import tables  # pylint: disable=g-import-not-at-top
    print(tables.markdown(build.PREDICT_HEADERS, report.predictions))
  return 0


def run() -> None:
  """Console-script entry point."""
  runner.run(main, "microbench-report", [__name__])


if __name__ == "__main__":
  run()
