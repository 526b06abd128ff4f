"""Scopes: partitions of all devices into groups that run the same collective at the same time.

Each scope is a set of mesh axes; the devices that differ only along those axes form one group, so every
group of a scope runs concurrently, as jobs on a real machine would load its fabric levels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from microbench.meshes.topology import AXES, Topology

SCOPE_AXES: dict[str, tuple[str, ...]] = {
    "scale_up": ("gpu",),            # the devices of one node (NVLink inside a node)
    "scale_out": ("rack", "node"),   # same local index across all nodes (one NIC rail)
    "rack_scale": ("node", "gpu"),   # all devices of one rack (an NVLink domain spanning nodes)
    "global": ("rack", "node", "gpu"),
}
SCOPES = tuple(SCOPE_AXES)


@dataclasses.dataclass(frozen=True)
class ScopePlan:
  name: str
  axes: tuple[str, ...]
  groups: np.ndarray  # [num_groups, group_size] of flat mesh positions, in group-rank order
  skip_reason: str | None = None
  slice_devices: int | None = None  # several TPU slices: devices per slice (positions slice-major), else None

  @property
  def group_size(self) -> int:
    return int(self.groups.shape[1])

  @property
  def num_groups(self) -> int:
    return int(self.groups.shape[0])


def scope_groups(shape: Sequence[int], axes: Sequence[str], names: Sequence[str] = AXES) -> np.ndarray:
  """Groups of flat device positions for a collective over `axes` of a mesh of `shape`.

  Within a group, rank order is the row-major order over `axes` as given, which is how
  `jax.lax.axis_index` linearises a tuple of axis names.
  """
  ids = np.arange(int(np.prod(shape))).reshape(tuple(shape))
  axis_pos = [list(names).index(a) for a in axes]
  rest = [i for i in range(len(names)) if i not in axis_pos]
  moved = np.transpose(ids, rest + axis_pos)
  size = int(np.prod([shape[i] for i in axis_pos])) if axis_pos else 1
  return moved.reshape(-1, size)


def _canonical(groups: np.ndarray) -> frozenset:
  return frozenset(frozenset(int(x) for x in g) for g in groups)


# When two requested scopes have the same groups, the one earlier here is kept (with one rack, global
# is the clearer name for what rack_scale would measure).
# On a TPU pod (microbench.meshes.tpu_slice), the ICI and DCN names say more than global.
_KEEP_ORDER = ("scale_up", "scale_out", "host", "ici_x", "ici_y", "ici_z", "slice", "dcn", "global", "rack_scale")


def plan_scopes(topology: Topology, names: Sequence[str]) -> list[ScopePlan]:
  """The scopes to run, in the order given, each with its groups; degenerate or duplicate scopes carry a
  skip reason. A machine with its own axes and scopes (a TPU pod, `microbench.meshes.tpu_slice`) brings them along."""
  scope_axes = getattr(topology, "scope_axes", SCOPE_AXES)
  axis_names = getattr(topology, "axis_names", AXES)
  groups = {name: scope_groups(topology.shape, scope_axes[name], axis_names) for name in names}
  keys = {name: _canonical(g) for name, g in groups.items()}
  plans: list[ScopePlan] = []
  for name in names:
    g = groups[name]
    reason = None
    twins = [o for o in names if o != name and keys[o] == keys[name] and groups[o].shape[1] > 1]
    keeper = min([name, *twins], key=lambda s: _KEEP_ORDER.index(s) if s in _KEEP_ORDER else len(_KEEP_ORDER))
    if g.shape[1] < 2:
      reason = f"groups of one device with topology {topology}"
    elif keeper != name:
      reason = f"same groups as scope {keeper} with topology {topology}"
    plans.append(ScopePlan(name, scope_axes[name], g, reason, getattr(topology, "slice_devices", None)))
  return plans
