"""The device-kind data files (`gpu_specs/`, `tpu_specs/`): read each, and hold every figure to one source."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator, Sequence
from typing import Any


def read(directory: str, fields: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
  """(path, table) for every .toml file in `directory`, in name order; ValueError names a missing field."""
  for fname in sorted(os.listdir(directory)):
    if not fname.endswith(".toml"):
      continue
    path = os.path.join(directory, fname)
    with open(path, "rb") as f:
      d = tomllib.load(f)
    missing = [k for k in fields if k not in d]
    if missing:
      raise ValueError(f"{path}: missing {', '.join(missing)}")
    yield path, d


def sources(path: str, d: dict[str, Any], given: dict[str, str], wanted: Sequence[str]) -> dict[str, str]:
  """figure -> source: the `given` ones and each [[sources]] entry's `cite` for its `figures`; ValueError when a
  figure is cited twice or with an empty cite, or `wanted` and the cited figures differ."""
  out = dict(given)
  for entry in d.get("sources", []):
    cite = str(entry.get("cite", "")).strip()
    for fig in entry.get("figures", []):
      if fig in out or not cite:
        raise ValueError(f"{path}: figure {fig!r} cited twice or with an empty cite")
      out[fig] = cite
  missing = [f for f in wanted if not out.get(f)]
  unknown = sorted(set(out) - set(wanted))
  if missing or unknown:
    raise ValueError(f"{path}: every figure needs exactly one source; without: {', '.join(missing) or '-'};"
                     f" not figures of this kind: {', '.join(unknown) or '-'}")
  return out
