"""A training step's communication fingerprint: count and bytes per collective type, read from the
compiled (partitioned, per-device) HLO text.

Bytes follow the nccl-tests size convention per device, so they compare with the collective sweep:
all-reduce the buffer, all-gather the output, reduce-scatter the input (output x group size),
all-to-all and collective-permute the buffer. Tuple results (XLA-combined collectives) add up their
parts. Async `-start` forms count once, `-done` not at all. A collective inside a loop body counts once
(the models here unroll their layers, so nothing is hidden that way).
"""

from __future__ import annotations

import re

import numpy as np

from microbench import hlo

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")


def _array_bytes(type_text: str) -> list[int]:
  """Bytes of each array in an HLO type (`f32[8,64]{1,0}` or a tuple of them)."""
  out = []
  for dt, dims in _ARRAY.findall(type_text):
    if dt in _BYTES:
      out.append(_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
  return out


def group_size(rest: str, num_devices: int) -> int:
  """Devices per replica group, from any of XLA's printed forms (`{}` means all devices)."""
  m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", rest)
  if m:
    return len([v for v in m.group(1).split(",") if v.strip()])
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\].*?\}?\s*\{([^}]*)\}", rest)
  if m:
    sizes = dict((k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    names = re.findall(r"'([^']+)'", m.group(2))
    if names and all(n in sizes for n in names):
      return int(np.prod([sizes[n] for n in names]))
  return num_devices


def comm_fingerprint(hlo_text: str, num_devices: int) -> dict[str, dict[str, int]]:
  """{op: {"count", "bytes"}} for every collective type in the compiled program (absent: none)."""
  out: dict[str, dict[str, int]] = {}
  for ins in hlo.instructions(hlo_text):
    op, parts = ins.op, _array_bytes(ins.type_text)
    if op not in OPS:
      continue
    if ins.async_start and op == "all-gather" and len(parts) >= 2:
      parts = parts[len(parts) // 2:]  # all-gather-start returns (inputs, outputs)
    size = sum(parts)
    if op == "reduce-scatter":
      size *= group_size(ins.rest, num_devices)
    entry = out.setdefault(op, {"count": 0, "bytes": 0})
    entry["count"] += 1
    entry["bytes"] += size
  return {op: out[op] for op in OPS if op in out}
