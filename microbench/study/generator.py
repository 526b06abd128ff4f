"""Job mixes for the study (docs/study.md, section 2), as the seed artifact's generator makes them
(HicrestLaboratory/DLNetBenchSC26 7c640e3, DLNetBench/experiments_generator.py): the same size tables, pattern
families, entropy and locality bins, random draws in the same order from the same seed, and the same cap, so a
plan can be compared with the artifact's output experiment by experiment.

Patterns: A (k equal jobs), E (stochastic tiers: small .75, medium .20, large .05; the DGX's own tiers), and
the artifact's B (geometric), C (hierarchical) and D (power law). A labelling's entropy is the artifact's
H = -sum p_s ln p_s over GPU shares, binned against ln(min(k, m)) at .3 and .7; labellings are enumerated up
to `enum_threshold`, else rejection-sampled. Placement-class vectors are binned by their mean score.
With a topology (more than one L1 switch) the flat experiments are built uncapped and the cap is spent on the
placement layer (the artifact's --use-topology); on one switch (the DGX) the cap applies to the flat list
and every job is intra-l1. Every experiment then gets concrete nodes from the JobPlacer port
(`placement.place_jobs`: strict, relaxed, best effort), on the machine's nodes, which may be a real
allocation's. Deliberate differences are listed in docs/study.md ("What differs from the original study's
runs, and why").
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import time
from collections.abc import Sequence

from microbench.study import machines as mm
from microbench.study import placement
from microbench.study import workloads as wl

ARTIFACT = "HicrestLaboratory/DLNetBenchSC26@7c640e3a9ac61ba2a7e41aae16e9c0b800bc00cd"
BINS = ("low", "medium", "high")
FAMILIES = ("A", "B", "C", "D", "E")
# Pattern E tiers: (weight, sizes at the study's scale, pinned size weights); the DGX's as the artifact's --dgx.
TIERS = {
    "small": (0.75, (4, 8), {4: 0.8}),
    "medium": (0.20, (16, 32, 64, 512), {512: 0.25}),
    "large": (0.05, (1024,), {}),
}
TIERS_DGX = {"small": (0.7, (2, 4), {}), "large": (0.3, (6,), {})}
HIERARCHICAL = (((0.50, 0.25), 4), ((0.05, 0.21), 6), ((0.89,), 4))
# The artifact's size tables (GPUs per job), strategies in its order. `concurrent` is scaled by q1 / 4 for
# nodes of more than 4 GPUs; `extended` (--baseline-extended) has its own table for 8-GPU nodes.
SIZE_TABLES: dict[str, dict[str, tuple[int, ...]]] = {
    "concurrent": {"dp": (8, 16), "fsdp": (16, 32), "dp+pp": (16, 32, 64), "dp+pp+tp": (224, 256, 512),
                   "dp+pp+ep": (512, 1024)},
    "extended": {"dp": (8, 16, 32, 64), "fsdp": (16, 32, 64, 128, 256), "dp+pp": (16, 32, 64, 128, 256),
                 "dp+pp+tp": (224, 256, 512, 1024), "dp+pp+ep": (512, 1024, 2048)},
    "extended8": {"dp": (16, 32, 64, 128), "fsdp": (16, 32, 64, 128, 256, 512),
                  "dp+pp": (16, 32, 64, 128, 256, 512), "dp+pp+tp": (224, 448, 256, 512, 1024, 2048),
                  "dp+pp+ep": (512, 1024, 2048, 4096)},
    "dgx": {"dp": (2, 4, 8), "fsdp": (4, 8), "dp+pp": (4, 8), "dp+pp+tp": (), "dp+pp+ep": ()},
}
# Allowed classes per strategy: the concurrent map, and the extended one (FSDP and DP+PP may also go
# intra-group and inter-group, DP+PP+TP intra-group).
PLACEMENT_MAPS: dict[str, dict[str, tuple[str, ...]]] = {
    "concurrent": {s.name: s.placements for s in wl.STRATEGIES.values()},
    "extended": {
        "dp": ("intra-l1", "intra-group", "inter-group"),
        "fsdp": ("intra-l1", "intra-group-same-l1-2", "inter-group-same-l1-2", "intra-group", "inter-group"),
        "dp+pp": ("intra-l1", "intra-group-same-l1-2", "inter-group-same-l1-2", "inter-group", "intra-group"),
        "dp+pp+tp": ("intra-group-same-l1-4", "inter-group-same-l1-4", "inter-group", "intra-group"),
        "dp+pp+ep": ("intra-group", "inter-group"),
    },
}
# FSDP and DP+PP jobs alternate these models by their index in the mix (even: first), as the artifact's
# expand_experiments.py picks command 0 or 1 of command_map's two models.
ALTERNATING_MODELS = ("llama3-8b", "minerva-7b")
ENTROPY_G = 72  # the artifact's module constant G, which its mixture_entropy divides by (the ratio cancels
                # it, but the float rounding, and so a bin at an edge, depends on it)
PLACEMENT_SEED_BASE = 10_000


class PlanError(ValueError):
  """Bad plan settings; one line saying what is allowed."""


@dataclasses.dataclass(frozen=True)
class Settings:
  machine: mm.Machine
  patterns: tuple[str, ...] = ("A", "E")
  rho_min: float = 0.8
  rho_max: float = 1.0
  rho_steps: int = 1
  size_divisor: int = 1
  strategies: tuple[str, ...] = tuple(wl.STRATEGIES)
  g_min: int | None = None
  k_max: int | None = None
  n_stochastic: int = 3
  n_per_bin: int = 4
  n_placement_per_bin: int = 1
  enum_threshold: int = 5000
  entropy_cuts: tuple[float, float] = (0.3, 0.7)
  placement_cuts: tuple[float, float] = (1.67, 2.33)
  beta: float = 0.5
  alpha: float = 1.2
  max_experiments: int | None = None
  seed: int = 42
  gpus: int | None = None  # the design's GPUs (the artifact's -G); None: the machine's. The machine (the
                           # allocation) may be larger: the spare nodes are room for the placer.

  @property
  def total_gpus(self) -> int:
    return self.gpus or self.machine.total_gpus

  @property
  def utilizations(self) -> list[float]:
    """The artifact's _utilization_grid (same float arithmetic)."""
    if self.rho_steps <= 1:
      return [self.rho_max]
    return [self.rho_min + (self.rho_max - self.rho_min) * i / (self.rho_steps - 1) for i in range(self.rho_steps)]

  @property
  def table(self) -> str:
    t = self.machine.size_table
    return "extended8" if t == "extended" and self.machine.q1 == 8 else t

  @property
  def topology(self) -> bool:
    """Placement classes apply (the artifact's --use-topology): the machine has more than one L1 switch."""
    return len(self.machine.l1s()) > 1

  def sizes(self, strategy: str) -> tuple[int, ...]:
    """The strategy's sizes: the artifact's table (q1 / 4 scaling for the concurrent table on nodes of more
    than 4 GPUs), divided by `size_divisor`, 1-GPU jobs dropped (they move nothing)."""
    base = SIZE_TABLES[self.table][wl.strategy(strategy).name]
    q1 = self.machine.q1
    if self.table == "concurrent" and q1 > 4:
      base = tuple(g * q1 // 4 for g in base)
    if self.table == "dgx":
      return tuple(g for g in base if g >= 2)
    return tuple(g // self.size_divisor for g in base if g // self.size_divisor >= 2)

  def placements(self, strategy: str) -> tuple[str, ...]:
    return PLACEMENT_MAPS["extended" if self.table.startswith("extended") else "concurrent"][strategy]

  @property
  def min_job(self) -> int:
    """g_min: the artifact's max(8, 2 q1) (or the machine's), scaled like the sizes, never below 2 GPUs."""
    if self.g_min is not None:
      return self.g_min
    if self.machine.g_min is not None:
      return max(2, self.machine.g_min // (1 if self.machine.size_table == "dgx" else self.size_divisor))
    return max(2, 8 // self.size_divisor, 2 * self.machine.q1 // self.size_divisor)

  def check(self) -> None:
    bad = [p for p in self.patterns if p not in FAMILIES]
    if bad or not self.patterns:
      raise PlanError(f"--patterns: {','.join(bad) or 'none'} not in {','.join(FAMILIES)}")
    for s in self.strategies:
      wl.strategy(s)
    if not 0 < self.rho_min <= self.rho_max <= 1:
      raise PlanError(f"utilisation must satisfy 0 < rho_min <= rho_max <= 1, got {self.rho_min}..{self.rho_max}")
    if self.n_per_bin < 1 or self.n_placement_per_bin < 1:
      raise PlanError("samples per bin must be >= 1")
    if self.gpus is not None and not 0 < self.gpus <= self.machine.total_gpus:
      raise PlanError(f"--gpus={self.gpus} must be within the machine's {self.machine.total_gpus} GPUs")
    if not any(g >= self.min_job for g in self.feasible_counts()):
      raise PlanError(f"no strategy has a job size below the machine's {self.total_gpus} GPUs with --size_divisor="
                      f"{self.size_divisor} and g_min={self.min_job}; raise --size_divisor or use a bigger machine")

  def feasible_counts(self) -> frozenset[int]:
    """Job sizes some chosen strategy runs at, smaller than the machine (the artifact's; g_min bounds the
    patterns, not this set)."""
    return frozenset(g for s in self.strategies for g in self.sizes(s) if g < self.total_gpus)


# ---------------------------------------------------------------------------------------------------------
# Allocation patterns (the artifact's section 3).


def _snap(raw: int, feasible: frozenset[int]) -> int | None:
  fits = [g for g in feasible if g <= raw]
  return max(fits) if fits else None


def pattern_a(budget: int, k_max: int, g_min: int, feasible: frozenset[int]) -> list[tuple[int, ...]]:
  return [tuple([budget // k] * k) for k in range(2, k_max + 1)
          if budget % k == 0 and budget // k >= g_min and budget // k in feasible]


def pattern_b(budget: int, k_max: int, g_min: int, beta: float, feasible: frozenset[int]) -> list[tuple[int, ...]]:
  out = []
  g1 = budget // 2
  while g1 >= g_min:
    slots: list[int] = []
    remaining, cur = budget, g1
    while len(slots) < k_max and cur >= g_min:
      snapped = _snap(cur, feasible)
      if snapped is None or snapped < g_min or snapped > remaining:
        break
      slots.append(snapped)
      remaining -= snapped
      cur = max(g_min, int(math.floor(beta * cur)))
    if len(slots) >= 2:
      out.append(tuple(slots))
    g1 //= 2
  return out


def pattern_c(budget: int, total: int, k_max: int, g_min: int, fractions: Sequence[float], n_tiny: int,
              feasible: frozenset[int]) -> tuple[int, ...] | None:
  slots: list[int] = []
  residual = budget
  for a in fractions:
    snapped = _snap(int(math.floor(a * residual)), feasible)
    if snapped is None or snapped < g_min:
      return None
    slots.append(snapped)
    residual -= snapped
  if n_tiny and residual > 0:
    tiny = _snap(int(math.floor(residual / n_tiny)), feasible)
    if tiny is None or tiny < g_min:
      return None
    slots += [tiny] * n_tiny
  return tuple(slots) if 2 <= len(slots) <= k_max and sum(slots) <= total else None


def pattern_d(budget: int, total: int, k: int, g_min: int, alpha: float, feasible: frozenset[int]
              ) -> tuple[int, ...] | None:
  raw = [j ** (-alpha) for j in range(1, k + 1)]
  total_raw = sum(raw)
  slots = []
  for w in raw:
    snapped = _snap(int(math.floor(w / total_raw * budget)), feasible)
    if snapped is None or snapped < g_min:
      return None
    slots.append(snapped)
  return tuple(slots) if len(slots) >= 2 and sum(slots) <= total else None


def tier_sizes(tiers: dict, divisor: int, feasible: frozenset[int]) -> dict[str, tuple[list[int], list[float]]]:
  """The artifact's _tier_size_weights per tier that keeps a feasible size (sizes divided by `divisor`)."""
  out = {}
  for tier, (_, sizes, pinned_at) in tiers.items():
    kept = [(g // divisor, pinned_at.get(g)) for g in sizes if g // divisor in feasible]
    if not kept:
      continue
    free = [g for g, p in kept if p is None]
    rem = (1.0 - sum(p for _, p in kept if p is not None)) / len(free) if free else 0.0
    ws = [rem if p is None else p for _, p in kept]
    total = sum(ws)
    out[tier] = ([g for g, _ in kept], [w / total for w in ws])
  return out


def pattern_e(budget: int, k_max: int, g_min: int, tiers: dict, divisor: int, feasible: frozenset[int],
              rng: random.Random) -> tuple[int, ...] | None:
  """One stochastic-tier mix: tier, then size, drawn as the artifact draws them."""
  info = tier_sizes(tiers, divisor, feasible)
  if not info:
    return None
  names = list(info)
  tw = [tiers[t][0] for t in names]
  tw = [w / sum(tw) for w in tw]
  slots: list[int] = []
  remaining = budget
  while remaining >= g_min and len(slots) < k_max:
    if not any(s <= remaining for t in names for s in info[t][0]):
      break
    t = rng.choices(names, weights=tw, k=1)[0]
    g = rng.choices(info[t][0], weights=info[t][1], k=1)[0]
    if g <= remaining:
      slots.append(g)
      remaining -= g
  return tuple(sorted(slots, reverse=True)) if len(slots) >= 2 else None


@dataclasses.dataclass(frozen=True)
class Pattern:
  id: str
  family: str
  slots: tuple[int, ...]


def patterns(s: Settings, rng: random.Random) -> list[Pattern]:
  """Every requested family's patterns over the utilisations, deduplicated, families interleaved."""
  total, feasible, g_min = s.total_gpus, s.feasible_counts(), s.min_job
  k_max = s.k_max or max(2, total // max(1, g_min))
  tiers = TIERS_DGX if s.table == "dgx" else TIERS
  divisor = 1 if s.table == "dgx" else s.size_divisor
  seen: set[tuple[int, ...]] = set()
  by_family: dict[str, list[tuple[int, ...]]] = {f: [] for f in FAMILIES}

  def add(family: str, slots: tuple[int, ...] | None) -> None:
    if slots and slots not in seen and sum(slots) <= total and s.rho_min <= sum(slots) / total <= s.rho_max:
      seen.add(slots)
      by_family[family].append(slots)

  for rho in s.utilizations:
    budget = int(math.floor(rho * total))
    if "A" in s.patterns:
      for p in pattern_a(budget, k_max, g_min, feasible):
        add("A", p)
    if "B" in s.patterns:
      for p in pattern_b(budget, k_max, g_min, s.beta, feasible):
        add("B", p)
    if "C" in s.patterns:
      for fractions, tiny in HIERARCHICAL:
        add("C", pattern_c(budget, total, k_max, g_min, fractions, tiny, feasible))
    if "D" in s.patterns:
      for k in range(2, k_max + 1):
        add("D", pattern_d(budget, total, k, g_min, s.alpha, feasible))
    if "E" in s.patterns and s.n_stochastic > 0:
      batch: list[tuple[int, ...]] = []
      batch_seen: set[tuple[int, ...]] = set()
      for _ in range(10 * s.n_stochastic):
        if len(batch) >= s.n_stochastic:
          break
        p = pattern_e(budget, k_max, g_min, tiers, divisor, feasible, rng)
        if p is not None and p not in batch_seen:
          batch_seen.add(p)
          batch.append(p)
      for p in batch:
        add("E", p)
  named = {f: [Pattern(f"{f}{i}", f, p) for i, p in enumerate(ps, 1)] for f, ps in by_family.items()}
  out = []
  for row in itertools.zip_longest(*(named[f] for f in FAMILIES)):
    out += [p for p in row if p is not None]
  return out


# ---------------------------------------------------------------------------------------------------------
# Strategy labellings by entropy (the artifact's section 4).


def entropy(labels: Sequence[str], slots: Sequence[int]) -> float:
  """H = -sum_s p_s ln p_s, p_s = GPUs of strategy s / GPUs allocated (computed as the artifact does)."""
  per: dict[str, int] = {}
  for s, g in zip(labels, slots):
    per[s] = per.get(s, 0) + g
  rho = sum(slots) / ENTROPY_G
  if rho == 0:
    return 0.0
  h = 0.0
  for g in per.values():
    p = (g / ENTROPY_G) / rho
    if p > 0:
      h -= p * math.log(p)
  return h + 0.0  # never -0.0


def entropy_bin(h: float, m: int, k: int, cuts: tuple[float, float] = (0.3, 0.7)) -> tuple[str, float]:
  """(bin, H / H_max) with H_max = ln(min(k, m)) (1 when that is <= 1), compared as the artifact does."""
  eff = min(k, m)
  h_max = math.log(eff) if eff > 1 else 1.0
  b = "low" if h < cuts[0] * h_max else "medium" if h < cuts[1] * h_max else "high"
  return b, h / h_max


def labellings(slots: Sequence[int], per_slot: Sequence[Sequence[str]], n_per_bin: int, threshold: int,
               cuts: tuple[float, float], rng: random.Random) -> list[tuple[tuple[str, ...], str]]:
  """Up to n_per_bin distinct labellings per entropy bin (distinct up to reordering equal jobs), drawn as the
  artifact's _sample_exact / _sample_rejection."""
  if any(not opts for opts in per_slot):
    return []
  m = len({s for opts in per_slot for s in opts})
  k = len(slots)
  space = 1
  for opts in per_slot:
    space *= len(opts)
    if space > threshold:
      break
  bins: dict[str, list[tuple[str, ...]]] = {b: [] for b in BINS}
  seen: set[tuple] = set()
  if space <= threshold:
    for lab in itertools.product(*per_slot):
      key = tuple(sorted(zip(lab, slots)))
      if key in seen:
        continue
      seen.add(key)
      bins[entropy_bin(entropy(lab, slots), m, k, cuts)[0]].append(tuple(lab))
    return [(lab, b) for b in BINS for lab in rng.sample(bins[b], min(n_per_bin, len(bins[b])))]
  for _ in range(n_per_bin * 200 * len(BINS)):
    if all(len(bins[b]) >= n_per_bin for b in BINS):
      break
    lab = tuple(rng.choice(list(o)) for o in per_slot)
    key = tuple(sorted(zip(lab, slots)))
    if key in seen:
      continue
    seen.add(key)
    b = entropy_bin(entropy(lab, slots), m, k, cuts)[0]
    if len(bins[b]) < n_per_bin:
      bins[b].append(lab)
  return [(lab, b) for b in BINS for lab in bins[b]]


# ---------------------------------------------------------------------------------------------------------
# Placement vectors by locality score (the artifact's section 6).


def placement_bin(score: float, cuts: tuple[float, float]) -> str:
  return "low" if score < cuts[0] else "medium" if score < cuts[1] else "high"


def _score(vec: Sequence[str]) -> float:
  return sum(mm.CLASSES[c] for c in vec) / len(vec) if vec else 0.0


def placement_vectors(per_slot: Sequence[Sequence[str]], n_per_bin: int, cuts: tuple[float, float],
                      rng: random.Random, threshold: int = 50_000) -> list[tuple[tuple[str, ...], str, float]]:
  """Up to n_per_bin class vectors per locality bin, drawn as the artifact's
  _sample_placement_vectors_stratified (enumeration, else rejection sized by the bins' exact populations)."""
  if not per_slot or any(not c for c in per_slot):
    return []
  total = 1
  for c in per_slot:
    total *= len(c)
    if total > threshold:
      break
  if total <= threshold:
    bins: dict[str, list[tuple[str, ...]]] = {b: [] for b in BINS}
    for vec in itertools.product(*per_slot):
      bins[placement_bin(_score(vec), cuts)].append(tuple(vec))
    return [(v, b, _score(v)) for b in BINS for v in rng.sample(bins[b], min(n_per_bin, len(bins[b])))]
  dist: dict[int, int] = {0: 1}  # sum of round(2 x score) -> vectors, as the artifact's DP
  for classes in per_slot:
    nxt: dict[int, int] = {}
    for acc, cnt in dist.items():
      for c in classes:
        key = acc + round(mm.CLASSES[c] * 2)
        nxt[key] = nxt.get(key, 0) + cnt
    dist = nxt
  k = len(per_slot)
  pop = {b: 0 for b in BINS}
  for x2, cnt in dist.items():
    pop[placement_bin(x2 / (k * 2), cuts)] += cnt
  needed = [b for b in BINS if pop[b] > 0 and n_per_bin > 0]
  if not needed:
    return []
  p_min = min(pop[b] / sum(dist.values()) for b in needed)
  attempts = min(int(math.ceil(n_per_bin / max(p_min, 1e-9))) * 10, 500_000)
  got: dict[str, list[tuple[str, ...]]] = {b: [] for b in BINS}
  seen: set[tuple[int, ...]] = set()
  # rng.choice(seq) is seq[_randbelow(len(seq))]; inlined (same draws: getrandbits(n.bit_length()) until
  # below n), since the artifact's README commands take up to 500,000 attempts over 60-job mixes here.
  opts = [list(c) for c in per_slot]
  sizes = [(len(c), len(c).bit_length()) for c in opts]
  scores = [[mm.CLASSES[x] for x in c] for c in opts]
  bits = rng.getrandbits
  for _ in range(attempts):
    if all(len(got[b]) >= n_per_bin or pop[b] == 0 for b in BINS):
      break
    idx = []
    for n, nbits in sizes:
      r = bits(nbits)
      while r >= n:
        r = bits(nbits)
      idx.append(r)
    key = tuple(idx)
    if key in seen:
      continue
    b = placement_bin(sum(sc[i] for sc, i in zip(scores, idx)) / k, cuts)
    if len(got[b]) < n_per_bin:
      got[b].append(tuple(c[i] for c, i in zip(opts, idx)))
      seen.add(key)
  return [(v, b, _score(v)) for b in BINS for v in got[b]]


def feasible_classes(s: Settings, strategy: str, gpus: int) -> list[str]:
  """The artifact's _feasible_placement_classes_for_run: the strategy's allowed classes, same-l1-N only for
  jobs of more than N nodes' GPUs, intra-l1 up to q2 and intra-group up to q3 (its capacity table caps
  nothing else); and, here, no inter-group class on a machine of one group (it cannot exist there)."""
  m = s.machine
  out = []
  for c in s.placements(wl.strategy(strategy).name):
    chunk = mm.same_l1_chunk(c)
    if chunk and gpus <= chunk * m.q1:
      continue
    if (c == "intra-l1" and gpus > m.class_q2) or (c == "intra-group" and gpus > m.class_q3):
      continue
    if c.startswith("inter-group") and len(m.groups()) < 2:
      continue
    out.append(c)
  return out


# ---------------------------------------------------------------------------------------------------------
# Experiments.


def model_for(strategy: str, index: int) -> str:
  """The proxy model of a mix's index-th job: FSDP and DP+PP alternate llama3-8b / minerva-7b as the artifact."""
  st = wl.strategy(strategy)
  return ALTERNATING_MODELS[index % 2] if st.name in ("fsdp", "dp+pp") else st.model


def job_entry(name: str, strategy: str, gpus: int, placement_class: str, nodes: list[int],
              model: str | None = None, first_slot: int = 0, **extra) -> dict:
  """One job of an experiment: rank r runs on nodes[r // ranks_per_node], GPU first_slot + r % ranks_per_node.
  `extra` (the requested class, the placer's tier and fallback, host names) is recorded as given."""
  st = wl.strategy(strategy)
  return {"name": name, "strategy": st.name, "model": model or st.model, "gpus": gpus,
          "placement_class": placement_class, "nodes": nodes, "ranks_per_node": wl.ceil_div(gpus, len(nodes)),
          "first_slot": first_slot, "degrees": dataclasses.asdict(wl.degrees(st.name, gpus)), **extra}


def formed_class(machine: mm.Machine, gpus: int, nodes: Sequence[int], placed_as: str) -> str:
  """The class a job's nodes really form: the placer's class when the nodes have its properties (pairs packed
  two to a switch also pass for same-l1-4, but were asked as same-l1-2), else what they are (a job inside one
  node is intra-l1)."""
  if gpus < machine.gpus_per_node:
    return "intra-l1"
  return placed_as if mm.satisfies(machine, list(nodes), placed_as) else mm.classify(machine, list(nodes))


def designs(s: Settings) -> tuple[list[dict], dict]:
  """The artifact's experiment list before placement, in its order and cap: pattern, labelling and bins,
  requested class vector and placement seed; and counts of what was dropped on the way."""
  s.check()
  rng = random.Random(s.seed)
  strategies = [wl.strategy(x).name for x in s.strategies]
  dropped = {"no_labelling": 0, "no_placement_class": 0, "unplaceable": 0}
  cap = s.max_experiments
  flat: list[tuple[Pattern, tuple[str, ...], str]] = []
  for pat in patterns(s, rng):
    if not s.topology and cap is not None and len(flat) >= cap:
      break
    per_slot = [[st for st in strategies if g in s.sizes(st)] for g in pat.slots]
    labs = labellings(pat.slots, per_slot, s.n_per_bin, s.enum_threshold, s.entropy_cuts, rng)
    if not labs:
      dropped["no_labelling"] += 1
      continue
    for row in itertools.zip_longest(*([lab for lab, b in labs if b == x] for x in BINS)):
      for hb, lab in zip(BINS, row):
        if lab is not None and (s.topology or cap is None or len(flat) < cap):
          flat.append((pat, lab, hb))
  out: list[dict] = []

  def design(pat: Pattern, lab: tuple[str, ...], hb: str, vec: tuple[str, ...], pb: str, score: float,
             seed: int) -> dict:
    return {"pattern": pat, "labelling": lab, "entropy_bin": hb, "classes": vec, "placement_bin": pb,
            "placement_score": round(score, 4), "placement_seed": seed}

  if not s.topology:
    for i, (pat, lab, hb) in enumerate(flat):
      out.append(design(pat, lab, hb, ("intra-l1",) * len(lab), "low", 1.0, PLACEMENT_SEED_BASE + i))
    out.sort(key=lambda d: (BINS.index(d["entropy_bin"]), FAMILIES.index(d["pattern"].family), d["pattern"].slots))
    return out, dropped
  ordered = []
  for row in itertools.zip_longest(*([f for f in flat if f[2] == b] for b in BINS)):
    ordered += [f for f in row if f is not None]
  seed = PLACEMENT_SEED_BASE
  for pat, lab, hb in ordered:
    if cap is not None and len(out) >= cap:
      break
    classes = [feasible_classes(s, st, g) for st, g in zip(lab, pat.slots)]
    if any(not c for c in classes):
      dropped["no_placement_class"] += 1
      continue
    vecs = placement_vectors(classes, s.n_placement_per_bin, s.placement_cuts, rng)
    for row in itertools.zip_longest(*([(v, sc) for v, b, sc in vecs if b == x] for x in BINS)):
      for pb, item in zip(BINS, row):
        if item is not None and (cap is None or len(out) < cap):
          out.append(design(pat, lab, hb, item[0], pb, item[1], seed))
          seed += 1
  out.sort(key=lambda d: (BINS.index(d["placement_bin"]) + 3 * BINS.index(d["entropy_bin"]),
                          FAMILIES.index(d["pattern"].family), d["pattern"].slots))
  return out, dropped


def generate(s: Settings) -> tuple[list[dict], dict]:
  """The experiments (the artifact's order and cap), each placed by the JobPlacer port on the machine's nodes,
  and counts of what was dropped."""
  out, dropped = designs(s)
  m = s.machine
  experiments = []
  for d in out:
    pat, lab = d["pattern"], d["labelling"]
    got = placement.place_jobs(m, list(zip(pat.slots, d["classes"])), d["placement_seed"])
    if got is None:
      dropped["unplaceable"] += 1
      continue
    placed, tier, used_seed = got
    # Ranks fill a job's nodes in the machine's node order: srun puts a step's task r on its r-th node in
    # SLURM's order (the allocation's order here), whatever order the list is given in. Blocks of a
    # same-l1-N job stay blocks when the allocation lists a switch's nodes together (presets do); the class
    # recorded is what the sorted list forms.
    placed = [dataclasses.replace(p, nodes=sorted(p.nodes)) for p in placed]
    nodes = [p.nodes for p in placed]
    slots = placement.first_slots(m, pat.slots, nodes)
    jobs = []
    for i, (st, g, p, f) in enumerate(zip(lab, pat.slots, placed, slots)):
      extra = {"requested_class": p.requested, "placer_class": p.achieved, "fallback": p.fallback}
      if m.layout:
        extra["hosts"] = [m.hostname(n) for n in p.nodes]
      jobs.append(job_entry(f"j{i}", st, g, formed_class(m, g, p.nodes, p.achieved), p.nodes, model_for(st, i),
                            first_slot=f, **extra))
    per_slot = [[x for x in s.strategies if g in s.sizes(x)] for g in pat.slots]  # names checked by designs
    h = entropy(lab, pat.slots)
    _, hnorm = entropy_bin(h, len({x for o in per_slot for x in o}), len(pat.slots), s.entropy_cuts)
    experiments.append({
        "pattern": {"id": pat.id, "family": pat.family, "slots": list(pat.slots)},
        "utilization": sum(pat.slots) / s.total_gpus, "entropy": h, "entropy_norm": hnorm,
        "entropy_bin": d["entropy_bin"], "placement_class_vector": list(d["classes"]),
        "placement_score": d["placement_score"], "placement_bin": d["placement_bin"],
        "formed_score": round(_score([j["placement_class"] for j in jobs]), 4),
        "placement_seed": d["placement_seed"], "placement_tier": tier, "placer_seed": used_seed,
        "jobs": jobs})
  for i, e in enumerate(experiments):
    e["id"] = f"e{i:03d}"
  return experiments, dropped


def manual(machine: mm.Machine, jobs: Sequence[tuple[str, str | None, list[int]]]) -> dict:
  """One hand-written experiment: (strategy, model or None, whole nodes) per job; GPUs = nodes x q1; the
  class is read off the nodes. Raises PlanError on a bad or overlapping node list."""
  used: set[int] = set()
  entries = []
  for i, (strategy, model, nodes) in enumerate(jobs):
    bad = [n for n in nodes if not 0 <= n < machine.nodes]
    if bad or not nodes:
      raise PlanError(f"job {i}: nodes must be in 0..{machine.nodes - 1}, got {nodes}")
    if used & set(nodes):
      raise PlanError(f"job {i}: node(s) {sorted(used & set(nodes))} already used by another job")
    used |= set(nodes)
    if model is not None:
      wl.model(model)
    extra = {"hosts": [machine.hostname(n) for n in nodes]} if machine.layout else {}
    entries.append(job_entry(f"j{i}", strategy, len(nodes) * machine.gpus_per_node,
                             mm.classify(machine, nodes), list(nodes), model, **extra))
  labels = [j["strategy"] for j in entries]
  slots = [j["gpus"] for j in entries]
  h = entropy(labels, slots)
  hbin, hnorm = entropy_bin(h, len(set(labels)), len(slots))
  score = _score([j["placement_class"] for j in entries])
  return {"id": "e000", "pattern": {"id": "manual", "family": "manual", "slots": slots},
          "utilization": sum(slots) / machine.total_gpus, "entropy": h, "entropy_norm": hnorm, "entropy_bin": hbin,
          "placement_score": round(score, 4), "placement_bin": placement_bin(score, (1.67, 2.33)),
          "placement_seed": None, "jobs": entries}


def write(out_dir: str, s: Settings, experiments: Sequence[dict], dropped: dict, command: str = "") -> str:
  """The plan folder: plan.json (machine, settings, experiment files) and experiments/<id>.json; returns
  plan.json's path."""
  os.makedirs(os.path.join(out_dir, "experiments"), exist_ok=True)
  names = []
  for e in experiments:
    name = os.path.join("experiments", f"{e['id']}.json")
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
      json.dump(dict(e, machine=s.machine.name), f, indent=1)
    names.append(name)
  settings = {k: v for k, v in dataclasses.asdict(s).items() if k != "machine"}
  settings["g_min_used"] = s.min_job
  settings["size_table_used"] = s.table
  settings["topology"] = s.topology
  tiers = {t: sum(1 for e in experiments if e.get("placement_tier") == t) for t in placement.TIERS}
  fallbacks = sum(1 for e in experiments for j in e["jobs"] if j.get("fallback"))
  plan = {"machine": s.machine.to_json(), "settings": settings, "experiments": names, "dropped": dropped,
          "placement": {"tiers": tiers, "jobs_with_fallback": fallbacks}, "artifact": ARTIFACT,
          "command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
  path = os.path.join(out_dir, "plan.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(plan, f, indent=1)
  return path
