"""Message sizes: parsing `64K`-style values and building the nccl-tests size sweep."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
  """Bytes from `8`, `64K`, `32M`, `1G` (binary units, as nccl-tests' -b/-e; `KiB`/`KB` also accepted)."""
  if isinstance(text, int):
    return text
  m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*", str(text).upper())
  if not m:
    raise ValueError(f"bad size {text!r}: use a byte count with an optional K, M or G suffix (8, 64K, 32M, 1G)")
  return int(m.group(1)) * _UNITS[m.group(2)]


def format_size(nbytes: int) -> str:
  for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
    if nbytes >= scale and nbytes % scale == 0:
      return f"{nbytes // scale}{unit}"
  return str(nbytes)


DEFAULT_MAX_BYTES = {"cpu": 4 << 20}  # --max_bytes=auto per platform; every other one (GPUs) 16M
DEFAULT_MAX_BYTES_OTHER = 16 << 20


def default_max_bytes(platform: str, min_bytes: int) -> int:
  """--max_bytes=auto: 4M on CPU devices, whose bus bandwidth peaks inside the caches (a 16M point only
  copies memory and cost 41 of a default sweep's 90 s on a 2-core CPU machine), 16M elsewhere; never
  below --min_bytes (a lone --min_bytes past it is a one-size sweep)."""
  return max(min_bytes, DEFAULT_MAX_BYTES.get(platform, DEFAULT_MAX_BYTES_OTHER))


def sweep(min_bytes: int, max_bytes: int, step_factor: float) -> list[int]:
  """Geometric sweep from min to max inclusive (max is always included, like nccl-tests)."""
  sizes, s = [], float(min_bytes)
  while s < max_bytes * (1 - 1e-9):
    sizes.append(int(s))
    s *= step_factor
  sizes.append(max_bytes)
  return sorted(set(sizes))


def round_count(nbytes: int, itemsize: int, multiple: int) -> int:
  """Elements per rank for a requested size: a multiple of `multiple`, at least one multiple.

  Rounded down to the nearest valid count (so a sweep never exceeds its maximum), except that the smallest
  valid count is used when the request is below it.
  """
  count = nbytes // itemsize
  return max(multiple, count // multiple * multiple)
