"""JSON-lines files written record by record and read while, or after, a writer may have crashed: a torn last
line is skipped when reading and ended before appending, so every other record stays readable."""

from __future__ import annotations

import json
import os
from typing import Any


def read(path: str) -> list[dict[str, Any]]:
  """Every complete record of `path` ([] when it doesn't exist; a torn line is skipped)."""
  if not os.path.exists(path):
    return []
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except ValueError:
        continue
  return out


def end_torn_line(path: str) -> None:
  """A crash can leave half a line: end it so records appended after it stay one per line."""
  if os.path.exists(path) and os.path.getsize(path):
    with open(path, "rb+") as f:
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        f.write(b"\n")


def append(path: str, record: dict[str, Any]) -> None:
  """One record, on disk (fsync) before this returns: what a resumed run trusts."""
  end_torn_line(path)
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())
