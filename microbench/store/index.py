"""Writing runs into the store: one transaction per run (its machine, the run, its points, figures and node
verdicts), replacing what an earlier indexing of the same run wrote, so indexing is idempotent and a resumed
run's new points land on the same run."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections.abc import Callable
from typing import Any

from microbench.store import connect, folders, schema


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _num(v: Any) -> float | None:
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    return None
  return float(v)


def _point_row(run_id: str, seq: int, r: dict[str, Any]) -> dict[str, Any]:
  return {"run_id": run_id, "seq": seq, "collective": r.get("collective"), "scope": r.get("scope"),
          "dtype": r.get("dtype"), "bytes": int(r.get("bytes") or r.get("requested_bytes") or 0),
          "group_size": int(r.get("group_size") or 0), "status": r.get("status"), "time_us": _num(r.get("time_us")),
          "busbw_gbps": _num(r.get("busbw_gbps")), "vs_expected": _num(r.get("vs_expected")),
          "record": json.dumps(r, sort_keys=True, default=str)}


def write(store: connect.Store, entry: folders.RunEntry) -> str:
  """The run into the store (replacing an earlier indexing of it); returns its run id."""
  import sqlalchemy as sa  # pylint: disable=import-outside-toplevel
  run_id, machine_id = entry.run_id, entry.machine_id
  with store.write() as conn:
    if conn.execute(sa.select(schema.machines.c.machine_id).where(
        schema.machines.c.machine_id == machine_id)).first() is None:
      conn.execute(schema.machines.insert().values(machine_id=machine_id, name=entry.machine_name,
                                                   identity=json.dumps(entry.identity, sort_keys=True, default=str),
                                                   first_seen=entry.finished_at))
    for table in (schema.points, schema.figures, schema.node_results):
      conn.execute(table.delete().where(table.c.run_id == run_id))
    row = dict(machine_id=machine_id, kind=entry.kind, name=entry.name, path=entry.path, command=entry.command,
               code_version=entry.code_version, fingerprint=json.dumps(entry.fingerprint, sort_keys=True, default=str),
               started_at=entry.started_at, finished_at=entry.finished_at, status=entry.status,
               summary=json.dumps(entry.summary, sort_keys=True, default=str), indexed_at=_now())
    # Updated in place, not deleted: a baseline may hold the run.
    if conn.execute(schema.runs.update().where(schema.runs.c.run_id == run_id).values(**row)).rowcount == 0:
      conn.execute(schema.runs.insert().values(run_id=run_id, **row))
    if entry.points:
      conn.execute(schema.points.insert(), [_point_row(run_id, i, r) for i, r in enumerate(entry.points)])
    if entry.figures:
      conn.execute(schema.figures.insert(), [{"run_id": run_id, "name": k, "value": _num(v)}
                                             for k, v in sorted(entry.figures.items())])
    if entry.nodes:
      conn.execute(schema.node_results.insert(), [{"run_id": run_id, "node": n, "verdict": v, "detail": d}
                                                  for n, (v, d) in sorted(entry.nodes.items())])
  return run_id


@dataclasses.dataclass
class Indexed:
  runs: list[tuple[str, str]]  # (path, run id)
  errors: list[str]  # one line per folder that could not be indexed


def index(store: connect.Store, paths: list[str], say: Callable[[str], None] = print) -> Indexed:
  """Every run under `paths` into the store; a malformed run is one line naming it, the rest indexed."""
  out = Indexed([], [])
  for path in folders.find(paths):
    try:
      entry = folders.read(path)
    except folders.FolderError as e:
      out.errors.append(str(e))
      say(f"not indexed: {e}")
      continue
    out.runs.append((path, write(store, entry)))
  return out


def record(flag: str | None, run_dir: str, say: Callable[[str], None] = print,
           entry: folders.RunEntry | None = None) -> str | None:
  """What a command calls as it ends: its run (read from `run_dir`, or `entry`) into the store that `flag`
  (--store) names, one line said. Never raises: the run folder is already written, and
  `microbench-report --index` can add it later."""
  try:
    url = connect.resolve(flag, beside=run_dir)
    if url is None:
      return None
    store = connect.open_store(url)
    run_id = write(store, entry or folders.read(run_dir))
  except Exception as e:  # pylint: disable=broad-except  (a database error must not lose a finished run)
    why = str(e) if isinstance(e, (connect.StoreError, folders.FolderError)) else \
        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    say(f"# results store: not recorded ({why}); the run folder is complete: microbench-report --index {run_dir}")
    return None
  say(f"# results store: run {run_id} recorded in {connect.display(url)}")
  return run_id
