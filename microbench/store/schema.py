"""The store's tables (SQLAlchemy Core, one definition for SQLite and PostgreSQL) and their migrations.

Why SQLAlchemy Core: the same table definitions, upserts and transactions on both engines without a
hand-written dialect layer, and no ORM (rows are records; the run folders hold the objects). Each schema
version is a migration step that runs once, in a transaction, under a lock both engines honour; a store
written by a newer version is refused rather than half-read.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

VERSION = 2  # the schema this code writes and reads

metadata = sa.MetaData()
_ID, _TIME = sa.String(40), sa.String(32)  # ids are hex digests; times are ISO 8601 UTC strings (sortable)

info = sa.Table("store_info", metadata, sa.Column("key", sa.String(64), primary_key=True),
                sa.Column("value", sa.Text, nullable=False))
# A machine is its hardware identity (accelerators, topology, nodes, fabric); a run's full fingerprint adds
# the software and environment (drivers, NCCL, JAX, NCCL_*, XLA_FLAGS), kept on the run.
machines = sa.Table("machines", metadata, sa.Column("machine_id", _ID, primary_key=True),
                    sa.Column("name", sa.Text, nullable=False), sa.Column("identity", sa.Text, nullable=False),
                    sa.Column("first_seen", _TIME, nullable=False))
runs = sa.Table("runs", metadata, sa.Column("run_id", _ID, primary_key=True),
                sa.Column("machine_id", _ID, sa.ForeignKey("machines.machine_id"), nullable=False),
                sa.Column("kind", sa.String(16), nullable=False), sa.Column("name", sa.Text, nullable=False),
                sa.Column("path", sa.Text, nullable=False), sa.Column("command", sa.Text),
                sa.Column("code_version", sa.String(80)), sa.Column("fingerprint", sa.Text, nullable=False),
                sa.Column("started_at", _TIME), sa.Column("finished_at", _TIME, nullable=False),
                sa.Column("status", sa.String(16), nullable=False), sa.Column("summary", sa.Text),
                sa.Column("indexed_at", _TIME, nullable=False))
points = sa.Table("points", metadata,
                  sa.Column("run_id", _ID, sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True),
                  sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
                  sa.Column("collective", sa.String(64)), sa.Column("scope", sa.String(32)),
                  sa.Column("dtype", sa.String(24)), sa.Column("bytes", sa.BigInteger),
                  sa.Column("group_size", sa.Integer), sa.Column("status", sa.String(24)),
                  sa.Column("time_us", sa.Float), sa.Column("busbw_gbps", sa.Float),
                  sa.Column("vs_expected", sa.Float), sa.Column("record", sa.Text, nullable=False))
figures = sa.Table("figures", metadata,
                   sa.Column("run_id", _ID, sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True),
                   sa.Column("name", sa.String(120), primary_key=True), sa.Column("value", sa.Float))
baselines = sa.Table("baselines", metadata, sa.Column("name", sa.String(120), primary_key=True),
                     sa.Column("machine_id", _ID, sa.ForeignKey("machines.machine_id"), nullable=False),
                     sa.Column("created_at", _TIME, nullable=False))
baseline_runs = sa.Table("baseline_runs", metadata,
                         sa.Column("name", sa.String(120), sa.ForeignKey("baselines.name", ondelete="CASCADE"),
                                   primary_key=True),
                         sa.Column("run_id", _ID, sa.ForeignKey("runs.run_id"), primary_key=True))
# Version 2: what the doctor said of each node, for the fleet's per-node history.
node_results = sa.Table("node_results", metadata,
                        sa.Column("run_id", _ID, sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True),
                        sa.Column("node", sa.String(200), primary_key=True),
                        sa.Column("verdict", sa.String(16), nullable=False), sa.Column("detail", sa.Text))


class NewerStore(RuntimeError):
  """The store's schema is newer than this code reads."""


def _v1(conn: sa.Connection) -> None:
  for table in (info, machines, runs, points, figures, baselines, baseline_runs):
    table.create(conn)


def _v2(conn: sa.Connection) -> None:
  node_results.create(conn)
  # DDL text, not an sa.Index on `runs`: bound to the table, it would be made by version 1 too
  conn.execute(sa.text("CREATE INDEX runs_by_machine ON runs (machine_id, finished_at)"))


MIGRATIONS: dict[int, Callable[[sa.Connection], None]] = {1: _v1, 2: _v2}


def version(conn: sa.Connection) -> int:
  """The schema version the store holds (0: empty)."""
  if not sa.inspect(conn).has_table(info.name):
    return 0
  row = conn.execute(sa.select(info.c.value).where(info.c.key == "schema_version")).first()
  return int(row[0]) if row else 0


def upgrade(conn: sa.Connection, url: str, to: int = VERSION) -> int:
  """Runs the migrations from the store's version up to `to` in the caller's transaction (the caller holds
  the store's write lock); refuses a store newer than this code. Returns the version before."""
  before = version(conn)
  if before > VERSION:
    raise NewerStore(f"{url}: results store schema {before} was written by a newer microbench (this one reads up"
                     f" to {VERSION}): upgrade microbench, or give another --store")
  for v in range(before + 1, to + 1):
    MIGRATIONS[v](conn)
    if v == 1:
      conn.execute(info.insert().values(key="schema_version", value="1"))
    else:
      conn.execute(info.update().where(info.c.key == "schema_version").values(value=str(v)))
  return before
