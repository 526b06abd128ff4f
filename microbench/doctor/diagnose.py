"""From timed tests to named parts: which tests are slow, which parts are cleared, suspected, confirmed.

The rules, in the order they apply (docs/doctor.md says why each is there):

1. **Slow is relative.** A pair test's reference is what the fabric model expects of it in its round (the links
   it shares with the round's other pairs included), scaled by the fleet's median of measured / expected for
   that kind of test: the fleet's own efficiency, so a software stack that reaches 70% of the links everywhere
   is not a fault. Without a model the reference is the fleet's typical time. Small all-reduces and scale-up
   tests are latency-bound, so their reference is the fleet's typical time. A test is slow when it takes
   `threshold` times its reference or more. A pair's `loss` (the share of its TCP segments resent) is bad at
   `threshold` times the fleet's typical share and at least LOSS_FLOOR.
2. **One fast test clears a part.** A slow part makes every test through it slow, so every part on the path
   of a fast test is healthy.
3. **Suspects** are the parts on slow tests' paths that nothing cleared.
4. **Blame needs clean evidence from two partners, confirmed.** A slow test is evidence against a suspect only
   when every other part on its path is cleared (a healthy node paired with a slow node is cleared by its
   other tests, so that pair is evidence against the slow node alone). A suspect is named when such evidence
   comes from two different partners or more (for an uplink: two pairs sharing no node), one of them from a
   confirmation round run after the suspicion, with a partner chosen among cleared nodes.
5. What is left is said: suspects that could not be confirmed or cleared (no healthy partner to test them
   with, or slow only together), and slow tests whose parts were all cleared (noise or an intermittent part).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from microbench.doctor.fleet import Fleet, Test, median

THRESHOLD = 2.0
PROGRAM = {"loss": "p2p"}  # a derived kind and the program that yields it (their tests share its nodes)
BEST_KINDS = ("p2p", "loss")  # kinds whose typical is each node's best test (see _typical), not its median
LOSS_FLOOR = 0.005  # a pair whose TCP resent this share of its segments or more is lossy (when also 2x typical)


@dataclasses.dataclass(frozen=True)
class Result:
  """A test with its measured time (the slower of its two nodes' median call times), the model's expectation,
  the reference it is judged against, and the verdict."""
  test: Test
  measured_s: float
  expected_s: float | None
  reference_s: float
  slowness: float  # measured / reference
  slow: bool
  tested: tuple[str, ...] = ()  # the parts a fault would have shown through (what a fast result clears)

  def to_json(self) -> dict:
    d = self.test.to_json()
    d.update(measured_s=self.measured_s if math.isfinite(self.measured_s) else None, expected_s=self.expected_s,
             reference_s=self.reference_s, slowness=round(self.slowness, 4) if math.isfinite(self.slowness) else None,
             slow=self.slow, tested=list(self.tested))
    return d


@dataclasses.dataclass(frozen=True)
class Scale:
  """A kind's fleet figures from the survey: the typical measured / expected (None without a model) and the
  typical time. Fixed after the survey, so confirmation rounds are judged against the whole fleet."""
  ratio: float | None
  time_s: float


def _typical(per_test: Sequence[tuple[Test, float]], best: bool) -> float:
  """The median over nodes of each node's best (lowest) value, or of each node's median value.

  Either stays healthy while fewer than half the nodes are slow, where a plain median over tests does not
  (one slow node of four is in half of a round robin's pairs). The best is for bandwidth-bound tests, whose
  spread is small: a node's best test is healthy unless the node itself is slow, also when its rack's uplink
  is. Latency-bound tests spread with the hosts' scheduling, and the best of four would make every ordinary
  test look slow: a node's median is their reference."""
  values: dict[int, list[float]] = {}
  for t, v in per_test:
    for node in t.nodes:
      values.setdefault(node, []).append(v)
  return median([min(v) if best else median(v) for v in values.values()])


def fleet_scales(measured: Sequence[tuple[Test, float, float | None]]) -> dict[str, Scale]:
  """Per kind, the fleet's typical ratio to the model and typical time over (test, measured, expected)."""
  out = {}
  for kind in {t.kind for t, _, _ in measured}:
    rows = [(t, m, e) for t, m, e in measured if t.kind == kind]
    with_model = kind == "p2p" and all(e for _, _, e in rows)
    ratio = _typical([(t, m / e) for t, m, e in rows], best=True) if with_model else None
    # A loss share is ~0 on a healthy path whatever the hosts do: a node's best is 0 unless the node is lossy.
    out[kind] = Scale(ratio, _typical([(t, m) for t, m, _ in rows], best=kind in BEST_KINDS))
  return out


def judge(test: Test, measured_s: float, expected_s: float | None, scale: Scale,
          threshold: float = THRESHOLD, tested: tuple[str, ...] | None = None) -> Result:
  """A test against its reference (rule 1)."""
  if test.kind == "loss":  # lossy: at least LOSS_FLOOR resent, and threshold x the fleet's typical share
    reference = max(scale.time_s, LOSS_FLOOR / threshold)
  elif scale.ratio is not None and expected_s:
    reference = expected_s * scale.ratio
  else:
    reference = scale.time_s
  slowness = measured_s / reference if reference > 0 else 1.0
  return Result(test, measured_s, expected_s, reference, slowness, slowness >= threshold,
                tuple(tested) if tested is not None else ())


def cleared(fleet: Fleet, results: Iterable[Result]) -> set[str]:
  """The parts a fast test could have seen slow (rule 2): every part on its path, except where the model
  says a part had headroom (its share of the links well above what the test got)."""
  return {p for r in results if not r.slow for p in (r.tested or fleet.parts(r.test))}


def suspects(fleet: Fleet, results: Sequence[Result], ok: set[str]) -> set[str]:
  """Parts on slow tests' paths that no fast test cleared (rule 3)."""
  return {p for r in results if r.slow for p in fleet.parts(r.test)} - ok


def blocks(fleet: Fleet, parts: Iterable[str]) -> list[tuple[str, ...]]:
  """Suspects grouped where no test can tell them apart: every pair test through one crosses the others (the
  two uplinks of a two-rack fleet; a node alone in its rack and that rack's uplink; two nodes of a two-node
  fleet). Such a block is judged as one part and named as `a+b`."""
  out: dict[frozenset, list[str]] = {}
  for part in sorted(parts, key=part_order):
    key = frozenset(_candidates(fleet, part)) if not part.endswith(".gpus") else frozenset([part])
    out.setdefault(key, []).append(part)
  return [tuple(v) for v in out.values()]


def block_name(block: Sequence[str]) -> str:
  return "+".join(block)


def evidence(fleet: Fleet, results: Sequence[Result], block: Sequence[str], ok: set[str]) -> list[Result]:
  """Slow tests through the block whose every other part is cleared: they point at it alone (rule 4)."""
  inside = set(block)
  out = []
  for r in results:
    parts = fleet.parts(r.test)
    if r.slow and inside & set(parts) and all(p in ok for p in parts if p not in inside):
      out.append(r)
  return out


def partners(block: Sequence[str], rows: Sequence[Result]) -> int:
  """How many different partners the evidence against a block has: for a node's part (alone, or with its rack's
  uplink where it is the rack's only node), other nodes; for uplinks, pairs that share no node (a greedy
  count); for a node's scale-up, runs."""
  if any(p.endswith(".gpus") for p in block):
    return len(rows)
  if all(p.startswith("uplink") for p in block):
    used: set[int] = set()
    count = 0
    for r in rows:
      if not used & set(r.test.nodes):
        used.update(r.test.nodes)
        count += 1
    return count
  own = {int(p.split(".")[0][1:]) for p in block if p.startswith("h")}
  return len({x for r in rows for x in r.test.nodes if x not in own})


@dataclasses.dataclass(frozen=True)
class Verdict:
  culprits: dict[str, list[Result]]  # part (or `a+b` block) -> the clean evidence against it
  unresolved: dict[str, str]  # part -> why it was neither named nor cleared
  unexplained: list[Result]  # slow tests whose parts were all cleared for their kind
  cleared: set[str]  # parts cleared in every kind of test that crossed them


def _verdict_of_kind(fleet: Fleet, results: Sequence[Result], min_partners: int
                     ) -> tuple[dict[str, list[Result]], dict[str, str], list[Result]]:
  """Rules 2-5 over one kind's results."""
  ok = cleared(fleet, results)
  culprits, unresolved = {}, {}
  for block in blocks(fleet, suspects(fleet, results, ok)):
    name = block_name(block)
    rows = evidence(fleet, results, block, ok)
    confirmed = any(r.test.phase == "confirm" for r in rows)
    count = partners(block, rows)
    together = f" (no test can tell {' and '.join(block)} apart)" if len(block) > 1 else ""
    if count >= min_partners and confirmed:
      culprits[name] = rows
    elif not rows:
      unresolved[name] = "slow only on tests through other unresolved parts" + together
    elif not confirmed:
      unresolved[name] = f"slow with {count} partner(s) in the survey; no confirmation test could be run" + together
    else:
      unresolved[name] = f"slow with {count} partner(s); {min_partners} are needed to blame it" + together
  unexplained = [r for r in results if r.slow and all(p in ok for p in fleet.parts(r.test))]
  return culprits, unresolved, unexplained


def verdict(fleet: Fleet, results: Sequence[Result], min_partners: int = 2) -> Verdict:
  """Rules 2-5, kind by kind: a fast test clears a part only for tests of its own kind (a link shaped to a
  quarter of its rate passes a 4 KiB all-reduce at full speed, so that test says nothing of its rate)."""
  culprits: dict[str, list[Result]] = {}
  unresolved: dict[str, str] = {}
  unexplained: list[Result] = []
  crossed: dict[str, set[str]] = {}
  ok_by_kind: dict[str, set[str]] = {}
  for kind in sorted({r.test.kind for r in results}):
    rows = [r for r in results if r.test.kind == kind]
    c, u, x = _verdict_of_kind(fleet, rows, min_partners)
    for part, ev in c.items():
      culprits.setdefault(part, []).extend(ev)
    for part, why in u.items():
      unresolved.setdefault(part, f"{kind}: {why}")
    unexplained += x
    ok_by_kind[kind] = cleared(fleet, rows)
    for r in rows:
      for part in fleet.parts(r.test):
        crossed.setdefault(part, set()).add(kind)
  named = {p for name in culprits for p in name.split("+")}
  # A slow link also drops (its queue overflows), and a slow test through a named part is explained by it.
  unexplained = [r for r in unexplained if not named & set(fleet.parts(r.test))]

  def explained(name: str) -> bool:  # every slow test through it also crosses a named part
    inside = set(name.split("+"))
    return all(named & set(fleet.parts(r.test)) for r in results if r.slow and inside & set(fleet.parts(r.test)))

  unresolved = {name: (f"{why.split(':')[0]}: not proven healthy: every slow test through it also crossed a named"
                       f" part" if explained(name) else why)
                for name, why in sorted(unresolved.items(), key=lambda kv: part_order(kv[0]))
                if not set(name.split("+")) <= named}
  ok = {p for p, kinds in crossed.items() if all(p in ok_by_kind[k] for k in kinds)}
  return Verdict(dict(sorted(culprits.items(), key=lambda kv: part_order(kv[0]))), unresolved, unexplained, ok)


def part_order(part: str) -> tuple:
  """h2 before h10, nodes before uplinks (a block: by its first part)."""
  part = part.split("+")[0]
  if part.startswith("uplink"):
    return (1, int(part[len("uplink"):]), "")
  node, _, sub = part.partition(".")
  return (0, int(node[1:]), sub)


def confirmation_tests(fleet: Fleet, results: Sequence[Result], phase_round: int) -> list[Test]:
  """The next confirmation round: for each suspect block not yet named (per kind of test it was slow in), tests
  of that kind through it whose other parts are cleared where possible, else with the fewest unclear parts (if
  fast, they clear them all), with fresh partners first (a pair not tried before on that rail), a repeat
  where every pair was tried; one test per block, or, for an uplink, as many pairs as it takes to load it (its
  rate over a NIC's: a slow uplink shows only when it is the bottleneck); no node in two tests of one program
  (a kind on a rail: the round's programs run one after another)."""
  named = verdict(fleet, results).culprits
  busy: dict[tuple[str, int], set[int]] = {}
  out: list[Test] = []
  for kind in sorted({r.test.kind for r in results}):
    rows = [r for r in results if r.test.kind == kind]
    ok = cleared(fleet, rows)
    tried = {(r.test.a, r.test.b, r.test.rail) for r in rows if r.test.b >= 0}
    for block in blocks(fleet, suspects(fleet, rows, ok)):
      if block_name(block) in named:
        continue
      if kind == "scale_up":
        out.append(Test("scale_up", int(block[0][1:].split(".")[0]), -1, 0, phase_round, "confirm"))
        continue
      uplinks = [p for p in block if p.startswith("uplink")]
      want = max(fleet.uplink_load(int(u[len("uplink"):])) for u in uplinks) if uplinks else 1
      scored = []
      for rail, a, b in {c for p in block for c in _candidates(fleet, p)}:
        a, b = min(a, b), max(a, b)
        test = Test(kind, a, b, rail, phase_round, "confirm")
        unclear = sum(1 for p in fleet.parts(test) if p not in ok and p not in block)
        scored.append(((unclear, (a, b, rail) in tried, a, b, rail), test))
      scored.sort(key=lambda st: st[0])
      best_unclear = scored[0][0][0] if scored else 0
      picked = 0
      for score, test in scored:
        if picked >= want or score[0] > best_unclear:
          break
        used = busy.setdefault((PROGRAM.get(kind, kind), test.rail), set())
        if test.a in used or test.b in used:
          continue
        out.append(test)
        used.update(test.nodes)
        picked += 1
  return out


def _candidates(fleet: Fleet, part: str) -> Iterable[tuple[int, int, int]]:
  """(rail, a, b) of every pair test whose path crosses `part`, a < b."""
  n = fleet.nodes
  if part.startswith("uplink"):
    rack = int(part[len("uplink"):])
    inside = [i for i in range(n) if fleet.racks[i] == rack]
    outside = [i for i in range(n) if fleet.racks[i] != rack]
    for rail in range(fleet.rails):
      for a in inside:
        for b in outside:
          yield rail, min(a, b), max(a, b)
    return
  node_text, _, sub = part.partition(".")
  node = int(node_text[1:])
  rails = [int(sub[3:])] if sub.startswith("nic") else range(fleet.rails)
  for rail in rails:
    for other in range(n):
      if other != node:
        yield rail, min(node, other), max(node, other)
