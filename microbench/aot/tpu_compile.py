"""XLA:TPU compile-only devices: a TPU slice (or several) on a machine without a TPU.

libtpu (the `tpu-compile` extra, `jax[tpu]`) describes any slice of a TPU generation without the hardware:
`jax.experimental.topologies.get_topology_desc(topology_name="v5p:4x4x4", platform="tpu", num_slices=S)` gives
its chips as compile-only devices with their torus coordinates (`coords`), host (`process_index`) and, for
several slices, `slice_index`. Programs compile for them with XLA:TPU itself and can be read but never run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Any

from microbench.fabric.tpu_kinds import KindError, TpuKind, target
from microbench.aot import quiet_start

INSTALL_HINT = "pip install -e '.[tpu-compile]'"
# libtpu, started on a machine that is not a TPU VM, says so on stderr; harmless for compiling.
CHATTER = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "host bounds", "Logging before InitGoogle",
           "Source Location Trace", "libtpu_init_utils", "common_lib.cc", "=== Source Location")


class TargetError(RuntimeError):
  """The TPU compile-only target can't be set up; the message says what to do."""


def libtpu_available() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def require_libtpu() -> None:
  if not libtpu_available():
    raise TargetError(f"a TPU --target compiles with XLA:TPU, which needs libtpu: {INSTALL_HINT}"
                      " (jax[tpu], about 700 MB; no TPU needed)")


@dataclasses.dataclass(frozen=True)
class SliceShape:
  """A slice's chips along the torus dimensions (x, y, z; z = 1 on 2D kinds) and how many slices (DCN)."""
  dims: tuple[int, int, int]
  slices: int = 1

  @property
  def chips(self) -> int:
    return self.dims[0] * self.dims[1] * self.dims[2]

  @property
  def num_devices(self) -> int:
    return self.chips * self.slices

  def name(self, kind: TpuKind) -> str:
    """libtpu's topology name, `v5p:4x4x4` (2D kinds: `v5e:4x4`)."""
    shown = self.dims[:kind.torus_dims]
    return f"{kind.topology_prefix}:{'x'.join(map(str, shown))}"

  def __str__(self) -> str:
    text = "x".join(map(str, self.dims))
    return text + (f",slices:{self.slices}" if self.slices > 1 else "")


_SHAPE = re.compile(r"^\s*(\d+(?:\s*x\s*\d+){1,2})\s*(?:,\s*slices\s*[:=]\s*(\d+)\s*)?$")


def parse_slice(text: str, kind: TpuKind) -> SliceShape:
  """`4x4x4` or `4x4x4,slices:2` (2D kinds: `16x16`); TargetError in one line otherwise."""
  m = _SHAPE.match(text or "")
  example = "4x4x4" if kind.torus_dims == 3 else "4x4"
  if not m:
    raise TargetError(f"--topology={text!r} is not a {kind.title} slice: give its chips per torus dimension and,"
                      f" for several slices, their count (e.g. {example} or {example},slices:2)")
  dims = [int(v) for v in re.split(r"\s*x\s*", m.group(1))]
  if len(dims) != kind.torus_dims:
    raise TargetError(f"--topology={text!r}: a {kind.title} slice has {kind.torus_dims} torus dimensions"
                      f" (e.g. {example}), not {len(dims)}")
  slices = int(m.group(2) or 1)
  if min(dims) < 1 or slices < 1:
    raise TargetError(f"--topology={text!r}: every dimension and the slice count must be at least 1")
  while len(dims) < 3:
    dims.append(1)
  return SliceShape(tuple(dims), slices)


def slice_for(kind: TpuKind, chips: int) -> SliceShape:
  """The most cube-like slice of `chips` chips the kind's hosts tile (sides along x and y multiples of the host
  block): the shape a job of that many chips is usually given (64 v5p chips: 4x4x4; 256 v6e: 16x16)."""
  hx, hy, _ = kind.host_shape
  best = None
  for x in range(hx, chips + 1, hx):
    for y in range(hy, chips // x + 1, hy):
      z, rest = divmod(chips, x * y)
      if rest or (kind.torus_dims == 2 and z != 1):
        continue
      sides = sorted((x, y, z)[:kind.torus_dims])
      score = (sides[-1] / sides[0], (x, y, z))
      if best is None or score < best[0]:
        best = (score, (x, y, z))
  if best is None:
    raise TargetError(f"{chips} chips are not a slice of {kind.title} hosts of"
                      f" {'x'.join(map(str, kind.host_shape[:kind.torus_dims]))}: give a multiple of"
                      f" {kind.chips_per_host}")
  return SliceShape(best[1], 1)


def default_slice(kind: TpuKind) -> SliceShape:
  """One host's chips: the smallest slice of the kind (2x2x1 on v5p, 2x2 on v5e and v6e)."""
  return SliceShape(tuple(kind.host_shape), 1)


@dataclasses.dataclass(frozen=True)
class TpuTarget:
  kind: TpuKind
  shape: SliceShape
  devices: tuple[Any, ...]  # compile-only devices as libtpu lists them

  @property
  def memory_bytes(self) -> int:
    return int(self.kind.memory_bytes)

  @property
  def hosts(self) -> int:
    return len({(slice_of(d), d.process_index) for d in self.devices})

  @property
  def chips_per_host(self) -> int:
    return len(self.devices) // max(1, self.hosts)

  @property
  def gpus_per_host(self) -> int:  # the GPU targets' name for it (records and summaries share it)
    return self.chips_per_host

  def describe(self) -> dict[str, Any]:
    return {"kind": self.kind.name, "title": self.kind.title, "device_kind": self.kind.device_kind,
            "platform": "tpu", "slice": "x".join(map(str, self.shape.dims[:self.kind.torus_dims])),
            "slices": self.shape.slices, "hosts": self.hosts, "chips_per_host": self.chips_per_host,
            "devices": len(self.devices), "memory_bytes": self.memory_bytes,
            "spec_file": os.path.basename(self.kind.source_file)}


def slice_of(device) -> int:
  """The slice a device belongs to (0 without multislice)."""
  return int(getattr(device, "slice_index", 0) or 0)


def make_target(name: str, shape: SliceShape | None) -> TpuTarget:
  """Compile-only devices of TPU kind `name` in `shape` (default: one host's chips); raises KindError for an
  unknown kind, TargetError without libtpu or for a shape libtpu refuses."""
  kind = target(name)
  require_libtpu()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # libtpu takes a machine-wide lock file for the TPU chips; compile-only use touches no chip, so several
  # processes (a sweep beside a training compile) may load it at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  shape = shape or default_slice(kind)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  kwargs = {"num_slices": shape.slices} if shape.slices > 1 else {}
  with quiet_start.filtered_stderr(CHATTER):
    try:
      topo = topologies.get_topology_desc(topology_name=shape.name(kind), platform="tpu", **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      raise TargetError(f"XLA:TPU could not describe {shape} of {kind.title}: "
                        f"{str(e).strip().splitlines()[0][:300]}") from None
  return TpuTarget(kind, shape, tuple(topo.devices))


__all__ = ["TpuTarget", "SliceShape", "TargetError", "KindError", "make_target", "parse_slice", "default_slice", "slice_for",
           "libtpu_available", "INSTALL_HINT", "slice_of"]
