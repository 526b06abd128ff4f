"""Topologies, device ordering and the groups each scope makes."""

import numpy as np
import pytest

from microbench.meshes.scopes import SCOPES, plan_scopes, scope_groups
from microbench.meshes.topology import Topology, TopologyError, parse_topology, topology_from_hosts


def test_parse_topology():
  assert parse_topology("racks:2,nodes:3,gpus:4") == Topology(2, 3, 4)
  assert parse_topology("nodes:2,gpus:4") == Topology(1, 2, 4)
  assert parse_topology("gpus:8").num_devices == 8
  for bad in ["", "nodes:0", "cpus:4", "nodes:2,nodes:3", "nodes=x", "nodes:2", "racks:2,nodes:4"]:
    with pytest.raises(TopologyError):
      parse_topology(bad)


def test_topology_from_hosts_groups_each_hosts_devices_together():
  # Two processes per host, one device each, processes interleaved across hosts.
  topo, perm = topology_from_hosts(["a", "b", "a", "b"])
  assert topo == Topology(1, 2, 2)
  assert perm == [0, 2, 1, 3]
  topo, _ = topology_from_hosts(["a", "a", "b", "b", "c", "c", "d", "d"], nodes_per_rack=2)
  assert topo == Topology(2, 2, 2)
  with pytest.raises(TopologyError, match="divide"):
    topology_from_hosts(["a", "b", "c"], nodes_per_rack=2)
  with pytest.raises(TopologyError, match="same count"):
    topology_from_hosts(["a", "a", "b"])


def test_scope_groups_racks_nodes_gpus():
  plans = {p.name: p for p in plan_scopes(Topology(2, 2, 2), SCOPES)}
  assert plans["scale_up"].groups.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert plans["scale_out"].groups.tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert plans["rack_scale"].groups.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert plans["global"].groups.tolist() == [list(range(8))]
  assert not any(p.skip_reason for p in plans.values())
  # Every scope partitions all devices.
  for p in plans.values():
    assert sorted(p.groups.ravel().tolist()) == list(range(8))


def test_degenerate_and_duplicate_scopes_are_skipped_with_reason():
  plans = {p.name: p for p in plan_scopes(Topology(1, 2, 4), SCOPES)}
  assert plans["rack_scale"].skip_reason and "global" in plans["rack_scale"].skip_reason
  assert plans["global"].skip_reason is None
  plans = {p.name: p for p in plan_scopes(Topology(1, 1, 8), SCOPES)}
  assert "one device" in plans["scale_out"].skip_reason
  assert plans["scale_up"].skip_reason is None
  # A single requested scope is kept even when another scope would have the same groups.
  (only,) = plan_scopes(Topology(1, 2, 4), ["rack_scale"])
  assert only.skip_reason is None


def test_group_rank_order_matches_axis_index_linearisation():
  g = scope_groups((1, 2, 4), ("node", "gpu"))
  assert g.tolist() == [list(range(8))]
  g = scope_groups((2, 2, 2), ("rack", "node"))
  np.testing.assert_array_equal(g, [[0, 2, 4, 6], [1, 3, 5, 7]])


def test_single_cpu_process_emulates_two_nodes_and_honours_nodes_per_rack():
  from microbench.cluster import machine

  topo, mesh, note = machine.resolve(None, None)
  assert topo == Topology(1, 2, 4) and "emulated" in note
  assert mesh.axis_names == ("rack", "node", "gpu") and mesh.devices.shape == (1, 2, 4)
  topo, mesh, _ = machine.resolve(None, 1)
  assert topo == Topology(2, 1, 4) and mesh.devices.shape == (2, 1, 4)
  topo, _, note = machine.resolve(Topology(2, 2, 2), None)
  assert topo == Topology(2, 2, 2) and "--topology" in note
  with pytest.raises(TopologyError, match="12 devices but 8"):
    machine.resolve(Topology(1, 3, 4), None)
