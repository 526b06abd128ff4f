"""One description of a machine's links per level, with rates and latencies, that every model reads.

Levels, inner to outer, each a unit holding units of the level below:
- `scale_up`: each GPU's link into its NVLink domain (a node, or `nodes_per_domain` nodes as in an NVL72 rack);
- `nic`: a domain's NICs into its leaf switch (`nics_per_node` of `nic` per node);
- `leaf_up`: a leaf (L1) switch's uplinks to its group's spine (total GB/s per direction);
- `group_up`: a group's global links (Dragonfly group, fat-tree pod; total GB/s per direction).
`None` for `leaf_up_gbps` / `group_up_gbps` is non-blocking: the level carries whatever enters it from below.

Rates are GB/s per direction (decimal, the unit of busbw). Latencies are per hop as NCCL's tuning model
counts them (collectives.md: base 8.4 us, NVLink hop ~3.4-4.0 us, network hop ~14 us); a fitted level
replaces them with what a sweep measured (`fitted`). The systems below are the study's machines and an
NVL72 rack: where a figure is not public (leaf and group uplinks), the level is non-blocking and the
`assumed` list says so, so every prediction made on it can carry its assumptions.
"""

from __future__ import annotations

import dataclasses
import math

from microbench.fabric import link_peaks
from microbench.fabric import rates

BASE_US = 8.4  # NCCL's base latency (Simple protocol), collectives.md
NVLINK_HOP_US = 3.7  # NCCL's NVLink hop, 3.4-4.0 us
NET_HOP_US = 14.0  # NCCL's network hop
LEVELS = ("scale_up", "nic", "leaf_up", "group_up")


class FabricError(ValueError):
  """A fabric that can't be described or used; the message is one line saying what is allowed."""


