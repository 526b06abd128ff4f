"""Where the store is and how to open it: `--store=PATH|URL|none`, else $MICROBENCH_STORE, else
microbench.db beside the run folders; SQLite embedded, PostgreSQL for a team or fleet.

Writers take the store's one write lock for the whole of a run's transaction (SQLite: BEGIN IMMEDIATE with a
busy timeout; PostgreSQL: a transaction-scoped advisory lock), so jobs finishing at once on several nodes
queue instead of losing rows, and a writer killed mid-transaction leaves the store as it was. SQLite keeps
its default rollback journal: WAL needs shared memory that network file systems do not give.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator

ENV = "MICROBENCH_STORE"
OFF = "none"
FILENAME = "microbench.db"
_BUSY_S = 60.0  # how long a SQLite writer waits for the lock before retrying
_RETRIES = 5
_LOCK_KEY = 0x6D6963726F  # PostgreSQL advisory lock id ("micro")


class StoreError(ValueError):
  """A store that cannot be used; the message is the one line to print."""


def resolve(flag: str | None, beside: str | None = None) -> str | None:
  """The store's URL (None: off). `flag` is --store (a path, a postgresql:// URL, "none" or None for the
  default); `beside` is a run folder whose parent holds the default SQLite file."""
  spec = flag if flag not in (None, "", "auto") else os.environ.get(ENV) or None
  if spec is None:
    spec = os.path.join(os.path.dirname(os.path.abspath(beside)) if beside else "runs", FILENAME)
  if spec.strip().lower() == OFF:
    return None
  if spec.startswith(("postgresql:", "postgres:", "postgresql+")):
    return "postgresql+psycopg:" + spec.split(":", 1)[1] if "+" not in spec.split(":", 1)[0] else spec
  if spec.startswith("sqlite:"):
    return spec
  if "://" in spec:
    raise StoreError(f"--store={spec}: not a store (give a file path for SQLite, a postgresql:// URL, or none)")
  return "sqlite:///" + os.path.abspath(spec)


def display(url: str) -> str:
  """The URL without its password, for messages."""
  import sqlalchemy as sa  # pylint: disable=import-outside-toplevel
  return sa.engine.make_url(url).render_as_string(hide_password=True).replace("postgresql+psycopg", "postgresql")


@dataclasses.dataclass
class Store:
  url: str
  engine: object  # sqlalchemy.Engine

  @property
  def is_sqlite(self) -> bool:
    return self.url.startswith("sqlite")

  @contextlib.contextmanager
  def write(self) -> Iterator:
    """A transaction holding the store's write lock (committed on exit, rolled back on an exception)."""
    import sqlalchemy as sa  # pylint: disable=import-outside-toplevel
    conn = self.engine.connect().execution_options(microbench_write=True)
    try:
      for attempt in range(_RETRIES):
        try:
          tx = conn.begin()  # SQLite: BEGIN IMMEDIATE, waiting up to _BUSY_S for the lock
          break
        except sa.exc.OperationalError as e:
          if "locked" not in str(e) or attempt == _RETRIES - 1:
            raise
          time.sleep(0.5 * (attempt + 1))
      try:
        if not self.is_sqlite:
          conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_KEY})
        yield conn
        tx.commit()
      except BaseException:
        tx.rollback()
        raise
    finally:
      conn.close()

  def read(self):
    """A connection for reading (use as a context manager)."""
    return self.engine.connect()


def _engine(url: str):
  import sqlalchemy as sa  # pylint: disable=import-outside-toplevel
  if not url.startswith("sqlite"):
    return sa.create_engine(url, pool_pre_ping=True)
  engine = sa.create_engine(url, poolclass=sa.pool.NullPool, connect_args={"timeout": _BUSY_S})

  @sa.event.listens_for(engine, "connect")
  def _connect(dbapi_conn, _):
    dbapi_conn.isolation_level = None  # the driver emits no BEGIN of its own: the one below is what runs
    dbapi_conn.execute("PRAGMA foreign_keys=ON")

  @sa.event.listens_for(engine, "begin")
  def _begin(conn):  # a writer takes the write lock now, not at its first write; a reader takes none
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("microbench_write") else "BEGIN")

  return engine


def open_store(url: str) -> Store:
  """The store at `url`, created or migrated to this code's schema; StoreError in one line otherwise."""
  try:
    import sqlalchemy as sa  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise StoreError("the results store needs SQLAlchemy: pip install 'microbench[report]'") from e
  from microbench.store import schema  # pylint: disable=import-outside-toplevel
  if url.startswith("sqlite:///"):
    folder = os.path.dirname(url[len("sqlite:///"):])
    if folder and not os.path.isdir(folder):
      os.makedirs(folder, exist_ok=True)
  try:
    store = Store(url, _engine(url))
    with store.read() as conn:
      current = schema.version(conn)
    if current != schema.VERSION:
      with store.write() as conn:
        schema.upgrade(conn, display(url))
    return store
  except schema.NewerStore as e:
    raise StoreError(str(e)) from None
  except (sa.exc.SQLAlchemyError, OSError, ImportError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise StoreError(f"results store {display(url)}: {first}") from None
