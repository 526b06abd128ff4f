"""What the fabric model expects of each swept point, so a measured number is read against its machine.

A sweep's expectation needs three things the model does not know by itself:
- which machine: `--fabric=NAME` (a described system, or `testbed:...` on the emulated cluster), else the one
  described system whose GPU kind and GPUs per node match the devices, else a node-only machine from the GPU
  kind's NVLink (no NIC is known, so groups that leave a node get no expectation, and the reason says so);
  CPU devices and unknown kinds get none. `--fabric=none` turns it off.
- where a scope's group sits: its ranks' (node, GPU) positions counted into NVLink domains, leaves and groups
  of leaves in node order (`Shape`), taken from the scope's first group (every group of a scope has the
  same shape);
- what runs beside it: all of a scope's groups run at once, so groups with ranks in one node share its NICs
  and groups in one leaf share its uplinks. Each level's capacity is scaled to the group's share of the
  ranks in that unit (a DGX's 8 per-GPU groups across nodes get one NIC each, as NCCL's rails give them).

A point is LOW when the model says the size is bandwidth-bound (its bandwidth term at least its latency term
and MIN_BANDWIDTH_US) and the measured busbw is under LOW_RATIO of the expected: the model is a link-rate bound (NCCL reaches 0.6-0.9 of it on healthy machines; NVLS's ideal
in-switch bound 0.61), so half of it is far below what a healthy machine gives, not noise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from microbench.fabric import collective_model as fabric_collectives
from microbench.fabric import conventions, gpu_kinds, link_peaks
from microbench.fabric.description import SYSTEMS, Fabric, FabricError, parse, system

LOW_RATIO = 0.5  # measured / expected busbw under this, at a bandwidth-bound size: flagged LOW
# A size is bandwidth-bound when the model's bandwidth term is at least its latency term and at least this: a
# transfer the model gives under 20 us is decided on every machine by fixed costs it may not hold (a kernel
# launch, the host's dispatch; an unfitted testbed has no latency at all).
MIN_BANDWIDTH_US = 20.0
OFF = "none"  # --fabric=none
TESTBED_ENV = "MICROBENCH_FABRIC"  # set by microbench-testbed for its jobs: the emulated cluster as built


@dataclasses.dataclass(frozen=True)
class Machine:
  """The fabric a run is read against (None: no expectation) and where it came from."""
  fabric: Fabric | None
  source: str  # "--fabric=...", "detected: ...", or why there is none

  def describe(self) -> dict[str, Any]:
    return {"source": self.source, "lines": self.fabric.describe() if self.fabric else []}


def _node_only(kind: gpu_kinds.GpuKind, gpus_per_node: int) -> Fabric | None:
  """A machine of `kind` nodes whose NICs are not described: only its NVLink domain is known."""
  link = kind.rack_nvlink or kind.nvlink
  if not link or link not in link_peaks.LINKS:
    return None
  return Fabric(name=f"{kind.name} nodes (detected)", gpu=kind.name, gpus_per_node=gpus_per_node,
                scale_up_gbps=link_peaks.LINKS[link][0], nic_gbps=None, nics_per_node=0, nodes_per_leaf=1,
                leaves_per_group=1, nodes_per_domain=kind.nodes_per_rack if kind.rack_nvlink else 1,
                scale_up_link=link, assumed=(f"NVLink from the GPU kind ({kind.title}: {link}); the NICs are not"
                                             " described: give --fabric for groups across nodes",))


def machine(spec: str | None, device_kind: str, platform: str, gpus_per_node: int,
            environ: Mapping[str, str] | None = None) -> Machine:
  """The run's machine: `spec` (--fabric) when given, else detected: the emulated cluster's own description
  (TESTBED_ENV, which microbench-testbed sets for its jobs), or from the devices. FabricError for a bad spec
  (the CLI turns it into one line)."""
  if spec and spec.strip().lower() == OFF:
    return Machine(None, "--fabric=none: no expectation")
  if spec:
    return Machine(parse(spec), f"--fabric={spec}")
  emulated = (os.environ if environ is None else environ).get(TESTBED_ENV)
  if emulated and platform == "cpu":
    return Machine(parse(emulated), f"detected: the emulated cluster ({TESTBED_ENV}={emulated})")
  if platform == "cpu":
    return Machine(None, "CPU devices: no machine is described for them (on the emulated cluster give"
                         " --fabric=testbed:racks=R,hosts_per_rack=H,host_rate=...,uplink_rate=...)")
  kind = gpu_kinds.lookup(device_kind)
  if kind is None:
    return Machine(None, f"device kind {device_kind!r} is not a known GPU kind: give --fabric")
  matches = [name for name, d in SYSTEMS.items()
             if d["gpu"].lower() == kind.name.lower() and d["gpus_per_node"] == gpus_per_node]
  if len(matches) == 1:
    return Machine(system(matches[0]), f"detected: {kind.title} x {gpus_per_node} per node is {matches[0]}"
                                       " (--fabric to name another)")
  fab = _node_only(kind, gpus_per_node)
  why = (f"{kind.title} x {gpus_per_node} per node matches {', '.join(matches)}" if matches
         else f"no described system has {kind.title} x {gpus_per_node} per node")
  if fab is None:
    return Machine(None, f"{why}, and the kind has no NVLink: give --fabric")
  return Machine(fab, f"detected: {why}; NVLink only, from the GPU kind (--fabric for the NICs)")


@dataclasses.dataclass(frozen=True)
class ScopeModel:
  """A scope's group on the machine: the fabric with each level scaled to the group's share, and its shape;
  or why there is no expectation for the scope."""
  fabric: Fabric | None
  shape: fabric_collectives.Shape | None
  reason: str | None = None
  notes: tuple[str, ...] = ()

  def describe(self) -> dict[str, Any]:
    if self.fabric is None:
      return {"expected": None, "reason": self.reason}
    return {"shape": self.shape.text(), "notes": list(self.notes), "fabric": self.fabric.describe()}


def _positions(flat: Sequence[int], mesh_shape: tuple[int, int, int]) -> list[tuple[int, int]]:
  """(global node, GPU) of flat mesh positions of a (racks, nodes per rack, GPUs per node) mesh."""
  racks, nodes, gpus = mesh_shape
  out = []
  for p in flat:
    r, rest = divmod(int(p), nodes * gpus)
    n, g = divmod(rest, gpus)
    out.append((r * nodes + n, g))
  return out


def _units(fab: Fabric, node: int) -> tuple[int, int, int]:
  """(domain, leaf, group of leaves) of a node, filling them in node order."""
  leaf = node // fab.nodes_per_leaf
  return node // fab.nodes_per_domain, leaf, leaf // fab.leaves_per_group


def scope_model(fab: Fabric | None, reason: str, groups: Any, mesh_shape: tuple[int, int, int]) -> ScopeModel:
  """The model of a scope whose groups (as ScopePlan.groups: [groups, ranks] of flat mesh positions) run at
  once on a (racks, nodes per rack, GPUs per node) mesh."""
  if fab is None:
    return ScopeModel(None, None, reason)
  if mesh_shape[2] > fab.gpus_per_node:
    return ScopeModel(None, None, f"the run has {mesh_shape[2]} devices per node, {fab.name} has"
                                  f" {fab.gpus_per_node} GPUs per node")
  everyone = [_units(fab, node) for g in groups for node, _ in _positions(g, mesh_shape)]
  mine = [_units(fab, node) for node, _ in _positions(groups[0], mesh_shape)]
  if len(mine) < 2:
    return ScopeModel(None, None, "a group of one rank moves nothing")

  def count(units: list[tuple[int, int, int]], i: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for u in units:
      out[u[i]] = out.get(u[i], 0) + 1
    return out

  per_domain, per_leaf, per_group = count(mine, 0), count(mine, 1), count(mine, 2)
  domains_in_leaf = {leaf: len({d for d, l, _ in mine if l == leaf}) for leaf in per_leaf}
  leaves_in_group = {grp: len({l for _, l, g in mine if g == grp}) for grp in per_group}
  shape = fabric_collectives.Shape(max(per_domain.values()), max(domains_in_leaf.values()),
                                   max(leaves_in_group.values()), len(per_group))
  if shape.ranks != len(mine):
    shape = dataclasses.replace(shape, total=len(mine))
  # The group's share of each unit it uses, at the unit where it has least (all groups run at once).
  all_domain, all_leaf, all_group = count(everyone, 0), count(everyone, 1), count(everyone, 2)
  share = {"nic": min(r / all_domain[u] for u, r in per_domain.items()),
           "leaf_up": min(r / all_leaf[u] for u, r in per_leaf.items()),
           "group_up": min(r / all_group[u] for u, r in per_group.items())}
  change: dict[str, Any] = {"nics_per_node": fab.nics_per_node * share["nic"]}
  if fab.leaf_up_gbps is not None:
    change["leaf_up_gbps"] = fab.leaf_up_gbps * share["leaf_up"]
  if fab.group_up_gbps is not None:
    change["group_up_gbps"] = fab.group_up_gbps * share["group_up"]
  scaled = dataclasses.replace(fab, **change)
  try:
    crossed = [lv.name for lv in fabric_collectives.crossed_levels(scaled, shape)]
  except FabricError as e:
    return ScopeModel(None, None, str(e))
  notes = tuple(f"{len(groups)} groups at once: this group's share of each {level} unit it crosses is {s:.3g}"
                for level, s in share.items() if s < 1 and level in crossed)
  return ScopeModel(scaled, shape, None, notes)


def point(model: ScopeModel, family: str, rec: dict[str, Any]) -> dict[str, Any]:
  """The expectation fields of an ok record of collective `family` (all_reduce for all_reduce_max): empty
  where the scope has no model or the collective none (the run's meta.json says why)."""
  if model.fabric is None or family not in conventions.COLLECTIVES or not rec.get("time_us"):
    return {}
  try:
    pred = fabric_collectives.predict(model.fabric, family, rec["bytes"], model.shape)
  except FabricError:
    return {}
  ratio = pred.time_us / rec["time_us"]  # measured busbw / expected busbw (same size, same convention)
  bandwidth_us = pred.time_us - pred.latency_us
  bound = pred.bottleneck if bandwidth_us >= MIN_BANDWIDTH_US else "latency"
  return {"expected_us": pred.time_us, "expected_busbw_gbps": rec["busbw_gbps"] / ratio, "vs_expected": ratio,
          "expected_algorithm": pred.algorithm, "expected_bound": bound, "expected_shape": pred.shape,
          "low": bool(bound != "latency" and ratio < LOW_RATIO)}


def summary_line(machine_: Machine) -> str:
  """The run header's line on what the expectation columns are read against."""
  if machine_.fabric is None:
    return f"# expected: none ({machine_.source})"
  return (f"# expected: {machine_.fabric.name} ({machine_.source}); LOW = measured busbw under"
          f" {LOW_RATIO:g} x expected at a bandwidth-bound size; assumptions in meta.json's expected")
