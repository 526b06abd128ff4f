"""What a sweep leaves behind: results.jsonl (flushed per point), meta.json and TensorBoard events.

Only process 0 writes; other processes get a writer that does nothing, so callers need no rank checks.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

from microbench.output.tensorboard import TensorBoardLog

RESULTS = "results.jsonl"
META = "meta.json"

def read_results(outdir: str) -> list[dict[str, Any]]:
  """Every complete JSON line of a run's results (a torn last line from a crash is ignored)."""
  path = os.path.join(outdir, RESULTS)
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows


def read_meta(outdir: str) -> dict[str, Any] | None:
  path = os.path.join(outdir, META)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


class RunOutputs:
  """Writes a run folder: one JSON line and TensorBoard points per finished point, as it finishes."""

  def __init__(self, outdir: str, enabled: bool = True, stream: TextIO = sys.stdout):
    self.outdir = outdir
    self.enabled = enabled
    self.stream = stream
    self._results: TextIO | None = None
    self._tb: TensorBoardLog | None = None
    if enabled:
      os.makedirs(outdir, exist_ok=True)
      self._repair_torn_tail()
      self._results = open(os.path.join(outdir, RESULTS), "a")
      self._tb = TensorBoardLog(outdir)

  def _repair_torn_tail(self) -> None:
    """A crash can leave half a line; end it so appended records stay one per line."""
    path = os.path.join(self.outdir, RESULTS)
    if os.path.exists(path) and os.path.getsize(path):
      with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
          f.write(b"\n")

  def print(self, text: str = "") -> None:
    if self.enabled:
      print(text, file=self.stream, flush=True)

  def write_meta(self, meta: dict[str, Any]) -> None:
    if not self.enabled:
      return
    tmp = os.path.join(self.outdir, META + ".tmp")
    with open(tmp, "w") as f:
      json.dump(meta, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, os.path.join(self.outdir, META))

  def text(self, tag: str, text: str) -> None:
    if self._tb:
      self._tb.text(tag, text)

  def record(self, rec: dict[str, Any]) -> None:
    if not self.enabled:
      return
    self._results.write(json.dumps(rec, sort_keys=True) + "\n")
    self._results.flush()
    os.fsync(self._results.fileno())
    if rec["status"] == "ok":
      base = f"{rec['collective']}/{rec['scope']}/{rec['dtype']}"
      self._tb.scalar(f"busbw_gbps/{base}", rec["busbw_gbps"], rec["bytes"])
      self._tb.scalar(f"time_us/{base}", rec["time_us"], rec["bytes"])

  def close(self) -> None:
    if self._results:
      self._results.close()
    if self._tb:
      self._tb.close()
