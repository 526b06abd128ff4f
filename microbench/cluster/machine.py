"""Devices, topology and mesh for a run: CPU emulation before JAX starts, then the machine as it is."""

from __future__ import annotations

import os
from typing import Any

from meshes.mesh import build_mesh, ordered_devices
from meshes.topology import Topology, TopologyError, check_matches, parse_topology, topology_from_hosts
from microbench.fabric import gpu_kinds
from microbench.target import compile_only

DEFAULT_CPU_DEVICES = 8


def user_chose_cpu_devices() -> bool:
  return ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
          or bool(os.environ.get("JAX_NUM_CPU_DEVICES")))


def prepare_cpu_devices(topology: Topology | None, distributed: bool) -> bool:
  """Before JAX's backend starts: give the CPU backend enough virtual devices to emulate a machine.

  Respects a device count the user chose (XLA_FLAGS / JAX_NUM_CPU_DEVICES) and leaves distributed runs
  (one launcher-chosen count per process) alone. Only affects the CPU backend, so GPU hosts are unchanged.
  Returns whether the default was applied.
  """
  if distributed or user_chose_cpu_devices():
    return False
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", topology.num_devices if topology else DEFAULT_CPU_DEVICES)
  return True


def device_memory(device) -> int | None:
  """An accelerator's usable memory (XLA's allocator limit, `bytes_limit`); None on CPU, whose devices share
  the host's memory, or where the backend keeps no statistics."""
  if device.platform == "cpu":
    return None
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:  # pylint: disable=broad-except
    return None  # backends without memory statistics
  return int(limit) if limit else None


def resolve(topology: Topology | None, nodes_per_rack: int | None) -> tuple[Topology, Any, str]:
  """The run's topology, its mesh and a note on where the topology came from."""
  import jax  # pylint: disable=g-import-not-at-top
  from microbench.cluster.distributed import process_hosts  # pylint: disable=g-import-not-at-top

  devices = ordered_devices()
  hosts = process_hosts()
  device_hosts = [hosts[d.process_index] for d in devices]
  _, perm = topology_from_hosts(device_hosts)
  devices = [devices[i] for i in perm]
  if topology is not None:
    check_matches(topology, len(devices))
    note = f"topology {topology} from --topology"
  elif (jax.process_count() == 1 and devices[0].platform == "cpu" and len(devices) % 2 == 0
        and len(devices) > 1):
    per_rack = nodes_per_rack or 2
    if 2 % per_rack:
      raise TopologyError(f"--nodes_per_rack={per_rack} must divide the 2 emulated nodes (or set --topology)")
    topology = Topology(racks=2 // per_rack, nodes=per_rack, gpus=len(devices) // 2)
    note = (f"no accelerator: {len(devices)} CPU devices in one process, emulated as {topology}"
            " (set --topology to change)")
  else:
    topology, _ = topology_from_hosts(device_hosts, nodes_per_rack)
    note = f"topology {topology} from {len(hosts)} process(es) on {topology.total_nodes} host(s)"
  return topology, build_mesh(topology, devices), note


def resolve_target(kind: str, topology: Topology | None, nodes_per_rack: int | None):
  """(topology, target, mesh, note) for compile-only devices of GPU kind `kind`: the topology as given, or one
  node of the kind's usual size (an NVL72 kind: one rack of 18 trays x 4). Raises TopologyError, TargetError
  or KindError with a one-line message."""
  spec = gpu_kinds.target(kind)
  if topology is None:
    per_rack = nodes_per_rack or spec.nodes_per_rack
    topology = Topology(racks=1, nodes=per_rack, gpus=spec.gpus_per_node)
    note = f"topology {topology} (one {'rack' if per_rack > 1 else 'node'} of {spec.title}; set --topology to change)"
  else:
    note = f"topology {topology} from --topology"
  if nodes_per_rack and topology.racks * topology.nodes % nodes_per_rack:
    raise TopologyError(f"--nodes_per_rack={nodes_per_rack} must divide the {topology.total_nodes} nodes")
  if nodes_per_rack:
    topology = Topology(racks=topology.total_nodes // nodes_per_rack, nodes=nodes_per_rack, gpus=topology.gpus)
  check_kind_shape(spec, topology)
  target = compile_only.make_target(kind, topology.total_nodes, topology.gpus)
  return topology, target, build_mesh(topology, list(target.devices)), note


def check_kind_shape(kind: gpu_kinds.GpuKind, topology: Topology) -> None:
  """A topology the kind cannot have is refused (TopologyError): more GPUs in a node than its node (or tray)
  holds, or, for a kind whose NVLink domain is a rack (NVL72), more trays in a rack than the domain has. Fewer
  is allowed: a job may use part of a node."""
  unit = "tray" if kind.rack_nvlink else "node"
  if topology.gpus > kind.gpus_per_node:
    raise TopologyError(f"--topology {topology}: a {kind.title} {unit} has {kind.gpus_per_node} GPUs, not"
                        f" {topology.gpus}; use gpus:{kind.gpus_per_node} or fewer (more {unit}s for more GPUs)")
  if kind.rack_nvlink and topology.nodes > kind.nodes_per_rack:
    raise TopologyError(f"--topology {topology}: a {kind.title} NVLink domain (rack) has {kind.nodes_per_rack}"
                        f" trays, not {topology.nodes}; use nodes:{kind.nodes_per_rack} or fewer per rack"
                        " (more racks for more trays)")


def describe(mesh, hosts: list[str]) -> dict[str, Any]:
  """Everything meta.json says about the machine."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top

  devs = list(mesh.devices.flat)
  procs: dict[int, dict[str, Any]] = {}
  for pos, d in enumerate(devs):
    p = procs.setdefault(d.process_index, {"process": d.process_index, "host": hosts[d.process_index],
                                           "devices": []})
    p["devices"].append({"id": d.id, "kind": d.device_kind, "mesh_position": pos})
  return {
      "jax_version": jax.__version__,
      "jaxlib_version": jaxlib.__version__,
      "platform": devs[0].platform,
      "device_kind": devs[0].device_kind,
      "process_count": jax.process_count(),
      "device_count": len(devs),
      "mesh": {"axes": list(mesh.axis_names), "shape": list(mesh.devices.shape),
               "device_ids": [[[d.id for d in row] for row in plane] for plane in mesh.devices]},
      "processes": [procs[k] for k in sorted(procs)],
  }


__all__ = ["prepare_cpu_devices", "resolve", "describe", "parse_topology", "TopologyError"]
