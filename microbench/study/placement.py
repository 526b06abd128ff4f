"""Concrete nodes for every job of a mix, each in its placement class, no node shared (the study's JobPlacer,
run at plan time: its "hardcoded" mode).

Tightest classes are placed first and, within a class, larger jobs first; random choices come from a seeded
generator and a failed attempt is retried with the next seeds. Node lists are in rank order: for the
same-l1-N classes each run of N consecutive nodes shares an L1 switch, so a strategy's inner groups (FSDP
shards, pipeline neighbours) stay under one switch as the class intends. A job of at least a node's GPUs
takes whole nodes; a smaller one takes that many GPUs of one node, so several small jobs can share a node
(the study's DGX runs).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from microbench.study import machines as mm


def _free_by_l1(machine: mm.Machine, used: dict[int, int]) -> dict[int, list[int]]:
  """Nodes with no GPU taken, per L1 switch."""
  return {l1: [n for n in nodes if not used.get(n)] for l1, nodes in machine.l1s().items()}


def _round_robin(pools: list[list[int]], n: int, rng: random.Random) -> list[int] | None:
  """n nodes taken one at a time from each pool in turn (pools shuffled), so they spread over the pools."""
  pools = [list(p) for p in pools if p]
  for p in pools:
    rng.shuffle(p)
  rng.shuffle(pools)
  out: list[int] = []
  while len(out) < n and any(pools):
    for p in pools:
      if p and len(out) < n:
        out.append(p.pop())
  return out if len(out) == n else None


def place_one(machine: mm.Machine, name: str, gpus: int, used: dict[int, int], rng: random.Random
              ) -> list[int] | None:
  """Nodes for one job of class `name` (`used`: GPUs taken per node), or None if they can't host it."""
  n = mm.nodes_for(machine, gpus)
  if gpus < machine.gpus_per_node:  # part of one node
    if name != "intra-l1":
      return None
    options = [x for x in range(machine.nodes) if machine.gpus_per_node - used.get(x, 0) >= gpus]
    return [rng.choice(options)] if options else None
  free = _free_by_l1(machine, used)
  groups = machine.groups()
  chunk = mm.same_l1_chunk(name)
  if name == "intra-l1":
    options = [l1 for l1, nodes in free.items() if len(nodes) >= n]
    if not options:
      return None
    nodes = list(free[rng.choice(options)])
    rng.shuffle(nodes)
    return sorted(nodes[:n])
  if name.startswith("intra-group"):
    order = list(groups)
    rng.shuffle(order)
    for g in order:
      if chunk:
        switches = [l for l in groups[g] if len(free[l]) >= chunk]
        if len(switches) < n // chunk:
          continue
        rng.shuffle(switches)
        return [node for l in switches[:n // chunk] for node in sorted(free[l])[:chunk]]
      pools = [free[l] for l in groups[g] if free[l]]
      if len(pools) < 2:
        continue
      picked = _round_robin(pools, n, rng)
      if picked and len({machine.l1_of(x) for x in picked}) >= 2:
        return picked
    return None
  # inter-group: spread over at least two groups.
  if chunk:
    per_group = {g: [l for l in ls if len(free[l]) >= chunk] for g, ls in groups.items()}
    order = [g for g in per_group if per_group[g]]
    rng.shuffle(order)
    for g in order:
      rng.shuffle(per_group[g])
    picked_l1s: list[int] = []
    while len(picked_l1s) < n // chunk and any(per_group[g] for g in order):
      for g in order:
        if per_group[g] and len(picked_l1s) < n // chunk:
          picked_l1s.append(per_group[g].pop())
    if len(picked_l1s) < n // chunk or len({machine.group_of(free[l][0]) for l in picked_l1s}) < 2:
      return None
    return [node for l in picked_l1s for node in sorted(free[l])[:chunk]]
  pools = [[x for l in ls for x in free[l]] for ls in groups.values()]
  if sum(1 for p in pools if p) < 2:
    return None
  picked = _round_robin(pools, n, rng)
  if picked and len({machine.group_of(x) for x in picked}) >= 2:
    return picked
  return None


def place(machine: mm.Machine, jobs: Sequence[tuple[int, str]], seed: int, tries: int = 21
          ) -> list[list[int]] | None:
  """Node lists for jobs given as (GPUs, class), in the jobs' order; None if no seed in `tries` fits them."""
  order = sorted(range(len(jobs)), key=lambda i: (mm.CLASSES[jobs[i][1]], -jobs[i][0], i))
  for attempt in range(tries):
    rng = random.Random(seed + attempt)
    used: dict[int, int] = {}
    out: list[list[int] | None] = [None] * len(jobs)
    for i in order:
      gpus, name = jobs[i]
      nodes = place_one(machine, name, gpus, used, rng)
      if nodes is None:
        break
      for x in nodes:
        used[x] = used.get(x, 0) + min(gpus, machine.gpus_per_node)
      out[i] = nodes
    else:
      return [list(x) for x in out]  # type: ignore[arg-type]
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
