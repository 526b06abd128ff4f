"""Rounds of disjoint pairs: the round-robin (circle method) schedule, bounded to a fixed number of rounds.

A full round robin of N nodes takes N - 1 rounds (every pair once); at hundreds of nodes that is hours, and
the diagnosis does not need it: a part is cleared by one fast test through it and blamed only on slow tests
with two or more partners, so a few partners per node suffice. The survey is `rounds` rounds (default 4):

- round 0 pairs nodes inside their racks (the circle method inside each rack; the nodes left over, one per
  odd-sized rack, are paired with each other across racks), so every node's link is tried without crossing an
  uplink, and a rack whose uplink is slow still has fast tests to clear its nodes;
- the other rounds are rounds of the circle method over the whole fleet, spread evenly over its N - 1 rounds,
  so each node meets partners at several distances (in other racks, through the uplinks).

Every node is in at most one pair per round (an odd count leaves one out, a different one each round), so a
round's pairs run at once without sharing a node. The survey's round count does not grow with N.
"""

from __future__ import annotations

from collections.abc import Sequence

SURVEY_ROUNDS = 4


def circle_round(nodes: Sequence[int], r: int) -> list[tuple[int, int]]:
  """Round r (0 <= r < n - 1, n = len(nodes) rounded up to even) of the circle method: the last slot is fixed,
  the others rotate; slot i meets slot (2r - i) mod (n - 1). With an odd count a phantom sits in the fixed slot
  and its partner is left out of the round."""
  items = list(nodes) + ([None] if len(nodes) % 2 else [])
  n = len(items)
  if n < 2:
    return []
  m = n - 1
  pairs = [(items[r % m], items[-1])]
  for i in range(1, n // 2):
    pairs.append((items[(r + i) % m], items[(r - i) % m]))
  return [(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None]


def full_round_count(n: int) -> int:
  """Rounds of a complete round robin of n nodes."""
  return n - 1 if n % 2 == 0 else n


def rack_round(racks: Sequence[int]) -> list[tuple[int, int]]:
  """Round 0: pairs inside each rack (circle round 0 over the rack), the leftovers paired across racks."""
  members: dict[int, list[int]] = {}
  for node, rack in enumerate(racks):
    members.setdefault(rack, []).append(node)
  pairs, left = [], []
  for rack in sorted(members):
    nodes = members[rack]
    inside = circle_round(nodes, 0)
    pairs += inside
    paired = {x for p in inside for x in p}
    left += [x for x in nodes if x not in paired]
  pairs += [(left[i], left[i + 1]) for i in range(0, len(left) - 1, 2)]
  return sorted(pairs)


def survey(racks: Sequence[int], rounds: int = SURVEY_ROUNDS) -> list[list[tuple[int, int]]]:
  """The survey's rounds of disjoint pairs for nodes 0..N-1 in the given racks: at most `rounds`, fewer
  when a full round robin is shorter (then it is the full round robin). With one rack every round is a global
  circle round."""
  n = len(racks)
  if n < 2 or rounds < 1:
    return []
  total = full_round_count(n)
  if rounds >= total:
    return [circle_round(range(n), r) for r in range(total)]
  out = []
  several_racks = len(set(racks)) > 1 and any(racks.count(r) > 1 for r in set(racks))
  if several_racks:
    out.append(rack_round(racks))
  k = rounds - len(out)
  picked = [round(j * total / k) % total for j in range(k)]
  for r in dict.fromkeys(picked):
    out.append(circle_round(range(n), r))
  return out


def pack(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
  """Pairs into rounds in which no node appears twice, in the given order (first fit)."""
  rounds: list[list[tuple[int, int]]] = []
  busy: list[set[int]] = []
  for a, b in pairs:
    for r, used in enumerate(busy):
      if a not in used and b not in used:
        rounds[r].append((a, b))
        used.update((a, b))
        break
    else:
      rounds.append([(a, b)])
      busy.append({a, b})
  return rounds
