"""`microbench-report RUN... --nccl_tuner_conf=OUT`: NCCL's example tuner plugin's config from one sweep run
under several NCCL settings (docs/tuning.md)."""

from __future__ import annotations

import os

from absl import app

from microbench.cli.report_modes import common

FLAGS = common.FLAGS


def main(paths: list[str]) -> int:
  if not paths:
    raise app.UsageError("give the runs of one sweep under several NCCL settings (or the folder microbench"
                         " --nccl_env wrote): microbench-report RUN... --nccl_tuner_conf=OUT")
  from microbench.cluster import nccl_settings  # pylint: disable=import-outside-toplevel
  from microbench.report import runs  # pylint: disable=import-outside-toplevel
  from microbench.tuning import nccl_tuner  # pylint: disable=import-outside-toplevel
  try:
    arms = nccl_tuner.arms(paths)
    bands = nccl_tuner.bands(nccl_tuner.results(arms), FLAGS.tolerance)
    text, unwritten = nccl_tuner.render(bands, FLAGS.tolerance, [r.path for a in arms for r in a.runs])
    nccl_tuner.write(FLAGS.nccl_tuner_conf, text)
  except (runs.RunError, nccl_tuner.TunerError) as e:
    raise app.UsageError(str(e)) from None
  except OSError as e:
    raise app.UsageError(f"{e.filename}: {e.strerror or e}") from None
  print(f"microbench-report: {len(arms)} NCCL settings ({', '.join(a.setting.label for a in arms)}),"
        f" {sum(len(a.runs) for a in arms)} run(s)")
  for b in bands:
    print(f"microbench-report: {nccl_tuner.describe(b)}")
  for line in unwritten:
    print(f"microbench-report: {line}")
  written = sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))
  print(f"microbench-report: wrote {written} line(s) to {FLAGS.nccl_tuner_conf}; load it with"
        f" NCCL_TUNER_PLUGIN=<the example plugin> NCCL_TUNER_CONFIG_FILE={os.path.abspath(FLAGS.nccl_tuner_conf)}")
  for line in nccl_tuner.recorded_overrides(arms) + nccl_settings.overriding(os.environ):
    print(f"microbench-report: {line}")
  return 0
