"""`microbench-report --index DIR...`: builds or completes the store from run folders (idempotent); a folder
that is not a readable run is one line, the rest indexed, exit 1."""

from __future__ import annotations

from absl import app

from microbench.cli.report_modes import common


def main(paths: list[str]) -> int:
  if not paths:
    raise app.UsageError("--index needs run folders (or folders holding them): microbench-report --index runs/")
  from microbench.store import connect, folders, index  # pylint: disable=import-outside-toplevel
  try:
    found = folders.find(paths)
    store = common.open_store(found[0] if found else None)  # by default beside the (first) run folder
    done = index.index(store, paths, say=lambda line: print(f"microbench-report: {line}"))
  except folders.FolderError as e:
    raise app.UsageError(str(e)) from None
  print(f"microbench-report: indexed {len(done.runs)} run(s) into {connect.display(store.url)}"
        + (f"; {len(done.errors)} not indexed (above)" if done.errors else ""))
  return 1 if done.errors else 0
