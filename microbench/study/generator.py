"""Job mixes for the study (methodology section 2): GPU allocation patterns at a utilisation rho, strategy
labellings stratified by mix entropy, placement-class vectors stratified by locality score, and concrete
nodes for every job; one seeded, reproducible experiment per mix.

Patterns: A (k equal jobs, k = 2..k_max), E (stochastic tiers: small .75, medium .20, large .05), and the
study's B (geometric, beta .5), C (hierarchical) and D (power law, alpha 1.2). Sizes are the study's job
sizes divided by `size_divisor` for machines smaller than the study's, and snapped down to sizes some
strategy runs at. The entropy of a labelling is H = -sum p_s ln p_s over GPU shares, binned by
H / ln(min(k, m)) (m: strategies feasible in the pattern) into low < .3 <= medium < .7 <= high; labellings
are enumerated when there are at most `enum_threshold` of them and rejection-sampled otherwise.
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

BINS = ("low", "medium", "high")
FAMILIES = ("A", "B", "C", "D", "E")
TIERS = {  # pattern E: tier weight, sizes (study scale) and pinned size weights
    "small": (0.75, (4, 8), {4: 0.8}),
    "medium": (0.20, (16, 32, 64, 512), {512: 0.25}),
    "large": (0.05, (1024,), {}),
}
HIERARCHICAL = (((0.50, 0.25), 4), ((0.05, 0.21), 6), ((0.89,), 4))


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

  @property
  def total_gpus(self) -> int:
    return self.machine.total_gpus

  @property
  def utilizations(self) -> list[float]:
    if self.rho_steps <= 1:
      return [self.rho_max]
    step = (self.rho_max - self.rho_min) / (self.rho_steps - 1)
    return [self.rho_min + i * step for i in range(self.rho_steps)]

  def sizes(self, strategy: str) -> tuple[int, ...]:
    return wl.scaled_sizes(strategy, self.size_divisor, self.machine.size_table)

  @property
  def min_job(self) -> int:
    """g_min: the study's max(8, 2 q1) (or the machine's), scaled like the sizes, never below 2 GPUs (a
    one-GPU job moves nothing over any network)."""
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
    if not self.feasible_counts():
      raise PlanError(f"no strategy has a job size below the machine's {self.total_gpus} GPUs with --size_divisor="
                      f"{self.size_divisor} and g_min={self.min_job}; raise --size_divisor or use a bigger machine")

  def feasible_counts(self) -> frozenset[int]:
    """Job sizes some chosen strategy runs at, smaller than the machine (as the study) and >= g_min."""
    return frozenset(g for s in self.strategies for g in self.sizes(s) if self.min_job <= g < self.total_gpus)


# ---------------------------------------------------------------------------------------------------------
# Allocation patterns.


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
      cur = max(g_min, int(beta * cur))
    if len(slots) >= 2:
      out.append(tuple(slots))
    g1 //= 2
  return out


def pattern_c(budget: int, total: int, k_max: int, g_min: int, fractions: Sequence[float], n_tiny: int,
              feasible: frozenset[int]) -> tuple[int, ...] | None:
  slots: list[int] = []
  residual = budget
  for a in fractions:
    snapped = _snap(int(a * residual), feasible)
    if snapped is None or snapped < g_min:
      return None
    slots.append(snapped)
    residual -= snapped
  if n_tiny and residual > 0:
    tiny = _snap(residual // n_tiny, feasible)
    if tiny is None or tiny < g_min:
      return None
    slots += [tiny] * n_tiny
  return tuple(slots) if 2 <= len(slots) <= k_max and sum(slots) <= total else None


def pattern_d(budget: int, total: int, k: int, g_min: int, alpha: float, feasible: frozenset[int]
              ) -> tuple[int, ...] | None:
  weights = [j ** -alpha for j in range(1, k + 1)]
  slots = []
  for w in weights:
    snapped = _snap(int(w / sum(weights) * budget), feasible)
    if snapped is None or snapped < g_min:
      return None
    slots.append(snapped)
  return tuple(slots) if len(slots) >= 2 and sum(slots) <= total else None


def _tier_sizes(divisor: int, feasible: frozenset[int]) -> dict[str, tuple[float, list[int], list[float]]]:
  out = {}
  for tier, (weight, sizes, pinned) in TIERS.items():
    kept = [(s // divisor, pinned.get(s)) for s in sizes if s // divisor in feasible]
    if not kept:
      continue
    free = [s for s, p in kept if p is None]
    rest = (1.0 - sum(p for _, p in kept if p is not None)) / len(free) if free else 0.0
    ws = [p if p is not None else rest for _, p in kept]
    out[tier] = (weight, [s for s, _ in kept], [w / sum(ws) for w in ws])
  return out


def pattern_e(budget: int, k_max: int, g_min: int, divisor: int, feasible: frozenset[int], rng: random.Random
              ) -> tuple[int, ...] | None:
  tiers = _tier_sizes(divisor, feasible)
  if not tiers:
    return None
  names = list(tiers)
  weights = [tiers[t][0] for t in names]
  slots: list[int] = []
  remaining = budget
  while remaining >= g_min and len(slots) < k_max:
    if not any(s <= remaining for t in names for s in tiers[t][1]):
      break
    t = rng.choices(names, weights=weights)[0]
    g = rng.choices(tiers[t][1], weights=tiers[t][2])[0]
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
    if "E" in s.patterns:
      found = 0
      for _ in range(10 * s.n_stochastic):
        if found >= s.n_stochastic:
          break
        before = len(by_family["E"])
        add("E", pattern_e(budget, k_max, g_min, s.size_divisor, feasible, rng))
        found += len(by_family["E"]) - before
  named = {f: [Pattern(f"{f}{i}", f, p) for i, p in enumerate(ps, 1)] for f, ps in by_family.items()}
  out = []
  for row in itertools.zip_longest(*(named[f] for f in FAMILIES)):
    out += [p for p in row if p is not None]
  return out


# ---------------------------------------------------------------------------------------------------------
# Strategy labellings by entropy.


def entropy(labels: Sequence[str], slots: Sequence[int]) -> float:
  """H = -sum_s p_s ln p_s, p_s = GPUs of strategy s / GPUs allocated."""
  per: dict[str, int] = {}
  for s, g in zip(labels, slots):
    per[s] = per.get(s, 0) + g
  total = sum(slots)
  return -sum(g / total * math.log(g / total) for g in per.values() if g) + 0.0  # never -0.0


def entropy_bin(h: float, m: int, k: int, cuts: tuple[float, float] = (0.3, 0.7)) -> tuple[str, float]:
  """(bin, H / H_max) with H_max = ln(min(k, m)) (1 when that is <= 1, as the study)."""
  eff = min(k, m)
  h_max = math.log(eff) if eff > 1 else 1.0
  x = h / h_max
  return ("low" if x < cuts[0] else "medium" if x < cuts[1] else "high"), x


def labellings(slots: Sequence[int], per_slot: Sequence[Sequence[str]], n_per_bin: int, threshold: int,
               cuts: tuple[float, float], rng: random.Random) -> list[tuple[tuple[str, ...], str]]:
  """Up to n_per_bin distinct labellings per entropy bin (distinct up to reordering equal jobs)."""
  if any(not opts for opts in per_slot):
    return []
  m = len({s for opts in per_slot for s in opts})
  k = len(slots)
  space = math.prod(len(o) for o in per_slot)
  bins: dict[str, list[tuple[str, ...]]] = {b: [] for b in BINS}
  seen: set[tuple] = set()

  def consider(lab: tuple[str, ...]) -> None:
    key = tuple(sorted(zip(lab, slots)))
    if key in seen:
      return
    seen.add(key)
    b, _ = entropy_bin(entropy(lab, slots), m, k, cuts)
    bins[b].append(lab)

  if space <= threshold:
    for lab in itertools.product(*per_slot):
      consider(tuple(lab))
    picked = {b: rng.sample(bins[b], min(n_per_bin, len(bins[b]))) for b in BINS}
  else:
    for _ in range(n_per_bin * 200 * len(BINS)):
      if all(len(bins[b]) >= n_per_bin for b in BINS):
        break
      consider(tuple(rng.choice(list(o)) for o in per_slot))
    picked = {b: bins[b][:n_per_bin] for b in BINS}
  return [(lab, b) for b in BINS for lab in picked[b]]


# ---------------------------------------------------------------------------------------------------------
# Placement vectors by locality score.


def placement_bin(score: float, cuts: tuple[float, float]) -> str:
  return "low" if score < cuts[0] else "medium" if score < cuts[1] else "high"


def placement_vectors(per_slot: Sequence[Sequence[str]], n_per_bin: int, cuts: tuple[float, float],
                      rng: random.Random, threshold: int = 50_000) -> list[tuple[tuple[str, ...], str, float]]:
  """Up to n_per_bin class vectors per locality bin (score = mean of the jobs' class scores)."""
  if any(not c for c in per_slot):
    return []
  bins: dict[str, list[tuple[str, ...]]] = {b: [] for b in BINS}
  seen: set[tuple[str, ...]] = set()

  def consider(vec: tuple[str, ...]) -> None:
    if vec not in seen:
      seen.add(vec)
      bins[placement_bin(sum(mm.CLASSES[c] for c in vec) / len(vec), cuts)].append(vec)

  if math.prod(len(c) for c in per_slot) <= threshold:
    for vec in itertools.product(*per_slot):
      consider(tuple(vec))
    picked = {b: rng.sample(bins[b], min(n_per_bin, len(bins[b]))) for b in BINS}
  else:
    for _ in range(n_per_bin * 500 * len(BINS)):
      if all(len(bins[b]) >= n_per_bin for b in BINS):
        break
      consider(tuple(rng.choice(list(c)) for c in per_slot))
    picked = {b: bins[b][:n_per_bin] for b in BINS}
  return [(v, b, sum(mm.CLASSES[c] for c in v) / len(v)) for b in BINS for v in picked[b]]


# ---------------------------------------------------------------------------------------------------------
# Experiments.


def job_entry(name: str, strategy: str, gpus: int, placement_class: str, nodes: list[int],
              model: str | None = None, first_slot: int = 0) -> dict:
  """One job of an experiment: rank r runs on nodes[r // ranks_per_node], GPU first_slot + r % ranks_per_node."""
  st = wl.strategy(strategy)
  return {"name": name, "strategy": st.name, "model": model or st.model, "gpus": gpus,
          "placement_class": placement_class, "nodes": nodes, "ranks_per_node": wl.ceil_div(gpus, len(nodes)),
          "first_slot": first_slot,
          "degrees": dataclasses.asdict(wl.degrees(st.name, gpus))}


def generate(s: Settings) -> tuple[list[dict], dict]:
  """The experiments (placement x entropy grid interleaved, capped) and counts of what was dropped."""
  s.check()
  rng = random.Random(s.seed)
  strategies = [wl.strategy(x).name for x in s.strategies]
  candidates: list[dict] = []
  dropped = {"no_labelling": 0, "no_placement_class": 0, "unplaceable": 0}
  for pat in patterns(s, rng):
    per_slot = [[st for st in strategies if g in s.sizes(st)] for g in pat.slots]
    labs = labellings(pat.slots, per_slot, s.n_per_bin, s.enum_threshold, s.entropy_cuts, rng)
    if not labs:
      dropped["no_labelling"] += 1
    m = len({x for o in per_slot for x in o})
    for lab, hbin in labs:
      h = entropy(lab, pat.slots)
      _, hnorm = entropy_bin(h, m, len(pat.slots), s.entropy_cuts)
      classes = [mm.feasible_classes(s.machine, st, g) for st, g in zip(lab, pat.slots)]
      vecs = placement_vectors(classes, s.n_placement_per_bin, s.placement_cuts, rng)
      if not vecs:
        dropped["no_placement_class"] += 1
      for vec, pbin, score in vecs:
        seed = rng.randrange(2**31)
        nodes = placement.place(s.machine, list(zip(pat.slots, vec)), seed)
        if nodes is None:
          dropped["unplaceable"] += 1
          continue
        slots = placement.first_slots(s.machine, pat.slots, nodes)
        jobs = [job_entry(f"j{i}", st, g, c, n, first_slot=f)
                for i, (st, g, c, n, f) in enumerate(zip(lab, pat.slots, vec, nodes, slots))]
        candidates.append({
            "pattern": {"id": pat.id, "family": pat.family, "slots": list(pat.slots)},
            "utilization": sum(pat.slots) / s.total_gpus, "entropy": h, "entropy_norm": hnorm,
            "entropy_bin": hbin, "placement_score": round(score, 4), "placement_bin": pbin,
            "placement_seed": seed, "jobs": jobs})
  cells: dict[tuple[int, int], list[dict]] = {}
  for e in candidates:
    cells.setdefault((BINS.index(e["placement_bin"]), BINS.index(e["entropy_bin"])), []).append(e)
  ordered = []
  for row in itertools.zip_longest(*(cells[k] for k in sorted(cells))):
    ordered += [e for e in row if e is not None]
  if s.max_experiments is not None:
    ordered = ordered[:s.max_experiments]
  for i, e in enumerate(ordered):
    e["id"] = f"e{i:03d}"
  return ordered, dropped


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
    entries.append(job_entry(f"j{i}", strategy, len(nodes) * machine.gpus_per_node,
                             mm.classify(machine, nodes), list(nodes), model))
  labels = [j["strategy"] for j in entries]
  slots = [j["gpus"] for j in entries]
  h = entropy(labels, slots)
  hbin, hnorm = entropy_bin(h, len(set(labels)), len(slots))
  score = sum(mm.CLASSES[j["placement_class"]] for j in entries) / len(entries)
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
  plan = {"machine": s.machine.to_json(), "settings": settings, "experiments": names, "dropped": dropped,
          "command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
  path = os.path.join(out_dir, "plan.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(plan, f, indent=1)
  return path
