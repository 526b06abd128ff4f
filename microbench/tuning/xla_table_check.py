"""What XLA:GPU will do with a collective performance table, said before a compile: XLA says nothing.

XLA falls back to its built-in table without a word when the file is missing, unreadable or has no entry for
the device's key, drops its whole estimator to fixed costs when one entry cannot be rebuilt as an HLO module,
aborts the compile on an opcode it does not know, and gives a kind of collective the table lacks a fixed 5000
us. Each of those is one line here (xla_perf_table.py's docstring says where they come from).
"""

from __future__ import annotations

import dataclasses
import os

from microbench.tuning import textproto
from microbench.tuning.xla_perf_table import ELEMENT_TYPES, KINDS, MAX_BYTES

_ELEMENT_BYTES = {"PRED": 1, **dict(ELEMENT_TYPES.values())}  # XLA's element type -> bytes


@dataclasses.dataclass
class Verdict:
  """`fatal`: XLA will not use the table as meant (falls back, or worse); `notes`: what it will do with it."""
  key: str
  entries: int = 0
  kinds: tuple[str, ...] = ()
  fatal: list[str] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)

  @property
  def used(self) -> bool:
    return not self.fatal


def check(path: str, key: str, gpus_per_node: int = 8) -> Verdict:
  """The table at `path` as XLA will read it for a device of key `key` with `gpus_per_node` GPUs per node."""
  v = Verdict(key)
  if not os.path.isfile(path):
    v.fatal.append(f"{path}: no such file: XLA silently uses its built-in table")
    return v
  try:
    table = textproto.parse(open(path, encoding="utf-8").read())
  except (textproto.TextProtoError, UnicodeDecodeError) as e:
    v.fatal.append(f"{path}: not a text-format table ({e}): XLA silently uses its built-in table")
    return v
  keys = [textproto.unquote(textproto.first(item, "key", '""')) for n, item in table
          if n == "entries" and isinstance(item, list)]
  if key not in keys:
    v.fatal.append(f"{path} has no entries for {key} (it has {', '.join(keys) or 'none'}): XLA silently uses its"
                   f" built-in table for {key} devices")
    return v
  value = next(textproto.first(item, "value", []) for n, item in table
               if n == "entries" and textproto.unquote(textproto.first(item, "key", '""')) == key)
  entries = [e for n, e in value if n == "entries"]
  v.entries = len(entries)
  seen = set()
  for i, e in enumerate(entries, 1):
    seen.add(_entry_problems(i, e, gpus_per_node, v))
  v.kinds = tuple(k for k in KINDS if k in seen)
  missing = [k for k in KINDS if k not in seen]
  if missing:
    v.notes.append(f"no {', '.join(missing)} entries for {key}: the table replaces XLA's built-in one, so XLA"
                   " costs each of those at a fixed 5000 us (measure them, or expect their overlap to be off)")
  return v


def _entry_problems(i: int, e: textproto.Message, per_node: int, v: Verdict) -> str:
  """Adds entry `i`'s problems to `v`; returns its opcode."""
  ins = textproto.first(e, "instruction", [])
  op = textproto.unquote(textproto.first(ins, "opcode", '""')).removesuffix("-start")
  if op not in KINDS:
    v.fatal.append(f"entry {i}: opcode {op or '(none)'}: XLA aborts the compile on it (it knows {', '.join(KINDS)})")
    return op
  shape = textproto.first(ins, "shape", [])
  dims = [int(d) for d in textproto.get(shape, "dimensions")]
  if len(dims) != 1 and op in ("all-gather", "reduce-scatter"):
    v.fatal.append(f"entry {i}: a {op} of rank {len(dims)}: XLA cannot rebuild it and drops its whole estimator"
                   " to fixed costs")
  nbytes = _ELEMENT_BYTES.get(str(textproto.first(shape, "element_type", "F32")), 4)
  for d in dims:
    nbytes *= d
  if nbytes > MAX_BYTES:
    v.notes.append(f"entry {i}: {op} of {nbytes} bytes: 2 GiB or more, which XLA's nearest-point search"
                   " truncates to 32 bits (it may answer for the wrong size)")
  iota = textproto.first(ins, "iota_collective_device_list")
  if iota is not None:
    size = int(textproto.first(iota, "num_devices_per_group", "0"))
    if size > per_node:
      v.notes.append(f"entry {i}: {op} over {size} GPUs: more than a node's {per_node}, never read (XLA costs"
                     " collectives across nodes with its SoL model)")
    elif size and per_node % size:
      v.fatal.append(f"entry {i}: {op} groups of {size} straddle nodes of {per_node}: XLA cannot rebuild it and"
                     " drops its whole estimator to fixed costs")
  if not textproto.first(e, "network_throughput_bytes_per_sec"):
    v.fatal.append(f"entry {i}: {op} without network_throughput_bytes_per_sec")
  return op
