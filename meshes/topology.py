"""The machine as `racks x nodes x gpus`, and the device order that makes a node's devices contiguous.

A *node* is one host (all processes on the same hostname), a *rack* is a group of nodes sharing an NVLink
domain (NVL72-style), `gpus` is devices per node. `nodes` counts nodes per rack, so the product of the
three is the device count.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

AXES = ("rack", "node", "gpu")


class TopologyError(ValueError):
  """A topology that can't describe the devices; the message says what is allowed."""


@dataclasses.dataclass(frozen=True)
class Topology:
  racks: int
  nodes: int  # per rack
  gpus: int  # per node

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.racks, self.nodes, self.gpus)

  @property
  def num_devices(self) -> int:
    return self.racks * self.nodes * self.gpus

  @property
  def total_nodes(self) -> int:
    return self.racks * self.nodes

  def __str__(self) -> str:
    return f"racks:{self.racks},nodes:{self.nodes},gpus:{self.gpus}"

  def as_dict(self) -> dict[str, int]:
    return {"racks": self.racks, "nodes": self.nodes, "gpus": self.gpus}


_KEYS = ("racks", "nodes", "gpus")


def parse_topology(text: str) -> Topology:
  """Parses `racks:R,nodes:N,gpus:G` (racks and nodes default to 1; gpus must be given)."""
  values = {k: 1 for k in _KEYS}
  seen = set()
  for part in filter(None, (p.strip() for p in text.split(","))):
    m = re.fullmatch(r"([a-z_]+)\s*[:=]\s*(\d+)", part)
    if not m or m.group(1) not in _KEYS:
      raise TopologyError(
          f"bad topology item {part!r} in {text!r}: expected racks:R,nodes:N,gpus:G (e.g. nodes:2,gpus:4)")
    key, val = m.group(1), int(m.group(2))
    if key in seen:
      raise TopologyError(f"topology {text!r} names {key} twice")
    if val < 1:
      raise TopologyError(f"topology {text!r}: {key} must be >= 1")
    seen.add(key)
    values[key] = val
  if not seen:
    raise TopologyError(f"empty topology {text!r}: expected racks:R,nodes:N,gpus:G (e.g. nodes:2,gpus:4)")
  if "gpus" not in seen:  # racks and nodes default to 1 naturally; a node of one GPU is rarely what was meant
    raise TopologyError(f"topology {text!r} does not say how many GPUs a node has: add gpus:G (e.g."
                        f" {text.strip().rstrip(',')},gpus:8; gpus:1 for one device per node)")
  return Topology(**values)


def topology_from_hosts(device_hosts: Sequence[str], nodes_per_rack: int | None = None
                        ) -> tuple[Topology, list[int]]:
  """Derives the topology from the host of each device (devices given in (process, id) order).

  Returns the topology and a permutation of device indices that puts each node's devices together,
  nodes in order of first appearance. Every host must hold the same number of devices, and
  `nodes_per_rack` (default: all nodes in one rack) must divide the node count.
  """
  order: dict[str, list[int]] = {}
  for i, host in enumerate(device_hosts):
    order.setdefault(host, []).append(i)
  counts = {h: len(v) for h, v in order.items()}
  if len(set(counts.values())) != 1:
    raise TopologyError(f"hosts hold different numbers of devices ({counts}); a topology needs the same count"
                        " on every node: pass --topology to describe the machine explicitly")
  num_nodes = len(order)
  per_rack = nodes_per_rack or num_nodes
  if per_rack < 1 or num_nodes % per_rack:
    raise TopologyError(f"--nodes_per_rack={per_rack} must divide the node count {num_nodes}")
  gpus = next(iter(counts.values()))
  perm = [i for idxs in order.values() for i in idxs]
  return Topology(racks=num_nodes // per_rack, nodes=per_rack, gpus=gpus), perm


def check_matches(topology: Topology, num_devices: int) -> None:
  if topology.num_devices != num_devices:
    raise TopologyError(
        f"topology {topology} has {topology.num_devices} devices but {num_devices} are available;"
        f" choose racks*nodes*gpus = {num_devices}")
