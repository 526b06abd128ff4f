"""Devices, topology and mesh for a run: CPU emulation before JAX starts, then the machine as it is."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from microbench.meshes import tpu_slice
from microbench.meshes.mesh import build_mesh, ordered_devices
from microbench.meshes.topology import Topology, TopologyError, check_matches, parse_topology, topology_from_hosts
from microbench.fabric import gpu_kinds, tpu_kinds
from microbench.aot import gpu_compile, tpu_compile

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
  """The run's topology, its mesh and a note on where the topology came from. On TPUs the machine is what the
  chips say of themselves (torus coordinates, slice, host): `microbench.meshes.tpu_slice`."""
  import jax  # pylint: disable=g-import-not-at-top
  from microbench.cluster.distributed import process_hosts  # pylint: disable=g-import-not-at-top

  devices = ordered_devices()
  if devices[0].platform == "tpu":
    if topology is not None:
      raise TopologyError("--topology describes GPU nodes; on TPUs the slice is read from the chips themselves")
    try:
      slices, ordered = tpu_slice.slices_from_devices(devices)
    except tpu_slice.SliceError as e:
      raise TopologyError(str(e)) from None
    return slices, tpu_slice.build_mesh(slices, ordered), f"TPU slice {slices} from the devices' coordinates"
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


def is_tpu_target(kind: str | None) -> bool:
  """Whether --target names a TPU generation (compiled by XLA:TPU) rather than a GPU kind."""
  return bool(kind) and tpu_kinds.is_tpu_name(kind)


def parse_target_topology(kind: str | None, text: str | None):
  """--topology as the target understands it: a TPU slice (`4x4x4,slices:2`) for a TPU kind, GPU nodes
  (`racks:R,nodes:N,gpus:G`) otherwise; None when not given. Raises TopologyError, KindError or TargetError."""
  if not text:
    return None
  if is_tpu_target(kind):
    try:
      return tpu_compile.parse_slice(text, tpu_kinds.target(kind))
    except tpu_compile.TargetError as e:
      raise TopologyError(str(e)) from None
  return parse_topology(text)


def resolve_tpu_target(kind: str, shape: tpu_compile.SliceShape | None, nodes_per_rack: int | None):
  """(slices, target, mesh, note) for libtpu's compile-only chips of TPU kind `kind` in `shape` (default: one
  host's chips). Raises TopologyError, TargetError or KindError with a one-line message."""
  spec = tpu_kinds.target(kind)
  if nodes_per_rack:
    raise TopologyError(f"--nodes_per_rack groups GPU nodes into racks; a {spec.title} slice has no racks")
  note = (f"TPU slice {shape} from --topology" if shape else
          f"one host's {spec.title} chips ({'x'.join(map(str, spec.host_shape[:spec.torus_dims]))}; set --topology,"
          f" e.g. {'4x4x4' if spec.torus_dims == 3 else '4x4'},slices:2, to change)")
  target = tpu_compile.make_target(kind, shape)
  try:
    slices, ordered = tpu_slice.slices_from_devices(target.devices)
  except tpu_slice.SliceError as e:
    raise TopologyError(str(e)) from None
  return slices, target, tpu_slice.build_mesh(slices, ordered), note


def resolve_target(kind: str, topology, nodes_per_rack: int | None):
  """(topology, target, mesh, note) for compile-only devices of GPU kind `kind`: the topology as given, or one
  node of the kind's usual size (an NVL72 kind: one rack of 18 trays x 4); a TPU kind goes to
  `resolve_tpu_target`. Raises TopologyError, TargetError or KindError with a one-line message."""
  if is_tpu_target(kind):
    return resolve_tpu_target(kind, topology, nodes_per_rack)
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
  target = gpu_compile.make_target(kind, topology.total_nodes, topology.gpus)
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
               "device_ids": np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices).tolist()},
      "processes": [procs[k] for k in sorted(procs)],
  }


__all__ = ["prepare_cpu_devices", "resolve", "describe", "parse_topology", "TopologyError"]
