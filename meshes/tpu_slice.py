"""A TPU pod's machine: slices of a 2D or 3D torus, hosts as blocks of it, and the mesh that names them.

Each torus dimension is split into which host block a chip is in and where in the block it sits (`x_host`,
`x_chip`): the row-major order over the pair is the chip's coordinate, so a collective over both runs along
that dimension's ring in coordinate order, one over the `*_chip` axes runs among one host's chips, and one over
`slice` joins the same chip of every slice over the data-center network (DCN). Built from what every TPU device
says of itself (`coords`, `slice_index`, `process_index`), on a real TPU VM and on libtpu's compile-only devices
alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

AXES = ("slice", "z_host", "z_chip", "y_host", "y_chip", "x_host", "x_chip")
_SPATIAL = AXES[1:]
SCOPE_AXES: dict[str, tuple[str, ...]] = {
    "host": ("z_chip", "y_chip", "x_chip"),   # one host's chips (ICI inside a host's block)
    "ici_x": ("x_host", "x_chip"),            # each torus dimension as its own ring, in coordinate order
    "ici_y": ("y_host", "y_chip"),
    "ici_z": ("z_host", "z_chip"),
    "slice": _SPATIAL,                        # a whole slice over ICI (XLA:TPU's multi-dimensional algorithm)
    "dcn": ("slice",),                        # the same chip of every slice, over the data-center network
    "global": AXES,
}
SCOPES = tuple(SCOPE_AXES)


class SliceError(ValueError):
  """Devices that don't form slices of a torus in host blocks; the message says what is wrong."""


@dataclasses.dataclass(frozen=True)
class TpuSlices:
  """`slices` slices of a torus of `dims` chips (x, y, z), hosts holding `host` blocks of chips."""
  slices: int
  dims: tuple[int, int, int]
  host: tuple[int, int, int]

  axis_names = AXES
  scope_axes = SCOPE_AXES

  @property
  def shape(self) -> tuple[int, ...]:
    (x, y, z), (hx, hy, hz) = self.dims, self.host
    return (self.slices, z // hz, hz, y // hy, hy, x // hx, hx)

  @property
  def num_devices(self) -> int:
    return self.slices * self.dims[0] * self.dims[1] * self.dims[2]

  @property
  def total_nodes(self) -> int:
    """Hosts (JAX processes) in all slices."""
    return self.num_devices // (self.host[0] * self.host[1] * self.host[2])

  @property
  def slice_devices(self) -> int | None:
    """Chips per slice when there are several slices (XLA:TPU compiles one slice's program), else None."""
    return self.dims[0] * self.dims[1] * self.dims[2] if self.slices > 1 else None

  @property
  def torus_dims(self) -> int:
    return 3 if self.dims[2] > 1 else 2

  def __str__(self) -> str:
    shown = "x".join(map(str, self.dims if self.dims[2] > 1 else self.dims[:2]))
    return f"{shown} chips, hosts of {'x'.join(map(str, self.host))}" + (
        f", {self.slices} slices" if self.slices > 1 else "")

  def as_dict(self) -> dict[str, Any]:
    return {"slices": self.slices, "dims": list(self.dims), "host": list(self.host)}


def _coords(d) -> tuple[int, int, int]:
  c = list(getattr(d, "coords", None) or ())
  if not c:
    raise SliceError(f"device {d} has no torus coordinates (coords): not a TPU")
  return tuple((c + [0, 0, 0])[:3])


def slices_from_devices(devices: Sequence[Any]) -> tuple[TpuSlices, list[Any]]:
  """The slices the devices form and the devices in mesh order (slice, z, y, x); raises SliceError where
  they don't form whole slices of one torus shape with hosts as equal blocks (or two TensorCores share a chip)."""
  where = {}
  for d in devices:
    key = (int(getattr(d, "slice_index", 0) or 0), *_coords(d))
    if key in where:
      raise SliceError(f"devices {where[key]} and {d} sit on the same chip (slice {key[0]}, coords {key[1:]}):"
                       " one JAX device per chip is expected (a TensorCore per device is not supported)")
    where[key] = d
  slices = sorted({k[0] for k in where})
  dims = tuple(max(k[i] for k in where) + 1 for i in (1, 2, 3))
  if slices != list(range(len(slices))) or len(where) != len(slices) * dims[0] * dims[1] * dims[2]:
    raise SliceError(f"{len(where)} devices do not fill {len(slices)} slice(s) of {'x'.join(map(str, dims))} chips")
  blocks: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
  for (s, x, y, z), d in where.items():
    blocks.setdefault((s, d.process_index), []).append((x, y, z))
  spans = set()
  for cs in blocks.values():
    lo = [min(c[i] for c in cs) for i in range(3)]
    span = tuple(max(c[i] for c in cs) - lo[i] + 1 for i in range(3))
    if span[0] * span[1] * span[2] != len(cs) or any(lo[i] % span[i] for i in range(3)):
      raise SliceError(f"a host's chips {sorted(cs)} are not an aligned block of the torus")
    spans.add(span)
  if len(spans) != 1 or any(dims[i] % next(iter(spans))[i] for i in range(3)):
    raise SliceError(f"hosts hold different blocks of chips {sorted(spans)}: they must tile the slice")
  ordered = [where[k] for k in sorted(where, key=lambda k: (k[0], k[3], k[2], k[1]))]
  return TpuSlices(len(slices), dims, next(iter(spans))), ordered


def build_mesh(topology: TpuSlices, devices: Sequence[Any]):
  """The mesh over devices in (slice, z, y, x) order, with Explicit axes named by `AXES`."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  grid = np.array(list(devices), dtype=object).reshape(topology.shape)
  return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Explicit,) * len(AXES))
