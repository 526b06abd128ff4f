"""Reading the store: runs by reference, a machine's runs in time order, their records, named baselines."""

from __future__ import annotations

import datetime
import json
from typing import Any

import sqlalchemy as sa

from microbench.store import connect, folders, index, schema


class NotFound(ValueError):
  """A run, baseline or machine the store does not hold; the message is one line."""


def run_row(conn: sa.Connection, run_id: str) -> dict[str, Any]:
  row = conn.execute(sa.select(schema.runs).where(schema.runs.c.run_id == run_id)).mappings().first()
  if row is None:
    raise NotFound(f"run {run_id}: not in the store")
  out = dict(row)
  out["fingerprint"] = json.loads(out["fingerprint"])
  out["summary"] = json.loads(out["summary"] or "{}")
  return out


def resolve_run(store: connect.Store, ref: str) -> str:
  """A run id from a run folder (indexed now if new: idempotent), a run id or its prefix, or a run's name."""
  import os  # pylint: disable=import-outside-toplevel
  if os.path.exists(ref):
    return index.write(store, folders.read(ref))
  with store.read() as conn:
    rows = conn.execute(sa.select(schema.runs.c.run_id).where(sa.or_(
        schema.runs.c.run_id.startswith(ref), schema.runs.c.name == ref))).scalars().all()
  if len(rows) != 1:
    raise NotFound(f"{ref}: {'no' if not rows else str(len(rows))} run(s) in the store by that id or name"
                   f"{'' if not rows else ' (give more of the id)'}")
  return rows[0]


def records(conn: sa.Connection, run_id: str) -> list[dict[str, Any]]:
  rows = conn.execute(sa.select(schema.points.c.record).where(schema.points.c.run_id == run_id)
                      .order_by(schema.points.c.seq)).scalars().all()
  return [json.loads(r) for r in rows]


def figures(conn: sa.Connection, run_id: str) -> dict[str, float]:
  rows = conn.execute(sa.select(schema.figures.c.name, schema.figures.c.value)
                      .where(schema.figures.c.run_id == run_id)).all()
  return {n: v for n, v in rows}


def machine_runs(conn: sa.Connection, machine_id: str | None = None, kind: str | None = None,
                 since: str | None = None, before: str | None = None) -> list[dict[str, Any]]:
  """Runs in finishing order, filtered by machine (id or prefix), kind, and time."""
  q = sa.select(schema.runs, schema.machines.c.name.label("machine_name")).join(schema.machines)
  if machine_id:
    q = q.where(schema.runs.c.machine_id.startswith(machine_id))
  if kind:
    q = q.where(schema.runs.c.kind == kind)
  if since:
    q = q.where(schema.runs.c.finished_at >= since)
  if before:
    q = q.where(schema.runs.c.finished_at < before)
  return [dict(r) for r in conn.execute(q.order_by(schema.runs.c.finished_at, schema.runs.c.run_id)).mappings()]


def machines(conn: sa.Connection) -> list[dict[str, Any]]:
  return [dict(r) for r in conn.execute(sa.select(schema.machines).order_by(schema.machines.c.first_seen)).mappings()]


def previous(conn: sa.Connection, run: dict[str, Any]) -> str | None:
  """The same machine's latest run of the same kind before this one."""
  earlier = [r for r in machine_runs(conn, run["machine_id"], run["kind"], before=run["finished_at"])
             if r["run_id"] != run["run_id"] and r["status"] != "failed"]
  return earlier[-1]["run_id"] if earlier else None


def set_baseline(store: connect.Store, name: str, run_ids: list[str]) -> str:
  """Names these runs (all of one machine) as baseline `name`, replacing a baseline of that name."""
  with store.write() as conn:
    machine_ids = {run_row(conn, r)["machine_id"] for r in run_ids}
    if len(machine_ids) != 1:
      raise NotFound(f"baseline {name}: its runs are on {len(machine_ids)} different machines; a baseline is one"
                     " machine's (give runs of one machine)")
    conn.execute(schema.baselines.delete().where(schema.baselines.c.name == name))
    conn.execute(schema.baseline_runs.delete().where(schema.baseline_runs.c.name == name))
    conn.execute(schema.baselines.insert().values(name=name, machine_id=machine_ids.pop(), created_at=_now()))
    conn.execute(schema.baseline_runs.insert(), [{"name": name, "run_id": r} for r in dict.fromkeys(run_ids)])
  return name


def baseline(conn: sa.Connection, name: str) -> tuple[str, list[str]] | None:
  """(machine id, run ids) of baseline `name`, or None."""
  row = conn.execute(sa.select(schema.baselines.c.machine_id).where(schema.baselines.c.name == name)).first()
  if row is None:
    return None
  ids = conn.execute(sa.select(schema.baseline_runs.c.run_id).where(schema.baseline_runs.c.name == name)
                     .order_by(schema.baseline_runs.c.run_id)).scalars().all()
  return row[0], list(ids)


def baselines(conn: sa.Connection) -> list[str]:
  return list(conn.execute(sa.select(schema.baselines.c.name).order_by(schema.baselines.c.name)).scalars())


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
