"""Reading collectives out of compiled HLO text, to prove the benchmark measures what it claims.

XLA drops degenerate collectives, merges small ones and may rewrite others; a wrong PartitionSpec silently
measures something else. So every program is checked: the intended op is present and its replica groups
(or source-target pairs) are exactly the scope's groups.
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


class HloMismatch(RuntimeError):
  """The compiled program does not contain the collective the benchmark intends to time."""


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
      gm = re.search(r"replica_groups=(\{(?:\{[\d,\s]*\},?)*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", rest)
      if not gm:
        groups = ()
      elif gm.group(1).startswith("["):
        groups = parse_iota_groups(gm.group(1))
      else:
        groups = _parse_list_of_lists(gm.group(1))
    out.append(HloCollective(op, groups, line.strip()))
  return out


def expected_groups(op: str, groups: np.ndarray) -> frozenset:
  """Canonical form of what `op` over `groups` ([num_groups, n] of device ids) must show in HLO."""
  if op == "collective-permute":
    n = groups.shape[1]
    return frozenset((int(g[i]), int(g[(i + 1) % n])) for g in groups for i in range(n))
  return frozenset(frozenset(int(v) for v in g) for g in groups)


def _canonical(c: HloCollective) -> frozenset:
  if c.op == "collective-permute":
    return frozenset(tuple(p) for p in c.groups)
  return frozenset(frozenset(g) for g in c.groups)


def verify(hlo_text: str, op: str, groups: np.ndarray) -> HloCollective:
  """Asserts `op` appears over exactly `groups` and no other collective does; returns the match."""
  found = find_collectives(hlo_text)
  want = expected_groups(op, groups)
  matches = [c for c in found if c.op == op and _canonical(c) == want]
  others = [c for c in found if c not in matches]
  if not matches:
    seen = "; ".join(f"{c.op} groups={list(map(list, c.groups))}" for c in found) or "no collective at all"
    raise HloMismatch(f"expected {op} over groups {groups.tolist()}, compiled program has: {seen}")
  if others:
    raise HloMismatch(f"compiled program has unexpected collectives besides {op}: "
                      + "; ".join(f"{c.op} groups={list(map(list, c.groups))}" for c in others))
  return matches[0]
