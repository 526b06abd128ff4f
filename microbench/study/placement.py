"""Concrete nodes for every job of a mix: a port of the study's JobPlacer (HicrestLaboratory/JobPlacer
9f146fd, src/placement.rs and src/bin/job_placer_placement_classes.rs), run on the nodes the machine
describes (a preset, or the allocation's own nodes and switches read from SLURM).

As JobPlacer: jobs are placed tightest class first (intra-l1, intra-group-same-l1-N, inter-group-same-l1-N,
intra-group, inter-group), larger jobs first within a class; a same-l1-N job takes blocks of N free nodes of
one L1 switch and may take several blocks from one switch (the richest switch gives at most all blocks but
one, so the job spans two switches); intra-group spans two switches of one group, inter-group two groups.
When a mix can't be placed exactly, 7 seeds are tried per tier: strict, then relaxed (intra-group may spill
to inter-group, intra-group-same-l1-N to inter-group-same-l1-N), then best effort (also intra-l1 -> intra-group
-> inter-group and same-l1-N -> inter-group without blocks). Beyond JobPlacer, a last tier ("any-nodes")
gives a job that still fails any free nodes, so an experiment the artifact designed is not lost when the
nodes left in a nearly full machine lie in one group (JobPlacer places inter-group jobs last, with no
fallback: on Leonardo's 510 nodes 7 of the 12 mixes of docs/study.md's Leonardo plan fail its best effort
so). Each job records the class it asked for, the class it got, and the tier and fallback that gave it. Random draws come from
Python's generator, not Rust's SmallRng, so node lists differ from JobPlacer's for the same seed; the rules
are the same.

A job smaller than a node takes that many GPUs of one node, so several small jobs share a node (the study's
DGX runs, which use no topology).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from microbench.study import machines as mm

TIERS = ("strict", "relaxed", "best-effort", "any-nodes")
ATTEMPTS_PER_TIER = 7  # JobPlacer's job_placer_placement_classes


def _rank(name: str) -> int:
  if name == "intra-l1":
    return 0
  if name.startswith("intra-group-same-l1"):
    return 1
  if name.startswith("inter-group-same-l1"):
    return 2
  return 3 if name == "intra-group" else 4


@dataclasses.dataclass(frozen=True)
class Placed:
  """One job's nodes, the class asked for, the class JobPlacer reports and how it got there."""
  nodes: list[int]
  requested: str
  achieved: str
  fallback: str  # "" (exact), or e.g. "relaxed: intra-group -> inter-group"


