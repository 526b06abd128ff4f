"""Described machines: nodes under L1 switches under groups, the study's levels q1/q2/q3, and placement classes.

q1 = GPUs per node, q2 = GPUs under one L1 switch, q3 = GPUs in one group (Dragonfly group, cell). A
machine is an allocation of `nodes` nodes, by default filling L1 switches and groups in order; a node map
(hostname, group, L1 per line) describes a real allocation's nodes instead. Presets hold the study's
systems (docs/study.md, section 5) and the emulated cluster (`testbed`: racks are L1 switches).

Placement classes and their locality scores are the study's; `feasible_classes` applies its rules (allowed
classes per strategy, same-l1-N needs more than N nodes' worth of GPUs, caps at q2 and q3) plus what this
machine can host at all (a class needing two groups on a one-group machine is dropped).
"""

from __future__ import annotations

import dataclasses

from microbench.cluster import testbed as tbm
from microbench.fabric import description as fd
from microbench.study import workloads as wl
from microbench.fabric import rates

CLASSES: dict[str, float] = {
    "intra-l1": 1.0,
    "intra-group-same-l1-4": 1.2,
    "intra-group-same-l1-2": 1.5,
    "intra-group": 2.0,
    "inter-group-same-l1-4": 2.25,
    "inter-group-same-l1-2": 2.5,
    "inter-group": 3.0,
}


class MachineError(ValueError):
  """A bad machine description; the message is one line saying what is allowed."""


@dataclasses.dataclass(frozen=True)
class Machine:
  name: str
  gpus_per_node: int
  nodes_per_l1: int
  l1_per_group: int
  nodes: int
  gpu: str = "A100"
  size_table: str = "concurrent"  # which of the study's job-size tables applies (dgx: one 8-GPU node)
  g_min: int | None = None  # smallest job (default max(8, 2 q1), scaled with the sizes)
  # The generator's capacities for intra-l1 and intra-group jobs, in GPUs (0: q2 and q3). The artifact's LUMI
  # command gives q2 = 128, q3 = 15744 while JobPlacer's LUMI.toml has 8-node switch pairs in 124-node groups.
  class_q2_gpus: int = 0
  class_q3_gpus: int = 0
  # An explicit allocation: per node (hostname, group, l1); empty means "fill switches in order".
  layout: tuple[tuple[str, int, int], ...] = ()
  # The emulated cluster's links (testbed only).
  host_rate: str = ""
  uplink_rate: str = ""
  queue: str = "fifo"  # each shaped link's queue (rates.QUEUES): fifo, or fair (one per host pair)
  faults: tuple[str, ...] = ()  # planted link faults, microbench-testbed --fault syntax (`fault=h3:rate=0.25`)

  @property
  def q1(self) -> int:
    return self.gpus_per_node

  @property
  def q2(self) -> int:
    return self.gpus_per_node * self.nodes_per_l1

  @property
  def q3(self) -> int:
    return self.q2 * self.l1_per_group

  @property
  def class_q2(self) -> int:
    return self.class_q2_gpus or self.q2

  @property
  def class_q3(self) -> int:
    return self.class_q3_gpus or self.q3

  @property
  def total_gpus(self) -> int:
    return self.nodes * self.gpus_per_node

  def l1_of(self, node: int) -> int:
    return self.layout[node][2] if self.layout else node // self.nodes_per_l1

  def group_of(self, node: int) -> int:
    return self.layout[node][1] if self.layout else node // (self.nodes_per_l1 * self.l1_per_group)

  def hostname(self, node: int) -> str | None:
    return self.layout[node][0] if self.layout else None

  def l1s(self) -> dict[int, list[int]]:
    """L1 switch -> its nodes (in node order)."""
    out: dict[int, list[int]] = {}
    for n in range(self.nodes):
      out.setdefault(self.l1_of(n), []).append(n)
    return out

  def groups(self) -> dict[int, list[int]]:
    """Group -> its L1 switches."""
    out: dict[int, list[int]] = {}
    for l1, nodes in self.l1s().items():
      g = self.group_of(nodes[0])
      if l1 not in out.setdefault(g, []):
        out[g].append(l1)
    return out

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(q1=self.q1, q2=self.q2, q3=self.q3, total_gpus=self.total_gpus)
    d["layout"] = [list(x) for x in self.layout]
    return d

  @classmethod
  def from_json(cls, d: dict) -> Machine:
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in d.items() if k in fields}
    kw["layout"] = tuple(tuple(x) for x in kw.get("layout", ()))
    kw["faults"] = tuple(kw.get("faults", ()))
    return cls(**kw)


