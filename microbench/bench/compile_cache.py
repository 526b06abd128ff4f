"""JAX's persistent compilation cache for sweeps that run: a sweep compiles 7-9 programs per point (the check
program, the timed arms and the long arm's checked twin, the helpers that make and compare known inputs),
and the same sweep run again compiles the same programs. With the cache on, a rerun loads them from disk.

On a 2-core CPU machine's 16-point sweep that is 6 s of compile down to 2 s (scripts/bench_peer.py); on a GPU node,
where XLA:GPU takes about a second per program (autotuning included), it is minutes of a large sweep. What is
timed is unchanged (compile time is never timed), and every loaded program is HLO-checked as a compiled one is.

Off where a compile must really happen: a compile-only `--target` (what XLA emits is the product, and the
golden tests read its dumps), `--command_buffer` (the thunk sequence is read from XLA's dump of a compile)
and an `--xla_dump_to` in XLA_FLAGS (a user asking for dumps gets every program dumped).
"""

from __future__ import annotations

import os
import threading

ENV = "MICROBENCH_COMPILATION_CACHE"  # the default folder, or "none"
OFF = "none"


def default_dir() -> str:
  """$MICROBENCH_COMPILATION_CACHE, else $XDG_CACHE_HOME/microbench/xla, else ~/.cache/microbench/xla."""
  if os.environ.get(ENV):
    return os.environ[ENV]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "microbench", "xla")


def why_off(target: str | None, command_buffer: str) -> str | None:
  """Why the cache must stay off for this sweep (None: it may be on)."""
  if target:
    return "a compile-only target compiles every program (what XLA emits is what it reports)"
  if command_buffer != "no":
    return "--command_buffer reads the thunk sequence from XLA's dump of a real compile"
  if "--xla_dump_to" in os.environ.get("XLA_FLAGS", ""):
    return "XLA_FLAGS asks for dumps (--xla_dump_to): every program is compiled and dumped"
  return None


def enable(folder: str) -> None:
  """Every compile from now on in this process goes through the cache in `folder` (made if missing). JAX
  caches only compiles longer than a second by default; a sweep's are tens of milliseconds on CPU, so every
  one is kept. In a multi-process job only process 0 writes (JAX's rule); all read. Entries appear whole
  (atomic_writes): processes sharing the folder never read one half-written."""
  import jax  # pylint: disable=import-outside-toplevel
  os.makedirs(folder, exist_ok=True)
  atomic_writes()
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def atomic_writes() -> bool:
  """JAX's file cache writes an entry in place, without a lock unless eviction is on (which needs the
  `filelock` package): a process reading the key meanwhile, a concurrent study job or another rank on the
  host, gets half an entry, warns on stderr and compiles again. Entries are written under a temporary name
  in the folder and renamed (atomic on one filesystem): a reader finds the whole entry or none. Reaches into
  JAX's private `lru_cache` module; where that has changed, JAX's own write stays (False)."""
  try:
    from jax._src import lru_cache  # pylint: disable=import-outside-toplevel
    cls, suffix = lru_cache.LRUCache, lru_cache._CACHE_SUFFIX  # pylint: disable=protected-access
    original = cls.put
  except (ImportError, AttributeError):
    return False
  if getattr(original, "atomic", False):
    return True

  def put(self, key: str, value: bytes) -> None:
    folder = str(getattr(self, "path", ""))
    if not key or getattr(self, "eviction_enabled", True) or not folder or "://" in folder:
      return original(self, key, value)  # eviction's lock, a remote folder or a bad key: JAX's own way
    final = os.path.join(folder, f"{key}{suffix}")
    if os.path.exists(final):
      return
    tmp = os.path.join(folder, f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
      f.write(value)
    os.replace(tmp, final)

  put.atomic, put.jax_put = True, original
  cls.put = put
  return True


def resolve(flag: str, target: str | None, command_buffer: str) -> tuple[str | None, str]:
  """(the folder to enable or None, what meta.json records): `flag` is --compilation_cache (a folder, "auto"
  for default_dir(), or "none")."""
  folder = default_dir() if flag == "auto" else flag
  if folder.strip().lower() == OFF:
    return None, "off (--compilation_cache=none)"
  off = why_off(target, command_buffer)
  if off:
    return None, f"off: {off}"
  return folder, folder
