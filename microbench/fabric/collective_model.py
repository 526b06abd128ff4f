"""A collective's time on a described fabric, for any group shape, by the algorithms NCCL uses.

Each prediction is a latency term plus a bandwidth term, t = latency + max over the levels the group
crosses of (bytes out of one unit of that level) / (that unit's capacity), and names its algorithm, the
level that bounds it and what it assumed. The group's ranks fill domains, then leaves, then groups (dense,
contiguous: what a scheduler gives a job that asks for whole nodes); `Shape` gives any other spread.

Algorithms (S = the nccl-tests message size, n ranks, unit capacities C from `Fabric.capacity`):
- ring: every crossed unit sends the volume one rank sends, 2(n-1)/n S for all-reduce and (n-1)/n S for
  all-gather / reduce-scatter, so the slowest unit capacity bounds it (NCCL runs one ring per NIC, so a
  node's NICs together carry it); latency: NCCL's, the steps that cross a domain boundary at the
  network hop, the others at the NVLink hop. Broadcast is the pipelined
  chain (S over the slowest unit), all-to-all sends each unit's share to the others directly, ppermute is
  one flow out of each unit.
- tree (all-reduce): a chain inside the domain and a double binary tree across domains: reduce and
  broadcast pipelined, each crossed unit moves 2S each way; latency 2 x (hops in the chain + log2(domains) network hops).
- hierarchical (all-reduce): reduce-scatter inside each level, all-reduce across, all-gather back: level i
  moves 2(D_i - 1)/D_i S out of each child unit; levels pipelined (the max, as `peaks.bus_peak`).
- nvls (all-reduce inside one NVLink domain): in-switch reduction, S in and S out of each GPU; an ideal
  bound (the published 8 x H100 NVLS figure is 61% of it, hardware.md).
- auto: the fastest of ring, tree and nvls where they apply (NCCL's tuner picks by its own model of the
  same kind; it runs the hierarchical form only through CollNet/NVLS-tree, so that one is asked for).
"""

from __future__ import annotations

import dataclasses
import math
import re

from microbench.fabric import conventions
from microbench.fabric.conventions import COLLECTIVES
from microbench.fabric.description import Fabric, FabricError

ALGORITHMS = ("auto", "ring", "tree", "hierarchical", "nvls")
AUTO = ("ring", "tree", "nvls")  # what NCCL chooses among by default; hierarchical only when asked
NVLS_LINKS = ("nvlink4", "nvlink5")  # NVLink SHARP needs third-generation NVSwitches (Hopper and later)


@dataclasses.dataclass(frozen=True)
class Shape:
  """How a group's ranks spread: ranks per NVLink domain, domains per leaf, leaves per group, groups."""
  per_domain: int
  domains_per_leaf: int = 1
  leaves_per_group: int = 1
  groups: int = 1
  total: int | None = None  # fewer ranks than the units hold (the last unit partly filled)

  @property
  def ranks(self) -> int:
    return self.total or self.per_domain * self.domains_per_leaf * self.leaves_per_group * self.groups

  @property
  def domains(self) -> int:
    return self.domains_per_leaf * self.leaves_per_group * self.groups

  @property
  def leaves(self) -> int:
    return self.leaves_per_group * self.groups

  def text(self) -> str:
    full = f"{self.per_domain}x{self.domains_per_leaf}x{self.leaves_per_group}x{self.groups}"
    return full if not self.total else f"{full} ({self.total} ranks)"

  @classmethod
  def parse(cls, text: str) -> Shape:
    """`4x10x2x1` (ranks per domain x domains per leaf x leaves per group x groups; trailing 1s optional)."""
    parts = text.strip().lower().split("x")
    if not 1 <= len(parts) <= 4 or not all(re.fullmatch(r"[1-9][0-9]*", p) for p in parts):
      raise FabricError(f"group shape {text!r}: want RANKS_PER_DOMAIN[xDOMAINS_PER_LEAF[xLEAVES_PER_GROUP"
                        f"[xGROUPS]]], positive integers, e.g. 4x2 (8 ranks on two nodes of one leaf)")
    return cls(*(int(p) for p in parts))


def dense_shape(fab: Fabric, ranks: int) -> Shape:
  """`ranks` filling domains, leaves and groups in order (whole units where the count allows)."""
  if ranks < 1:
    raise FabricError(f"a group needs at least 1 rank, got {ranks}")
  per_domain = min(ranks, fab.gpus_per_domain)
  domains = math.ceil(ranks / per_domain)
  per_leaf = min(domains, fab.domains_per_leaf)
  leaves = math.ceil(domains / per_leaf)
  per_group = min(leaves, fab.leaves_per_group)
  shape = Shape(per_domain, per_leaf, per_group, math.ceil(leaves / per_group))
  return shape if shape.ranks == ranks else dataclasses.replace(shape, total=ranks)


