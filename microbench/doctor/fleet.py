"""The allocation as the doctor sees it: nodes in racks, rails, the parts each test crosses, and what the
fabric model expects each test of a round to take.

Parts (named as the testbed's `--fault` names them, so a planted fault and a verdict read the same):
- `h<i>`: node i's network link (its NIC, when the node has one rail); `h<i>.nic<r>` with several rails;
- `uplink<k>`: rack k's uplink to the core (only with two racks or more);
- `h<i>.gpus`: node i's scale-up (its GPUs and their links), tested inside the node.

A pair test between nodes a and b on rail r crosses the two NICs and, when a and b are in different racks,
both racks' uplinks. The expectation of a pair test is the fabric's: its flows share the links max-min fairly
with every other flow of the same round (microbench.fabric.flows), so pairs that share an uplink are expected
to be slower, and only a shortfall beyond that is suspicious.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from microbench.fabric import collective_model as fcoll
from microbench.fabric import flows
from microbench.fabric.description import Fabric

# A pair's ppermute swap, the share of its TCP segments resent, a pair's small all-reduce, a node's GPUs.
KINDS = ("p2p", "loss", "all_reduce", "scale_up")


@dataclasses.dataclass(frozen=True)
class Test:
  """One measurement: `kind` between nodes `a` and `b` on `rail` (scale_up: node `a` alone, b = -1)."""
  kind: str
  a: int
  b: int
  rail: int = 0
  round: int = 0
  phase: str = "survey"  # survey (the round-robin rounds) or confirm

  @property
  def nodes(self) -> tuple[int, ...]:
    return (self.a,) if self.b < 0 else (self.a, self.b)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Fleet:
  """The nodes of the allocation (in process order), the rack of each, and the rails tested per node."""
  hosts: tuple[str, ...]
  racks: tuple[int, ...]
  rails: int = 1
  gpus_per_node: int = 1
  fabric: Fabric | None = None

  def __post_init__(self) -> None:
    if len(self.hosts) != len(self.racks):
      raise ValueError(f"{len(self.hosts)} hosts but {len(self.racks)} rack numbers")
    if self.rails < 1:
      raise ValueError(f"rails must be >= 1, got {self.rails}")

  @classmethod
  def dense(cls, nodes: int, nodes_per_rack: int, **kw) -> Fleet:
    """`nodes` nodes filling racks of `nodes_per_rack` in order (what a scheduler gives whole-node jobs)."""
    return cls(hosts=tuple(f"node{i}" for i in range(nodes)),
               racks=tuple(i // nodes_per_rack for i in range(nodes)), **kw)

  @property
  def nodes(self) -> int:
    return len(self.hosts)

  @property
  def rack_count(self) -> int:
    return len(set(self.racks))

  def nic(self, node: int, rail: int) -> str:
    return f"h{node}" if self.rails == 1 else f"h{node}.nic{rail}"

  def uplink(self, node: int) -> str:
    return f"uplink{self.racks[node]}"

  def parts(self, test: Test) -> tuple[str, ...]:
    """The parts a test crosses (a slow one among them makes the test slow)."""
    if test.kind == "scale_up":
      return (f"h{test.a}.gpus",)
    out = (self.nic(test.a, test.rail), self.nic(test.b, test.rail))
    if self.racks[test.a] != self.racks[test.b]:
      out += (self.uplink(test.a), self.uplink(test.b))
    return out

  def describe_part(self, part: str) -> str:
    """A part in words, with the host name: `h3` -> `host link of node 3 (tb1-h3)`."""
    if part.startswith("uplink"):
      return f"uplink of rack {part[len('uplink'):]}"
    node_text, _, sub = part.partition(".")
    node = int(node_text[1:])
    where = f"node {node} ({self.hosts[node]})"
    if sub == "gpus":
      return f"scale-up (GPUs) of {where}"
    if sub.startswith("nic"):
      return f"NIC of rail {sub[3:]} of {where}"
    return f"network link of {where}"

  # What the model expects.
  def rack_size(self, rack: int) -> int:
    return sum(1 for r in self.racks if r == rack)

  def uplink_load(self, rack: int) -> int:
    """Pairs it takes to make rack's uplink the bottleneck: its rate over a NIC's (a non-blocking uplink, or
    none described: every node of the rack), at most the rack's nodes."""
    size = self.rack_size(rack)
    fab = self.fabric
    if fab is None or not fab.nic_gbps or fab.leaf_up_gbps is None:
      return size
    return max(1, min(size, math.ceil(fab.leaf_up_gbps / fab.nic_gbps - 1e-9)))

  def flow_paths(self, tests: Sequence[Test], nic_gbps: float, uplink_gbps: float | None
                 ) -> tuple[dict[tuple[Test, int], tuple[str, ...]], dict[str, float]]:
    """The two flows (a -> b, b -> a) of each pair test as directed links (`h3>out`, `uplink1>up`, ...), and
    each link's capacity in bytes/s: the NIC's rate, the uplink's (a non-blocking uplink: its rack's NICs)."""
    paths, capacity = {}, {}
    for t in tests:
      for k, (src, dst) in enumerate(((t.a, t.b), (t.b, t.a))):
        links = [(f"{self.nic(src, t.rail)}>out", nic_gbps)]
        if self.racks[src] != self.racks[dst]:
          for node, way in ((src, "up"), (dst, "down")):
            gbps = uplink_gbps or nic_gbps * self.rails * self.rack_size(self.racks[node])
            links.append((f"{self.uplink(node)}>{way}", gbps))
        links.append((f"{self.nic(dst, t.rail)}>in", nic_gbps))
        paths[(t, k)] = tuple(name for name, _ in links)
        capacity.update((name, gbps * 1e9) for name, gbps in links)
    return paths, capacity

  def expected(self, tests: Sequence[Test], sizes: dict[str, int]) -> dict[Test, Expectation]:
    """What the fabric model expects of each test of one program, its tests running at once: seconds (None
    where the fabric says nothing: no fabric, no NIC rate, a kind it has no model for) and the parts a fault
    would show through (`Expectation.tested`)."""
    fab = self.fabric
    out = {t: Expectation(None, self.parts(t)) for t in tests}
    if fab is None:
      return out
    p2p = [t for t in tests if t.kind == "p2p"]
    if p2p and fab.nic_gbps:
      paths, capacity = self.flow_paths(p2p, fab.nic_gbps, fab.leaf_up_gbps)
      keys = list(paths)
      rates = flows.max_min_rates({str(i): paths[k] for i, k in enumerate(keys)}, capacity)
      rate_of = {k: rates[str(i)] for i, k in enumerate(keys)}
      users: dict[str, int] = {}
      for links in paths.values():
        for link in links:
          users[link] = users.get(link, 0) + 1
      for t in p2p:
        slowest = min(rate_of[(t, 0)], rate_of[(t, 1)])
        cross = self.racks[t.a] != self.racks[t.b]
        latency_us = fab.base_us + fab.hop_us("leaf_up" if cross else "nic")
        # A part shows a fault only where its even share of a link is close to what the flow gets: a host link
        # behind an uplink shared by 30 flows runs at 1/30 of its rate, so a quarter of its rate goes unseen.
        tested = tuple(p for p in self.parts(t) if any(
            capacity[link] / users[link] <= HEADROOM * rate_of[(t, k)]
            for k in (0, 1) for link in paths[(t, k)] if link.split(">")[0] == p))
        # The longer of: both directions at once, sharing the links max-min with the round (a full-duplex
        # stack), and each direction in turn, alone on its path (a stack that alternates them, as gloo's swap:
        # on the testbed it takes twice the shared time alone in a rack, and matches it where two pairs share an
        # uplink, their turns interleaving). A duplex stack unshared then runs at 2x the model everywhere alike,
        # which the fleet's typical ratio absorbs.
        alone = sum(sizes["p2p"] / min(capacity[link] for link in paths[(t, k)]) for k in (0, 1))
        out[t] = Expectation(max(sizes["p2p"] / slowest, alone) + latency_us * 1e-6, tested)
    for t in tests:
      if t.kind == "p2p":
        continue
      if t.kind not in ("all_reduce", "scale_up"):
        continue  # loss: a share of segments, no model
      try:
        if t.kind == "all_reduce":
          cross = self.racks[t.a] != self.racks[t.b]
          shape = fcoll.Shape(1, 1, 2) if cross else fcoll.Shape(1, 2)
          pred = fcoll.predict(_one_rank_per_node(fab), "all_reduce", sizes["all_reduce"], shape, "ring")
        else:
          pred = fcoll.predict(fab, "all_reduce", sizes["scale_up"], fcoll.Shape(self.gpus_per_node))
        out[t] = Expectation(pred.time_us * 1e-6, self.parts(t))
      except (ValueError, fcoll.FabricError):
        pass
    return out


