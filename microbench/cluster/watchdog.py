"""A watchdog that ends the process when a guarded step overruns its deadline, on every backend.

A collective whose peer is lost or stuck never returns on NCCL (gloo at least has its own timeout), and the
host thread that waits for it can't be interrupted. A daemon thread watches the deadline of the step in
progress; past it, it calls `on_expire` (which records what was running and flushes the outputs) and ends
the process with `exit_code`, without waiting for the stuck thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class Watchdog:
  """Guards one step at a time: `with dog.guard(label, seconds, context): ...`."""

  def __init__(self, on_expire: Callable[[str, float, Any], None], exit_code: int = 3, poll_s: float = 0.2):
    self._on_expire = on_expire
    self._exit_code = exit_code
    self._poll_s = poll_s
    self._lock = threading.Lock()
    self._deadline: float | None = None
    self._label, self._seconds, self._context = "", 0.0, None
    self._thread = threading.Thread(target=self._watch, name="microbench-watchdog", daemon=True)
    self._thread.start()

  @contextlib.contextmanager
  def guard(self, label: str, seconds: float, context: Any = None) -> Iterator[None]:
    with self._lock:
      self._deadline = time.monotonic() + seconds
      self._label, self._seconds, self._context = label, seconds, context
    try:
      yield
    finally:
      with self._lock:
        self._deadline = None

  def _watch(self) -> None:
    while True:
      time.sleep(self._poll_s)
      with self._lock:
        if self._deadline is None or time.monotonic() < self._deadline:
          continue
        try:
          self._on_expire(self._label, self._seconds, self._context)
        finally:
          sys.stdout.flush()
          sys.stderr.flush()
          os._exit(self._exit_code)  # the main thread is stuck in the runtime: don't wait for it


def deadline(expected_s: float, floor_s: float, factor: float = 10.0) -> float:
  """A step's deadline: `factor` times its expected duration, never below `floor_s`."""
  return max(floor_s, factor * max(0.0, expected_s))