@dataclasses.dataclass(frozen=True)
class Level:
  name: str
  children: int  # D: child units inside one unit of the level above
  ranks_inside: int  # ranks in one unit of this level
  capacity_gbps: float | None  # out of one unit of this level, per direction
  hop_us: float


def crossed_levels(fab: Fabric, shape: Shape) -> list[Level]:
  """The levels the group's traffic leaves a unit of, inner to outer."""
  if shape.per_domain > fab.gpus_per_domain or shape.domains_per_leaf > fab.domains_per_leaf or (
      shape.leaves_per_group > fab.leaves_per_group):
    raise FabricError(f"shape {shape.text()} does not fit {fab.name} ({fab.gpus_per_domain} ranks per domain,"
                      f" {fab.domains_per_leaf} domains per leaf, {fab.leaves_per_group} leaves per group)")
  out = []
  if shape.per_domain > 1:
    out.append(Level("scale_up", shape.per_domain, 1, fab.capacity("scale_up", 1), fab.hop_us("scale_up")))
  if shape.domains > 1:
    out.append(Level("nic", shape.domains_per_leaf, shape.per_domain, fab.capacity("nic", shape.per_domain),
                     fab.hop_us("nic")))
  if shape.leaves > 1:
    inside = shape.per_domain * shape.domains_per_leaf
    out.append(Level("leaf_up", shape.leaves_per_group, inside, fab.capacity("leaf_up", inside),
                     fab.hop_us("leaf_up")))
  if shape.groups > 1:
    inside = shape.per_domain * shape.domains_per_leaf * shape.leaves_per_group
    out.append(Level("group_up", shape.groups, inside, fab.capacity("group_up", inside), fab.hop_us("group_up")))
  missing = [lv.name for lv in out if lv.capacity_gbps is None]
  if missing:
    raise FabricError(f"fabric {fab.name} has no rate for {', '.join(missing)}, which the group crosses")
  return out


@dataclasses.dataclass(frozen=True)
class Prediction:
  collective: str
  algorithm: str
  ranks: int
  shape: str
  size_bytes: float
  time_us: float
  latency_us: float
  bottleneck: str  # the level whose term is largest ("latency" when the latency term dominates)
  terms_us: dict[str, float]  # the bandwidth term per crossed level
  assumed: tuple[str, ...]

  @property
  def algbw_gbps(self) -> float:
    return self.size_bytes / (self.time_us * 1e3)

  @property
  def busbw_gbps(self) -> float:
    return self.algbw_gbps * conventions.busbw_factor(self.collective, self.ranks)


def _us(volume_bytes: float, gbps: float) -> float:
  return volume_bytes / (gbps * 1e3)  # 1 GB/s = 1e3 bytes per microsecond


def _terms(fab: Fabric, collective: str, algorithm: str, n: int, levels: list[Level],
           s: float) -> dict[str, float] | None:
  """Bandwidth term per level, or None when the algorithm does not apply."""
  if collective == "all_reduce" and algorithm == "tree":
    # Reduce up and broadcast down run pipelined at once: a chain link or a tree node (interior in one of
    # the two trees, leaf in the other) carries S each phase, 2S per direction in all.
    return {lv.name: _us(2 * s, lv.capacity_gbps) for lv in levels}
  if collective == "all_reduce" and algorithm == "hierarchical":
    return {lv.name: _us(2 * (lv.children - 1) / lv.children * s, lv.capacity_gbps)
            for lv in levels if lv.children > 1}
  if collective == "all_reduce" and algorithm == "nvls":
    if [lv.name for lv in levels] != ["scale_up"] or fab.scale_up_link not in NVLS_LINKS:
      return None  # in-switch reduction inside one NVLink domain, NVSwitch generation 3 and later
    return {"scale_up": _us(s, levels[0].capacity_gbps)}
  if algorithm != "ring":
    return None
  if collective in ("all_reduce", "all_gather", "reduce_scatter"):
    volume = conventions.ring_bytes(collective, n, s)
    return {lv.name: _us(volume, lv.capacity_gbps) for lv in levels}
  if collective == "all_to_all":
    # Out of one unit: its ranks' data for every rank outside it. The scale_up level is each GPU's own
    # link, which carries only its data for the ranks of its domain (NIC traffic leaves by PCIe).
    per_domain = levels[0].children if levels and levels[0].name == "scale_up" else 1
    out = {}
    for lv in levels:
      if lv.name == "scale_up":
        out[lv.name] = _us(s * (per_domain - 1) / n, lv.capacity_gbps)
      else:
        out[lv.name] = _us(lv.ranks_inside * s * (n - lv.ranks_inside) / n, lv.capacity_gbps)
    return out
  if collective == "broadcast":
    return {lv.name: _us(s, lv.capacity_gbps) for lv in levels}
  if collective == "ppermute":  # one flow out of each unit: one NIC's worth, not the node's
    out = {}
    for lv in levels:
      cap = lv.capacity_gbps if lv.name == "scale_up" else min(lv.capacity_gbps, fab.nic_gbps)
      out[lv.name] = _us(s, cap)
    return out
  raise FabricError(f"no model for collective {collective!r}; collectives: {', '.join(COLLECTIVES)}")