def _shape(system: str) -> dict:
  """A system's node and switch shape, from its fabric description (one place for the study and the models)."""
  d = fd.SYSTEMS[system]
  return dict(gpus_per_node=d["gpus_per_node"], nodes_per_l1=d["nodes_per_leaf"], l1_per_group=d["leaves_per_group"],
              gpu=d["gpu"])


PRESETS: dict[str, dict] = {
    # Dragonfly+: 18 L1 switches x 10 nodes per group, 4 A100 per node; the study ran 510 nodes.
    "leonardo": dict(_shape("leonardo"), nodes=510),
    # 8 MI250X GCDs per node, g_min 16, 320 nodes, the 8-GPU extended table (the artifact's LUMI command).
    # Nodes and switches from the fabric's description (cabinets as Dragonfly groups, 8-node switches, 16 per
    # group); the generator's capacities stay the command's q2/q3 = 128/15744 GPUs.
    "lumi": dict(_shape("lumi"), nodes=320, g_min=16, size_table="extended",
                 class_q2_gpus=128, class_q3_gpus=15744),
    # Slingshot groups of ~84-112 nodes, virtual switches of ~7 nodes; 4 GH200 per node; 330 nodes.
    "alps": dict(_shape("alps"), nodes=330),
    # 240-node groups (5 racks x 3 L1 x 16 nodes), 4 GH200 per node; 650 nodes.
    "jupiter": dict(_shape("jupiter"), nodes=650),
    # One DGX A100: 8 GPUs, the study's DGX size table and g_min 2.
    "dgx": dict(_shape("dgx"), nodes=1, size_table="dgx", g_min=2),
    # The emulated cluster (microbench-testbed): racks are L1 switches behind one core; see `testbed` below.
    "testbed": dict(gpus_per_node=1, nodes_per_l1=2, l1_per_group=4, nodes=8, gpu="A100",
                    host_rate="400mbit", uplink_rate="100mbit"),
}
_INT_KEYS = ("gpus_per_node", "nodes_per_l1", "l1_per_group", "nodes", "g_min", "racks", "hosts_per_rack",
             "groups", "class_q2_gpus", "class_q3_gpus")
_KEYS = _INT_KEYS + ("gpu", "size_table", "host_rate", "uplink_rate", "queue", "fault")


def parse(spec: str, node_map: str | None = None,
          layout: tuple[tuple[str, int, int], ...] | None = None) -> Machine:
  """`leonardo`, `leonardo:nodes=64`, `testbed:racks=4,hosts_per_rack=2`, or `custom:gpus_per_node=4,
  nodes_per_l1=10,l1_per_group=18,nodes=64`; `node_map` (a file of `hostname group l1` lines) describes the
  allocation's real nodes instead of filling switches in order; so does `layout` (those rows, read from
  SLURM: `allocation_layout`)."""
  name, _, rest = spec.strip().partition(":")
  name = name.lower()
  if name not in PRESETS and name != "custom":
    raise MachineError(f"unknown machine {name!r}; choose one of {', '.join(PRESETS)} or custom:KEY=VALUE,...")
  kw: dict = dict(PRESETS.get(name, {}))
  for item in filter(None, (p.strip() for p in rest.split(","))):
    key, eq, value = item.partition("=")
    if not eq or key not in _KEYS:
      raise MachineError(f"bad machine option {item!r}; keys: {', '.join(_KEYS)}")
    if key in _INT_KEYS:
      try:
        kw[key] = int(value)
      except ValueError:
        raise MachineError(f"machine option {key}={value!r} must be an integer") from None
      if kw[key] < 1:
        raise MachineError(f"machine option {key}={value} must be >= 1")
    elif key == "fault":  # repeatable, one per part (several keys of one part: repeat it, they merge)
      kw["faults"] = kw.get("faults", ()) + (value,)
    else:
      kw[key] = value
  if name == "testbed":  # racks x hosts per rack, racks split evenly into (logical) groups
    racks = kw.pop("racks", kw["l1_per_group"])
    kw["nodes_per_l1"] = kw.pop("hosts_per_rack", kw["nodes_per_l1"])
    groups = kw.pop("groups", 1)
    if racks % groups:
      raise MachineError(f"testbed racks={racks} must be a multiple of groups={groups}")
    kw["l1_per_group"] = racks // groups
    kw["nodes"] = racks * kw["nodes_per_l1"]
    if kw.get("queue", "fifo") not in rates.QUEUES:
      raise MachineError(f"testbed queue={kw['queue']!r}: choose one of {', '.join(rates.QUEUES)}")
    try:  # faults: the testbed's own check (syntax, parts that exist, a rate fraction of a shaped link)
      if kw.get("faults"):
        tbm.Testbed(prefix="tbcheck", hosts=kw["nodes"], racks=racks, host_rate=rates.parse_rate(kw["host_rate"]),
                    uplink_rate=rates.parse_rate(kw["uplink_rate"]) if racks > 1 else None, faults=kw["faults"])
    except ValueError as e:
      raise MachineError(f"testbed {e}") from None
  elif {"racks", "hosts_per_rack", "groups", "queue", "faults"} & set(kw):
    raise MachineError("racks, hosts_per_rack, groups, queue and fault describe the testbed machine only")
  missing = [k for k in ("gpus_per_node", "nodes_per_l1", "l1_per_group", "nodes") if k not in kw]
  if missing:
    raise MachineError(f"custom machine needs {', '.join(missing)}")
  try:
    wl.gpu(kw.get("gpu", "A100"))
  except wl.WorkloadError as e:
    raise MachineError(str(e)) from None
  if kw.get("size_table", "concurrent") not in ("concurrent", "extended", "dgx"):
    raise MachineError("size_table must be concurrent, extended or dgx")
  kw["gpu"] = wl.gpu(kw.get("gpu", "A100")).name
  if node_map or layout:
    kw["layout"] = tuple(layout) if layout else read_node_map(node_map)
    kw["nodes"] = len(kw["layout"])
  return Machine(name=name, **kw)