class Placer:
  """JobPlacer's engine over a machine's nodes; `used` maps a node to the GPUs taken on it."""

  def __init__(self, machine: mm.Machine, seed: int):
    self.m = machine
    self.rng = random.Random(seed)
    self.cells: dict[int, dict[int, list[int]]] = {}
    for l1, nodes in sorted(machine.l1s().items()):
      self.cells.setdefault(machine.group_of(nodes[0]), {})[l1] = list(nodes)

  def _free(self, nodes: Sequence[int], used: dict[int, int]) -> list[int]:
    return [n for n in nodes if not used.get(n)]

  def _cell_nodes(self, cell: int) -> list[int]:
    return [n for nodes in self.cells[cell].values() for n in nodes]

  def intra_l1(self, n: int, used: dict[int, int]) -> list[int] | None:
    cands = [(c, l) for c, l1s in self.cells.items() for l in l1s if len(self._free(l1s[l], used)) >= n]
    self.rng.shuffle(cands)
    if not cands:
      return None
    c, l = cands[0]
    free = self._free(self.cells[c][l], used)
    self.rng.shuffle(free)
    return free[:n]

  def _spanning_l1(self, cell: int, n: int, used: dict[int, int]) -> list[int] | None:
    pools = [p for p in (self._free(nodes, used) for nodes in self.cells[cell].values()) if p]
    if len(pools) < 2:
      return None
    self.rng.shuffle(pools)
    pools.sort(key=len, reverse=True)
    cap = n - 1 if len(pools[0]) >= n else len(pools[0])
    out = pools[0][:cap]
    i = 1
    while len(out) < n:
      rest = len(pools) - 1
      if rest == 0:
        break
      idx = 1 + i % rest
      if pools[idx]:
        out.append(pools[idx].pop())
        i += 1
      else:
        pools.pop(idx)
    return out if len(out) == n and len({self.m.l1_of(x) for x in out}) >= 2 else None

  def intra_group(self, n: int, used: dict[int, int]) -> list[int] | None:
    cells = [(c, len(self._free(self._cell_nodes(c), used))) for c in self.cells]
    cells = [x for x in cells if x[1] >= n]
    self.rng.shuffle(cells)
    cells.sort(key=lambda x: -x[1])
    for c, _ in cells:
      got = self._spanning_l1(c, n, used)
      if got is None and n == 1:
        pool = self._free(self._cell_nodes(c), used)
        self.rng.shuffle(pool)
        got = pool[:1] or None
      if got:
        return got
    return None

  def inter_group(self, n: int, used: dict[int, int]) -> list[int] | None:
    names = list(self.cells)
    self.rng.shuffle(names)
    per = []
    for c in names:
      free = self._free(self._cell_nodes(c), used)
      self.rng.shuffle(free)
      if free:
        per.append((c, free))
    if sum(len(p) for _, p in per) < n or len(per) < 2:
      return None
    per.sort(key=lambda x: -len(x[1]))
    cap = n - 1 if len(per[0][1]) >= n else len(per[0][1])
    out = per[0][1][:cap]
    cells = {per[0][0]} if out else set()
    i = 1
    while len(out) < n:
      rest = len(per) - 1
      if rest == 0:
        break
      idx = 1 + i % rest
      if per[idx][1]:
        cells.add(per[idx][0])
        out.append(per[idx][1].pop())
        i += 1
      else:
        per.pop(idx)
    return out if len(out) == n and len(cells) >= 2 else None

  def _blocks(self, pools: list[tuple[int, list[int]]], num: int, bs: int, cap_cell: int | None) -> list[int]:
    """Blocks of bs nodes drained from the pools in order; the dominant pool (or cell) gives at most num-1."""
    out: list[int] = []
    placed = 0
    if cap_cell is None:  # intra-group: the first pool is the dominant one
      top = len(pools[0][1]) // bs
      limits = [num - 1 if top >= num else top] + [len(p) // bs for _, p in pools[1:]]
      for (_, pool), limit in zip(pools, limits):
        for _ in range(min(limit, num - placed)):
          out += pool[len(pool) - bs:]
          del pool[len(pool) - bs:]
          placed += 1
      return out
    dom = sum(len(p) // bs for c, p in pools if c == cap_cell)
    dom_max, dom_used = (num - 1 if dom >= num else dom), 0
    for c, pool in pools:
      if placed >= num:
        break
      limit = max(0, dom_max - dom_used) if c == cap_cell else len(pool) // bs
      for _ in range(min(limit, num - placed)):
        if len(pool) < bs:
          break
        out += pool[len(pool) - bs:]
        del pool[len(pool) - bs:]
        placed += 1
        dom_used += c == cap_cell
    return out

  def intra_group_same_l1(self, n: int, bs: int, used: dict[int, int]) -> list[int] | None:
    if bs <= 0 or n % bs:
      return None
    num = n // bs
    names = list(self.cells)
    self.rng.shuffle(names)
    for c in names:
      pools = [(c, p) for p in (self._free(nodes, used) for nodes in self.cells[c].values()) if len(p) >= bs]
      if len(pools) < 2 or sum(len(p) // bs for _, p in pools) < num:
        continue
      self.rng.shuffle(pools)
      for _, p in pools:
        self.rng.shuffle(p)
      pools.sort(key=lambda x: -len(x[1]))
      out = self._blocks(pools, num, bs, None)
      if len(out) == n and len({self.m.l1_of(x) for x in out}) >= 2:
        return out
    return None

  def inter_group_same_l1(self, n: int, bs: int, used: dict[int, int]) -> list[int] | None:
    if bs <= 0 or n % bs:
      return None
    num = n // bs
    names = list(self.cells)
    self.rng.shuffle(names)
    pools = [(c, p) for c in names for p in (self._free(nodes, used) for nodes in self.cells[c].values())
             if len(p) >= bs]
    if len({c for c, _ in pools}) < 2 or sum(len(p) // bs for _, p in pools) < num:
      return None
    self.rng.shuffle(pools)
    for _, p in pools:
      self.rng.shuffle(p)
    pools.sort(key=lambda x: -len(x[1]))
    out = self._blocks(pools, num, bs, pools[0][0])
    return out if len(out) == n and len({self.m.group_of(x) for x in out}) >= 2 else None

  def exact(self, name: str, n: int, used: dict[int, int]) -> list[int] | None:
    bs = mm.same_l1_chunk(name)
    if name == "intra-l1":
      return self.intra_l1(n, used)
    if name == "intra-group":
      return self.intra_group(n, used)
    if name == "inter-group":
      return self.inter_group(n, used)
    if name.startswith("intra-group"):
      return self.intra_group_same_l1(n, bs, used)
    return self.inter_group_same_l1(n, bs, used)

  def one(self, name: str, n: int, used: dict[int, int], tier: str) -> tuple[list[int], str, str] | None:
    """(nodes, achieved class, fallback) under `tier`, as JobPlacer's place_one_with_strategy; the
    any-nodes tier then takes any free nodes and names the class they form."""
    got = self.exact(name, n, used)
    if got is not None:
      return got, name, ""
    if tier == "strict":
      return None
    chain: list[tuple[str, str]] = []  # (class to try, the tier that allows it)
    if name == "intra-group":
      chain = [("inter-group", "relaxed")]
    elif name.startswith("intra-group-same-l1"):
      chain = [(f"inter-group-same-l1-{mm.same_l1_chunk(name)}", "relaxed"), ("inter-group", "best-effort")]
    elif name.startswith("inter-group-same-l1"):
      chain = [("inter-group", "best-effort")]
    elif name == "intra-l1":
      chain = [("intra-group", "best-effort"), ("inter-group", "best-effort")]
    allowed = TIERS[1:TIERS.index(tier) + 1]
    for alt, needs in chain:
      if needs in allowed:
        got = self.exact(alt, n, used)
        if got:
          return got, alt, f"{needs}: {name} -> {alt}"
    if tier != "any-nodes":
      return None
    free = [x for c in self.cells for x in self._free(self._cell_nodes(c), used)]
    if len(free) < n:
      return None
    self.rng.shuffle(free)
    formed = mm.classify(self.m, free[:n])
    return free[:n], formed, f"any-nodes: {name} -> {formed}"


def _sub_node(machine: mm.Machine, gpus: int, used: dict[int, int], rng: random.Random) -> list[int] | None:
  options = [x for x in range(machine.nodes) if machine.gpus_per_node - used.get(x, 0) >= gpus]
  return [rng.choice(options)] if options else None


def place_tier(machine: mm.Machine, jobs: Sequence[tuple[int, str]], seed: int, tier: str
               ) -> list[Placed] | None:
  """One JobPlacer attempt: every job of (GPUs, class) placed under `tier`, or None."""
  p = Placer(machine, seed)
  order = sorted(range(len(jobs)), key=lambda i: (_rank(jobs[i][1]), -mm.nodes_for(machine, jobs[i][0])))
  used: dict[int, int] = {}
  out: list[Placed | None] = [None] * len(jobs)
  for i in order:
    gpus, name = jobs[i]
    if gpus < machine.gpus_per_node:  # part of one node: nothing above the node is involved
      nodes = _sub_node(machine, gpus, used, p.rng)
      if nodes is None:
        return None
      got = (nodes, "intra-l1", "" if name == "intra-l1" else f"{tier}: {name} -> intra-l1 (one node)")
    else:
      got = p.one(name, mm.nodes_for(machine, gpus), used, tier)
      if got is None:
        return None
    for x in got[0]:
      used[x] = used.get(x, 0) + min(gpus, machine.gpus_per_node)
    out[i] = Placed(list(got[0]), name, got[1], got[2])
  return out  # type: ignore[return-value]


def place_jobs(machine: mm.Machine, jobs: Sequence[tuple[int, str]], seed: int,
               tiers: Sequence[str] = TIERS) -> tuple[list[Placed], str, int] | None:
  """JobPlacer's schedule: 7 seeds per tier (seed + tier offset + i), strict then relaxed then best effort,
  then any free nodes; (placements, tier, seed used) or None when there are too few nodes."""
  for t, tier in enumerate(TIERS):
    if tier not in tiers:
      continue
    for i in range(ATTEMPTS_PER_TIER):
      s = seed + t * ATTEMPTS_PER_TIER + i
      got = place_tier(machine, jobs, s, tier)
      if got is not None:
        return got, tier, s
  return None


def place(machine: mm.Machine, jobs: Sequence[tuple[int, str]], seed: int, tries: int = ATTEMPTS_PER_TIER
          ) -> list[list[int]] | None:
  """Node lists for jobs given as (GPUs, class), every class exact (JobPlacer's strict tier), or None."""
  for i in range(tries):
    got = place_tier(machine, jobs, seed + i, "strict")
    if got is not None:
      return [p.nodes for p in got]
  return None


def first_slots(machine: mm.Machine, gpus: Sequence[int], nodes: Sequence[Sequence[int]]) -> list[int]:
  """The first GPU index each job uses on its nodes: 0 for whole nodes; jobs sharing a node get consecutive
  GPUs, in job order (their ranks then select GPUs first_slot, first_slot + 1, ...)."""
  taken: dict[int, int] = {}
  out = []
  for g, ns in zip(gpus, nodes):
    if g >= machine.gpus_per_node:
      out.append(0)
      continue
    out.append(taken.get(ns[0], 0))
    taken[ns[0]] = out[-1] + g
  return out
