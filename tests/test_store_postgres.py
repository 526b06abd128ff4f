"""The results store on a real PostgreSQL 15 server (initdb and pg_ctl, on a Unix socket in a temporary folder):
the same schema, upserts, comparisons and concurrent writers as on SQLite."""

from __future__ import annotations

import multiprocessing
import os
import pwd
import shutil
import subprocess
import tempfile

import pytest

pytest.importorskip("sqlalchemy")
pytest.importorskip("psycopg", reason="the postgres extra: pip install -e '.[postgres]'")

from microbench.store import compare, connect, folders, index, queries, schema  # noqa: E402
from store_fixtures import make_sweep, variant  # noqa: E402

pytestmark = pytest.mark.slow


def _as_owner(cmd: list[str], owner: str | None) -> list[str]:
  return ["runuser", "-u", owner, "--", *cmd] if owner else cmd


@pytest.fixture(scope="module")
def postgres():
  """A PostgreSQL server for this module; skips (saying why) where none can be started."""
  initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
  if not initdb or not pg_ctl:
    pytest.skip("PostgreSQL's initdb/pg_ctl are not installed (Debian: postgresql-15)")
  owner = None
  if os.getuid() == 0:  # initdb refuses root: the server runs as the postgres user
    try:
      pwd.getpwnam("postgres")
    except KeyError:
      pytest.skip("running as root without a postgres user to own the server")
    owner = "postgres"
  folder = tempfile.mkdtemp(prefix="mb-pg-")
  if owner:
    shutil.chown(folder, owner)
  data = os.path.join(folder, "data")
  subprocess.run(_as_owner([initdb, "-D", data, "-A", "trust", "-U", "postgres"], owner), check=True,
                 capture_output=True, timeout=120)
  opts = f"-k {folder} -c listen_addresses='' -p 5433"
  subprocess.run(_as_owner([pg_ctl, "-D", data, "-o", opts, "-w", "-l", os.path.join(folder, "log"), "start"], owner),
                 check=True, capture_output=True, timeout=120)
  try:
    yield f"postgresql://postgres@/postgres?host={folder}&port=5433"
  finally:
    subprocess.run(_as_owner([pg_ctl, "-D", data, "-m", "immediate", "stop"], owner), capture_output=True, timeout=60,
                   check=False)
    shutil.rmtree(folder, ignore_errors=True)


def _write(url: str, path: str) -> None:
  index.write(connect.open_store(url), folders.read(path))


def test_the_store_on_postgresql(postgres, tmp_path):
  url = connect.resolve(postgres)
  assert url.startswith("postgresql+psycopg://")
  store = connect.open_store(url)
  sweep = make_sweep(str(tmp_path / "real"))
  paths = [variant(sweep, str(tmp_path / f"n{i}"), seed=i, stamp=f"2026-11-0{i + 1}T02:00:00+00:00",
                   slower=1.3 if i == 5 else 1.0) for i in range(6)]
  ctx = multiprocessing.get_context("spawn")  # six jobs finishing at once
  procs = [ctx.Process(target=_write, args=(url, p)) for p in paths]
  for p in procs:
    p.start()
  for p in procs:
    p.join(120)
  assert [p.exitcode for p in procs] == [0] * 6
  ids = [index.write(store, folders.read(p)) for p in paths]  # again: idempotent
  with store.read() as conn:
    assert len(queries.machine_runs(conn)) == 6
  queries.set_baseline(store, "accepted", ids[:3])
  assert compare.compare(store, ids[4], "accepted").exit_status == 0
  assert compare.compare(store, ids[5], "accepted").exit_status == 1
  assert compare.compare(store, ids[5], "previous").against_ids == [ids[4]]
  with store.write() as conn:
    conn.execute(schema.info.update().values(value=str(schema.VERSION + 1)))
  with pytest.raises(connect.StoreError, match="newer microbench"):
    connect.open_store(url)