def read_node_map(path: str) -> tuple[tuple[str, int, int], ...]:
  """`hostname group l1` per line (# comments), in the order ranks should fill them."""
  out = []
  try:
    with open(path, encoding="utf-8") as f:
      for i, line in enumerate(f, 1):
        parts = line.split("#")[0].split()
        if not parts:
          continue
        if len(parts) != 3:
          raise MachineError(f"{path}:{i}: want `hostname group l1`, got {line.strip()!r}")
        try:
          out.append((parts[0], int(parts[1]), int(parts[2])))
        except ValueError:
          raise MachineError(f"{path}:{i}: group and l1 must be integers") from None
  except OSError as e:
    raise MachineError(f"cannot read node map {path}: {e.strerror}") from None
  if not out:
    raise MachineError(f"node map {path} lists no nodes")
  return tuple(out)


def fabric_of(machine: Machine) -> fd.Fabric:
  """The machine's links: its system's description reshaped to this machine, or the testbed's shaped links."""
  if machine.name == "testbed":
    host, up = rates.parse_rate(machine.host_rate), rates.parse_rate(machine.uplink_rate)
    return fd.testbed(machine.nodes_per_l1, host and rates.gbytes_per_s(host), up and rates.gbytes_per_s(up),
                      racks=machine.nodes // machine.nodes_per_l1, queue=machine.queue)
  if machine.name not in fd.SYSTEMS:
    raise MachineError(f"machine {machine.name!r} has no link description; predictions need one of"
                       f" {', '.join(fd.SYSTEMS)} or testbed")
  base = fd.system(machine.name)
  return dataclasses.replace(base, gpus_per_node=machine.gpus_per_node, nodes_per_leaf=machine.nodes_per_l1,
                             leaves_per_group=machine.l1_per_group)


def nodes_for(machine: Machine, gpus: int) -> int:
  return wl.ceil_div(gpus, machine.gpus_per_node)


def same_l1_chunk(name: str) -> int:
  """N of a `same-l1-N` placement class (nodes per L1 switch), else 0."""
  return int(name.rsplit("-", 1)[1]) if "same-l1" in name else 0


def class_fits(machine: Machine, name: str, gpus: int) -> bool:
  """The study's rules for one class and job size, plus whether this machine has room for the shape."""
  n = nodes_for(machine, gpus)
  chunk = same_l1_chunk(name)
  if chunk and (gpus <= chunk * machine.q1 or n % chunk):
    return False
  if name == "intra-l1":
    return gpus <= machine.q2 and any(len(v) >= n for v in machine.l1s().values())
  if n < 2:
    return False  # a one-node job never leaves its node: only intra-l1 describes it
  groups, l1s = machine.groups(), machine.l1s()
  if name.startswith("intra-group"):
    if gpus > machine.q3:
      return False
    for members in groups.values():
      sizes = [len(l1s[l]) for l in members]
      if chunk:
        if sum(1 for s in sizes if s >= chunk) >= n // chunk:
          return True
      elif len(sizes) >= 2 and sum(sizes) >= n:
        return True
    return False
  if len(groups) < 2:
    return False
  if chunk:
    return sum(1 for l in l1s.values() if len(l) >= chunk) >= n // chunk and n // chunk >= 2
  return sum(len(v) for v in l1s.values()) >= n


def feasible_classes(machine: Machine, strategy: str, gpus: int) -> list[str]:
  return [c for c in wl.strategy(strategy).placements if class_fits(machine, c, gpus)]


def classify(machine: Machine, nodes: list[int]) -> str:
  """The placement class a concrete node list has: one L1 switch; one group or several; and whether the
  nodes come in chunks of 4 or 2 consecutive ranks' nodes under one L1 switch each (several chunks may share
  a switch, as JobPlacer packs them; the job spans two switches or more)."""
  if len({machine.l1_of(n) for n in nodes}) == 1:
    return "intra-l1"
  scope = "intra-group" if len({machine.group_of(n) for n in nodes}) == 1 else "inter-group"
  for chunk in (4, 2):
    if len(nodes) % chunk == 0 and len(nodes) > chunk:
      parts = [nodes[i:i + chunk] for i in range(0, len(nodes), chunk)]
      if all(len({machine.l1_of(n) for n in p}) == 1 for p in parts):
        return f"{scope}-same-l1-{chunk}"
  return scope


def satisfies(machine: Machine, nodes: list[int], name: str) -> bool:
  """Whether a node list (in rank order) has the properties of class `name`: one switch; two or more
  switches of one group; two groups or more; same-l1-N: besides, every N consecutive ranks' nodes under one
  switch (blocks may share a switch)."""
  l1s = {machine.l1_of(n) for n in nodes}
  if name == "intra-l1":
    return len(l1s) == 1
  groups = {machine.group_of(n) for n in nodes}
  if len(l1s) < 2 or (len(groups) == 1) != name.startswith("intra-group"):
    return False
  chunk = same_l1_chunk(name)
  if not chunk:
    return True
  return len(nodes) % chunk == 0 and all(len({machine.l1_of(n) for n in nodes[i:i + chunk]}) == 1
                                         for i in range(0, len(nodes), chunk))


def expand_hostlist(text: str) -> list[str]:
  """SLURM's compressed host list (`nid00[5000-5002,5007],login1`) as names, in order."""
  out: list[str] = []
  depth, cur, items = 0, "", []
  for ch in text.strip():
    if ch == "," and depth == 0:
      items.append(cur)
      cur = ""
      continue
    depth += (ch == "[") - (ch == "]")
    cur += ch
  items.append(cur)
  for item in filter(None, (x.strip() for x in items)):
    if "[" not in item:
      out.append(item)
      continue
    head, _, rest = item.partition("[")
    body, _, tail = rest.partition("]")
    for part in body.split(","):
      lo, dash, hi = part.partition("-")
      if not dash:
        out += [h + t for h in [head + lo] for t in expand_hostlist(tail) or [""]]
        continue
      for i in range(int(lo), int(hi) + 1):
        out += [head + str(i).zfill(len(lo)) + t for t in (expand_hostlist(tail) or [""])]
  return out


def read_slurm_topology(text: str) -> dict[str, tuple[str, str]]:
  """host -> (group, L1 switch) from `scontrol show topology` output or a topology.conf (topology/tree): a
  leaf switch (one that lists Nodes= and no Switches=) is the host's L1; the switch that lists the leaf among
  its Switches= is its group (in a two-level tree, the core: one group); a leaf no switch lists is its own
  group."""
  leaves: dict[str, list[str]] = {}
  parents: dict[str, str] = {}
  for line in text.splitlines():
    line = line.split("#")[0].strip()
    fields = dict(t.split("=", 1) for t in line.split() if "=" in t)
    name = fields.get("SwitchName")
    if not name:
      continue
    if "Switches" in fields:
      for child in expand_hostlist(fields["Switches"]):
        parents.setdefault(child, name)
    elif "Nodes" in fields:
      leaves[name] = expand_hostlist(fields["Nodes"])
  return {h: (parents.get(leaf, leaf), leaf) for leaf, hosts in leaves.items() for h in hosts}


def allocation_layout(hosts: list[str], topology: dict[str, tuple[str, str]]) -> tuple[tuple[str, int, int], ...]:
  """The allocation's hosts (in order) as node-map rows (hostname, group, l1), groups and switches numbered
  in order of first appearance. MachineError names a host the topology does not list."""
  missing = [h for h in hosts if h not in topology]
  if missing:
    raise MachineError(f"SLURM's topology lists no switch for host(s) {', '.join(missing[:5])}")
  groups: dict[str, int] = {}
  l1s: dict[str, int] = {}
  return tuple((h, groups.setdefault(topology[h][0], len(groups)), l1s.setdefault(topology[h][1], len(l1s)))
               for h in hosts)