HEADROOM = 1.5  # a part whose share of a test's links is within this factor of the test's rate is tested by it


@dataclasses.dataclass(frozen=True)
class Expectation:
  seconds: float | None
  tested: tuple[str, ...]  # the parts a fault would slow this test through (a fast result clears only these)


def _one_rank_per_node(fab: Fabric) -> Fabric:
  """The fabric seen by one rank per node on one rail: a pair test uses one NIC of each node."""
  return dataclasses.replace(fab, gpus_per_node=1, nodes_per_domain=1, nics_per_node=1)


AUTO_P2P_S = 0.01  # the automatic swap size takes this long at the NIC's rate: bandwidth-bound, not latency-bound


def auto_p2p_bytes(fab: Fabric | None) -> int:
  """The swap size when none is given: 1 MiB, or the power of two that takes AUTO_P2P_S at the fabric's NIC rate
  where that is more (12.5 GB/s NICs: 128 MiB), at most 1 GiB. A latency-bound swap measures the hosts'
  scheduling, whose noise a slow link hides in."""
  size = 1 << 20
  if fab is not None and fab.nic_gbps:
    while size < fab.nic_gbps * 1e9 * AUTO_P2P_S and size < 1 << 30:
      size <<= 1
  return size


def rails_for(fab: Fabric | None, local_devices: int) -> int:
  """Rails to test: one per NIC where the node has several and a device to drive each (GPU r uses NIC r on a
  rail-optimized node), else one (the node's link as a whole)."""
  if fab is None or fab.nics_per_node <= 1 or local_devices < fab.nics_per_node:
    return 1
  return fab.nics_per_node


def racks_from_fabric(fab: Fabric | None, nodes: int) -> tuple[int, ...]:
  """Rack (leaf) of each node, filling the fabric's leaves in order; one rack without a fabric."""
  per = fab.nodes_per_leaf if fab is not None else nodes
  return tuple(i // max(1, per) for i in range(nodes))


def median(values: Sequence[float]) -> float:
  vals = sorted(values)
  if not vals:
    return math.nan
  mid = len(vals) // 2
  return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