@dataclasses.dataclass(frozen=True)
class Fabric:
  name: str
  gpu: str
  gpus_per_node: int
  scale_up_gbps: float | None  # per GPU per direction; None: no scale-up link (one GPU per domain)
  nic_gbps: float | None  # per NIC per direction; None: a single domain (no network)
  nics_per_node: int
  nodes_per_leaf: int
  leaves_per_group: int
  nodes_per_domain: int = 1
  leaf_up_gbps: float | None = None  # per leaf per direction; None: non-blocking
  group_up_gbps: float | None = None  # per group per direction; None: non-blocking
  scale_up_link: str = ""
  nic_link: str = ""
  base_us: float = BASE_US
  scale_up_hop_us: float = NVLINK_HOP_US
  net_hop_us: float = NET_HOP_US
  uplink_hop_us: float | None = None  # a hop whose path crosses leaf uplinks; None: as net_hop_us
  assumed: tuple[str, ...] = ()
  fitted_levels: tuple[str, ...] = ()

  @property
  def gpus_per_domain(self) -> int:
    return self.gpus_per_node * self.nodes_per_domain

  @property
  def nics_per_domain(self) -> int:
    return self.nics_per_node * self.nodes_per_domain

  @property
  def domains_per_leaf(self) -> int:
    return max(1, self.nodes_per_leaf // self.nodes_per_domain)

  def capacity(self, level: str, ranks_inside: int) -> float | None:
    """GB/s per direction out of one unit of `level` holding `ranks_inside` of a job's ranks (None:
    unknown). Non-blocking levels pass what enters them: the NICs of the domains below."""
    if level == "scale_up":
      return self.scale_up_gbps
    domain_out = None if self.nic_gbps is None else self.nic_gbps * self.nics_per_domain
    if level == "nic":
      return domain_out
    if domain_out is None:
      return None
    domains = max(1, math.ceil(ranks_inside / self.gpus_per_domain))
    below = domains * domain_out
    explicit = self.leaf_up_gbps if level == "leaf_up" else self.group_up_gbps
    return below if explicit is None else min(explicit, below)

  def hop_us(self, level: str) -> float:
    """The hop latency of a step whose path leaves a unit of `level` (across racks: the uplinks' own, when a
    sweep measured it, since on a real fabric those paths cross more switches)."""
    if level == "scale_up":
      return self.scale_up_hop_us
    if level in ("leaf_up", "group_up") and self.uplink_hop_us is not None:
      return self.uplink_hop_us
    return self.net_hop_us

  def fitted(self, level: str, gbps: float | None = None, hop_us: float | None = None) -> Fabric:
    """This fabric with one level's rate and hop latency taken from a fit: scale_up per GPU, nic per NIC,
    leaf_up and group_up per switch, all per direction."""
    if level not in LEVELS:
      raise FabricError(f"unknown level {level!r}; levels: {', '.join(LEVELS)}")
    change: dict = {}
    if gbps is not None:
      key = {"scale_up": "scale_up_gbps", "leaf_up": "leaf_up_gbps", "group_up": "group_up_gbps"}.get(level)
      if level == "nic":
        change["nic_gbps"] = gbps  # per NIC: a sweep's scale_out scope is one rail (one GPU, one NIC per node)
      else:
        change[key] = gbps
    if hop_us is not None:
      change[{"scale_up": "scale_up_hop_us", "nic": "net_hop_us"}.get(level, "uplink_hop_us")] = hop_us
    return dataclasses.replace(self, fitted_levels=tuple(dict.fromkeys(self.fitted_levels + (level,))),
                               **change)

  def describe(self) -> list[str]:
    """One line per level, for reports and predictions."""
    out = [f"{self.name}: {self.gpus_per_node} x {self.gpu} per node"
           + (f", NVLink domain of {self.nodes_per_domain} nodes" if self.nodes_per_domain > 1 else "")]
    if self.scale_up_gbps:
      out.append(f"scale_up: {self.scale_up_gbps:g} GB/s per GPU ({self.scale_up_link or 'given'}), hop"
                 f" {self.scale_up_hop_us:g} us")
    if self.nic_gbps:
      out.append(f"nic: {self.nics_per_node:g} x {self.nic_gbps:g} GB/s per node ({self.nic_link or 'given'}),"
                 f" hop {self.net_hop_us:g} us")
      out.append(f"leaf_up: {self.nodes_per_leaf} nodes per leaf, "
                 + (f"{self.leaf_up_gbps:g} GB/s up" if self.leaf_up_gbps else "non-blocking")
                 + (f", hop across it {self.uplink_hop_us:g} us" if self.uplink_hop_us is not None else ""))
      out.append(f"group_up: {self.leaves_per_group} leaves per group, "
                 + (f"{self.group_up_gbps:g} GB/s out" if self.group_up_gbps else "non-blocking"))
    if self.fitted_levels:
      out.append(f"fitted from sweeps: {', '.join(self.fitted_levels)}")
    out += [f"assumed: {a}" for a in self.assumed]
    return out

  def level_peaks(self) -> dict[str, link_peaks.LevelPeak]:
    """The link peaks the sweeps report (link_peaks.LEVELS), from this description: one place, not two."""
    out = {}
    if self.scale_up_gbps:
      out["scale_up"] = link_peaks.LevelPeak(self.scale_up_gbps, self.scale_up_link or f"{self.scale_up_gbps:g} GB/s",
                                        f"fabric {self.name}")
      if self.nodes_per_domain > 1:
        out["rack_scale"] = dataclasses.replace(out["scale_up"])
    if self.nic_gbps:
      # The sweeps' peak is per rank: a GPU's share of its node's NICs.
      per_rank = self.nic_gbps * self.nics_per_node / self.gpus_per_node
      out["scale_out"] = link_peaks.LevelPeak(per_rank, self.nic_link or f"{per_rank:g} GB/s", f"fabric {self.name}")
    return out


def _link(name: str) -> float:
  return link_peaks.LINKS[name][0]


_UPLINKS = "leaf and group uplinks non-blocking (no public figure; an upper bound where they are tapered)"
SYSTEMS: dict[str, dict] = {
    "leonardo": dict(gpu="A100", gpus_per_node=4, scale_up_link="nvlink3", nic_link="hdr100", nics_per_node=4,
                     nodes_per_leaf=10, leaves_per_group=18, assumed=(_UPLINKS,)),
    # LUMI-G: HPE Cray EX cabinets as Dragonfly groups of ~124 nodes, switches serving 8 nodes, 16 per group
    # (the study's node map of LUMI; the same shape the study's machine uses).
    "lumi": dict(gpu="MI250X", gpus_per_node=8, scale_up_link="xgmi", nic_link="slingshot11", nics_per_node=4,
                 nodes_per_leaf=8, leaves_per_group=16,
                 assumed=(_UPLINKS, "Infinity Fabric as one 50 GB/s link per GCD (the slowest GCD pair)")),
    "alps": dict(gpu="GH200", gpus_per_node=4, scale_up_link="nvlink4", nic_link="slingshot11", nics_per_node=4,
                 nodes_per_leaf=7, leaves_per_group=14, assumed=(_UPLINKS,)),
    "jupiter": dict(gpu="GH200", gpus_per_node=4, scale_up_link="nvlink4", nic_link="ndr200", nics_per_node=4,
                    nodes_per_leaf=16, leaves_per_group=15, assumed=(_UPLINKS,)),
    "dgx": dict(gpu="A100", gpus_per_node=8, scale_up_link="nvlink3", nic_link="hdr", nics_per_node=8,
                nodes_per_leaf=1, leaves_per_group=1, assumed=(_UPLINKS,)),
    # A GB200 NVL72 rack: 18 trays of 4 GPUs in one NVLink5 domain, a 400 Gb/s NIC per GPU, a rack per leaf.
    "nvl72": dict(gpu="GB200", gpus_per_node=4, nodes_per_domain=18, scale_up_link="nvlink5", nic_link="ndr",
                  nics_per_node=4, nodes_per_leaf=18, leaves_per_group=8,
                  assumed=(_UPLINKS, "one ConnectX-7 (400 Gb/s) per GPU")),
}


def system(name: str) -> Fabric:
  """A described system by name (SYSTEMS)."""
  key = name.strip().lower()
  if key not in SYSTEMS:
    raise FabricError(f"unknown fabric {name!r}; choose one of {', '.join(SYSTEMS)} or testbed")
  d = dict(SYSTEMS[key])
  return Fabric(name=key, scale_up_gbps=_link(d["scale_up_link"]), nic_gbps=_link(d["nic_link"]), **d)


TESTBED_QUEUES = {
    "fifo": "links are drop-tail FIFO queues under TCP: a flow through several congested links gets less than"
            " its max-min share there (TCP's parking-lot effect, not modelled)",
    "fair": "links serve host pairs in turn (fair queues): max-min sharing is what they do",
}


def testbed(hosts_per_rack: int, host_rate_gbps: float | None, uplink_rate_gbps: float | None,
            racks: int = 4, hop_us: float = 0.0, queue: str = "fifo") -> Fabric:
  """The emulated cluster: one rank per host, a shaped veth per host into its rack's bridge, one shaped
  uplink per rack into the core (the core itself is not shaped: non-blocking); `queue` as the testbed's
  links (microbench-testbed --queue), said in the assumptions."""
  return Fabric(name="testbed", gpu="cpu", gpus_per_node=1, scale_up_gbps=None, nic_gbps=host_rate_gbps,
                nics_per_node=1, nodes_per_leaf=hosts_per_rack, leaves_per_group=racks,
                leaf_up_gbps=uplink_rate_gbps, nic_link="veth (tc tbf)", net_hop_us=hop_us, base_us=0.0,
                assumed=("one rank per host; latencies until fitted: none", TESTBED_QUEUES[queue]))


def parse(spec: str) -> Fabric:
  """`leonardo`, ..., or `testbed:racks=4,hosts_per_rack=2,host_rate=400mbit,uplink_rate=100mbit`; any described
  system also takes `leaf_up=GBPS,group_up=GBPS` (tapered uplinks) and `nic=GBPS,scale_up=GBPS`."""
  name, _, rest = spec.strip().partition(":")
  opts = {}
  for item in filter(None, (p.strip() for p in rest.split(","))):
    key, eq, value = item.partition("=")
    if not eq:
      raise FabricError(f"bad fabric option {item!r}: want KEY=VALUE")
    opts[key.strip()] = value.strip()
  if name.strip().lower() == "testbed":
    known = {"racks", "hosts_per_rack", "host_rate", "uplink_rate", "queue"}
    if set(opts) - known:
      raise FabricError(f"testbed fabric options: {', '.join(sorted(known))}; got {', '.join(sorted(set(opts) - known))}")
    try:
      host = rates.parse_rate(opts.get("host_rate", "400mbit"))
      up = rates.parse_rate(opts.get("uplink_rate", "100mbit"))
      per_rack, racks = int(opts.get("hosts_per_rack", "2")), int(opts.get("racks", "4"))
    except ValueError as e:
      raise FabricError(f"testbed fabric: {e}") from None
    if per_rack < 1 or racks < 1:
      raise FabricError("testbed fabric: racks and hosts_per_rack must be >= 1")
    queue = opts.get("queue", "fifo")
    if queue not in rates.QUEUES:
      raise FabricError(f"testbed fabric: queue={queue!r}: choose one of {', '.join(rates.QUEUES)}")
    return testbed(per_rack, host and rates.gbytes_per_s(host), up and rates.gbytes_per_s(up), racks, queue=queue)
  fab = system(name)
  keys = {"leaf_up": "leaf_up_gbps", "group_up": "group_up_gbps", "nic": "nic_gbps", "scale_up": "scale_up_gbps"}
  change = {}
  for key, value in opts.items():
    if key not in keys:
      raise FabricError(f"fabric option {key!r}: choose from {', '.join(keys)} (GB/s per direction)")
    try:
      change[keys[key]] = float(value)
    except ValueError:
      change[keys[key]] = float("nan")
    if not change[keys[key]] > 0:
      raise FabricError(f"fabric option {key}={value}: give a positive number of GB/s")
  return dataclasses.replace(fab, **change)
