"""Reading collective instructions out of compiled HLO text: opcode, result type, replica groups.

Shared by the benchmark's HLO check (microbench.bench.hlo_check) and the training step's communication
fingerprint (microbench.train.comm_fingerprint): both must see what XLA really compiled, not what the
program asked for.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
        "collective-broadcast")
# `%name = type op(` and the async `op-start(` forms; the type may be a tuple with spaces and comments.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s(?P<op>" + "|".join(_OPS) +
                    r")(?P<start>-start)?\((?P<rest>.*)$")


@dataclasses.dataclass(frozen=True)
class HloCollective:
  op: str
  groups: tuple[tuple[int, ...], ...]  # replica groups, or source->target pairs for collective-permute
  text: str


def _parse_list_of_lists(text: str) -> tuple[tuple[int, ...], ...]:
  return tuple(tuple(int(v) for v in g.split(",") if v.strip()) for g in re.findall(r"\{([\d,\s]*)\}", text))


def parse_iota_groups(text: str) -> tuple[tuple[int, ...], ...]:
  """Expands XLA's iota replica-group form `[G,S]<=[d0,d1,...]T(p0,p1,...)`."""
  m = re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
  if not m:
    raise ValueError(f"unrecognised replica groups {text!r}")
  g, s = int(m.group(1)), int(m.group(2))
  dims = [int(d) for d in m.group(3).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(4):
    ids = ids.transpose([int(p) for p in m.group(4).split(",")])
  return tuple(tuple(int(v) for v in row) for row in ids.reshape(g, s))


_MESH_GROUPS = re.compile(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def parse_mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
  """Expands the named-mesh replica-group form `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`: device ids laid out
  row-major over the mesh, one group per combination of the other axes, members along the named axes."""
  m = _MESH_GROUPS.fullmatch(text.strip())
  if not m:
    raise ValueError(f"unrecognised replica groups {text!r}")
  sizes = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
  names = [k for k, _ in sizes]
  grouped = re.findall(r"'([^']+)'", m.group(2))
  if not sizes or any(g not in names for g in grouped):
    raise ValueError(f"unrecognised replica groups {text!r}")
  ids = np.arange(int(np.prod([v for _, v in sizes]))).reshape([v for _, v in sizes])
  order = [i for i, k in enumerate(names) if k not in grouped] + [names.index(g) for g in grouped]
  size = int(np.prod([dict(sizes)[g] for g in grouped])) if grouped else 1
  return tuple(tuple(int(v) for v in row) for row in ids.transpose(order).reshape(-1, size))


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One collective instruction line: its opcode (without `-start`), result type and operand text."""
  op: str
  type_text: str
  async_start: bool
  rest: str
  line: str


def instructions(hlo_text: str) -> list[Instruction]:
  """Every collective instruction of an HLO module (async `-start` forms once, `-done` not at all)."""
  out = []
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if m:
      out.append(Instruction(m.group("op"), m.group("type"), bool(m.group("start")), m.group("rest"), line))
  return out


def find_collectives(hlo_text: str) -> list[HloCollective]:
  out = []
  for ins in instructions(hlo_text):
    op, rest, line = ins.op, ins.rest, ins.line
    if op == "collective-permute":
      pm = re.search(r"source_target_pairs=(\{(?:\{[\d,\s]*\},?)*\})", rest)
      groups = _parse_list_of_lists(pm.group(1)) if pm else ()
    else:
      gm = re.search(r"replica_groups=(\{(?:\{[\d,\s]*\},?)*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|"
                     r"mesh\[[^\]]*\]\s*\{[^}]*\})", rest)
      if not gm:
        groups = ()
      elif gm.group(1).startswith("mesh"):
        groups = parse_mesh_groups(gm.group(1))
      elif gm.group(1).startswith("["):
        groups = parse_iota_groups(gm.group(1))
      else:
        groups = _parse_list_of_lists(gm.group(1))
    out.append(HloCollective(op, groups, line.strip()))
  return out


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")


def array_bytes(type_text: str) -> list[int]:
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
