"""`microbench-report --baseline=NAME RUN...`: names the runs (indexed now if new) as a baseline of their
machine; without runs, lists the baselines."""

from __future__ import annotations

from absl import app

from microbench.cli.report_modes import common

FLAGS = common.FLAGS


def main(paths: list[str]) -> int:
  from microbench.store import folders, queries  # pylint: disable=import-outside-toplevel
  store = common.open_store(common.beside(paths))
  if not paths:
    raise app.UsageError(f"--baseline={FLAGS.baseline} needs the runs that make it: microbench-report"
                         f" --baseline={FLAGS.baseline} RUN [RUN ...]")
  try:
    ids = [queries.resolve_run(store, p) for p in paths]
    queries.set_baseline(store, FLAGS.baseline, ids)
  except (folders.FolderError, queries.NotFound) as e:
    raise app.UsageError(str(e)) from None
  print(f"microbench-report: baseline {FLAGS.baseline} = {len(ids)} run(s): {', '.join(ids)}")
  return 0
