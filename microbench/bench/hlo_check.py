"""The benchmark's HLO check: the compiled program runs the intended collective over exactly the scope's
groups, and nothing else.

XLA drops degenerate collectives, merges small ones and may rewrite others; a wrong PartitionSpec silently
measures something else. So every program is checked: the intended op is present and its replica groups
(or source-target pairs) are exactly the scope's groups.
"""

from __future__ import annotations

import numpy as np

from microbench.hlo.parse import HloCollective, find_collectives


class HloMismatch(RuntimeError):
  """The compiled program does not contain the collective the benchmark intends to time."""


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
