"""Device meshes with the fabric levels as named axes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from microbench.meshes.topology import AXES, Topology, check_matches


def ordered_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
  """All devices ordered by (process, id): device ids are not contiguous across processes."""
  devices = list(jax.devices() if devices is None else devices)
  return sorted(devices, key=lambda d: (d.process_index, d.id))


def build_mesh(topology: Topology, devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
  """A `rack x node x gpu` mesh with Explicit axes over `devices`, taken in the given order.

  `jax.make_mesh` may reorder devices by its own idea of the physical layout; the order here already
  encodes the machine (a node's devices contiguous), so the Mesh is built from it directly.
  """
  check_matches(topology, len(devices))
  grid = np.array(list(devices), dtype=object).reshape(topology.shape)
  return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Explicit,) * len(AXES))