def _latency(fab: Fabric, collective: str, algorithm: str, n: int, levels: list[Level]) -> float:
  if not levels:
    return 0.0
  slowest = max(lv.hop_us for lv in levels)
  # A step's network transfers run at once, so a step that crosses racks anywhere waits for the uplinks' hop.
  net_hop = max((lv.hop_us for lv in levels if lv.name != "scale_up"), default=fab.net_hop_us)
  if algorithm == "tree":
    chain = next((lv.children - 1 for lv in levels if lv.name == "scale_up"), 0)
    domains = math.prod(lv.children for lv in levels if lv.name != "scale_up")
    return fab.base_us + 2 * (chain * fab.hop_us("scale_up") + math.ceil(math.log2(max(1, domains))) * net_hop)
  if algorithm == "hierarchical":
    return fab.base_us + sum(2 * (lv.children - 1) * lv.hop_us for lv in levels)
  if algorithm == "nvls":
    return fab.base_us + 2 * slowest
  # NCCL's ring model (conventions.latency_steps): the steps that cross a domain boundary pay the network
  # hop, the others the NVLink hop; all-to-all and ppermute send to every peer at once, one step.
  if collective not in conventions.RING_STEPS:
    return fab.base_us + slowest
  domains = math.prod(lv.children for lv in levels if lv.name != "scale_up")
  on_domain, network = conventions.latency_steps(collective, n, domains)
  return fab.base_us + on_domain * fab.hop_us("scale_up") + network * net_hop


def _assumptions(fab: Fabric, algorithm: str, shape: Shape) -> tuple[str, ...]:
  out = list(fab.assumed)
  out.append(f"ranks spread {shape.text()} (per domain x domains per leaf x leaves per group x groups)")
  if algorithm == "hierarchical":
    out.append("levels pipelined (the slowest level bounds it)")
  if algorithm == "nvls":
    out.append("ideal in-switch reduction (published 8 x H100 NVLS busbw is 61% of this bound)")
  if not fab.fitted_levels:
    out.append("link-rate bound: no level fitted from a sweep")
  return tuple(out)


def predict(fab: Fabric, collective: str, size_bytes: float, shape: Shape, algorithm: str = "auto") -> Prediction:
  """The time of one `collective` of `size_bytes` over a group spread as `shape` on `fab`."""
  if collective not in COLLECTIVES:
    raise FabricError(f"no model for collective {collective!r}; collectives: {', '.join(COLLECTIVES)}")
  if algorithm not in ALGORITHMS:
    raise FabricError(f"unknown algorithm {algorithm!r}; algorithms: {', '.join(ALGORITHMS)}")
  if not size_bytes > 0:
    raise FabricError(f"message size {size_bytes:g}: give a positive number of bytes")
  n = shape.ranks
  levels = crossed_levels(fab, shape)
  names = [algorithm] if algorithm != "auto" else list(AUTO)
  best = None
  for name in names:
    terms = _terms(fab, collective, name, n, levels, size_bytes) if n > 1 else {}
    if terms is None:
      continue
    lat = _latency(fab, collective, name, n, levels)
    bw = max(terms.values(), default=0.0)
    time_us = lat + bw
    if best is None or time_us < best.time_us:
      bottleneck = max(terms, key=terms.get) if terms and bw >= lat else "latency"
      label = name if algorithm != "auto" else f"{name} (auto)"
      best = Prediction(collective, label, n, shape.text(), float(size_bytes), time_us, lat, bottleneck, terms,
                        _assumptions(fab, name, shape))
  if best is None:
    raise FabricError(f"algorithm {algorithm} does not apply to {collective} over {shape.text()}"
                      f" (tree and hierarchical: all_reduce; nvls: all_reduce inside one NVLink"
                      f" domain of NVLink 4 or later)")
  return best
