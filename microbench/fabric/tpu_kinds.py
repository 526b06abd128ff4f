"""The TPU generations the toolkit knows, one data file each under `tpu_specs/` (facts with their sources).

A kind gives the device names JAX reports for it (`device_kind`, matched exactly), libtpu's topology prefix
(`v5p` in `v5p:4x4x4`), its torus (2 or 3 dimensions, ICI ports per chip, the rate of one port in each
direction, and from which side length a dimension wraps around), its hosts (chips per JAX process and their
block of the torus), DCN per chip, the dense bf16 peak (MFU's denominator), HBM bandwidth and capacity.

Every figure names its source and the loader refuses a file where one does not: `[memory]` has its own `source`
beginning "reported" (a device's own figure, posted somewhere) or "datasheet, unverified"; `peak_cite` covers
`bf16_tflops`; `[[sources]]` lists every other figure under exactly one `cite`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from microbench.fabric import spec_files

SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_specs")
GIB = 1 << 30
MEMORY_PROVENANCE = ("reported", "datasheet, unverified")
_FIELDS = ("name", "title", "device_kinds", "topology_prefix", "devices_per_chip", "torus_dims", "ici_ports",
           "ici_link_gbytes", "wraparound_from", "chips_per_host", "host_shape", "bf16_tflops", "hbm_gbytes_s",
           "peak_cite", "memory")
_CITED = ("torus_dims", "ici_ports", "ici_link_gbytes", "wraparound_from", "chips_per_host", "host_shape",
          "hbm_gbytes_s")


class KindError(ValueError):
  """An unknown TPU kind, or one that can't be a compile target; the message lists the allowed ones."""


@dataclasses.dataclass(frozen=True)
class TpuKind:
  name: str                   # the --target name, e.g. "v5p"
  title: str
  device_kinds: tuple[str, ...]
  topology_prefix: str        # libtpu's name: "v5p" in "v5p:4x4x4"
  devices_per_chip: int       # JAX devices per chip in libtpu's compile-only description
  torus_dims: int             # 3 (v4, v5p) or 2 (v5e, v6e)
  ici_ports: int              # ICI ports per chip
  ici_link_gbytes: float      # GB/s of one port, each direction
  wraparound_from: int        # a torus dimension of at least this many chips wraps around
  chips_per_host: int         # chips per JAX process (one VM)
  host_shape: tuple[int, int, int]
  dcn_gbits_per_chip: float | None  # data-center network per chip, Gbit/s (None: not published)
  bf16_tflops: float
  hbm_gbytes_s: float
  peak_cite: str
  memory_bytes: int
  memory_source: str
  sources: dict[str, str]
  source_file: str

  @property
  def device_kind(self) -> str:
    return self.device_kinds[0]

  @property
  def compile_target(self) -> bool:
    """libtpu describes one device per chip, as JAX on a VM of this kind has (v4's description has two)."""
    return self.devices_per_chip == 1

  @property
  def dcn_gbytes_per_host(self) -> float | None:
    """GB/s of data-center network one host (JAX process) has, each direction."""
    return None if self.dcn_gbits_per_chip is None else self.dcn_gbits_per_chip * self.chips_per_host / 8

  def figures(self) -> tuple[str, ...]:
    return ("memory", "bf16_tflops", *_CITED, *(("dcn_gbits_per_chip",) if self.dcn_gbits_per_chip else ()))

  def source(self, figure: str) -> str:
    return self.sources[figure]

  def wraps(self, side: int) -> bool:
    """Whether a torus dimension of `side` chips closes into a ring (wraparound link) on this kind."""
    return side >= self.wraparound_from


def _memory(path: str, m: dict[str, Any]) -> tuple[int, str]:
  nbytes, source = m.get("bytes"), str(m.get("source", "")).strip()
  gib = m.get("gib")
  if not isinstance(nbytes, int) or (gib is not None and nbytes != int(gib * GIB)):
    raise ValueError(f"{path}: [memory] wants bytes (an integer) and, where given, gib with bytes = gib x {GIB}")
  if not source.startswith(MEMORY_PROVENANCE):
    raise ValueError(f"{path}: [memory] source must begin with one of {MEMORY_PROVENANCE}: {source[:60]!r}")
  return nbytes, source


def _sources(path: str, d: dict[str, Any], memory_source: str) -> dict[str, str]:
  return spec_files.sources(path, d, {"memory": memory_source, "bf16_tflops": d["peak_cite"]},
                            ("memory", "bf16_tflops", *_CITED,
                             *(("dcn_gbits_per_chip",) if d.get("dcn_gbits_per_chip") else ())))


@functools.cache
def kinds() -> dict[str, TpuKind]:
  """Every kind in tpu_specs/, by name."""
  out = {}
  for path, d in spec_files.read(SPECS, _FIELDS):
    memory_bytes, memory_source = _memory(path, d["memory"])
    out[d["name"]] = TpuKind(
        name=d["name"], title=d["title"], device_kinds=tuple(d["device_kinds"]),
        topology_prefix=d["topology_prefix"], devices_per_chip=int(d["devices_per_chip"]),
        torus_dims=int(d["torus_dims"]), ici_ports=int(d["ici_ports"]), ici_link_gbytes=float(d["ici_link_gbytes"]),
        wraparound_from=int(d["wraparound_from"]), chips_per_host=int(d["chips_per_host"]),
        host_shape=tuple(int(v) for v in d["host_shape"]),
        dcn_gbits_per_chip=float(d["dcn_gbits_per_chip"]) if d.get("dcn_gbits_per_chip") else None,
        bf16_tflops=float(d["bf16_tflops"]), hbm_gbytes_s=float(d["hbm_gbytes_s"]), peak_cite=d["peak_cite"],
        memory_bytes=memory_bytes, memory_source=memory_source, sources=_sources(path, d, memory_source),
        source_file=path)
  return out


def targets() -> tuple[str, ...]:
  """The kinds libtpu can compile for here as JAX on their VMs sees them (one device per chip)."""
  return tuple(k for k, v in kinds().items() if v.compile_target)


def is_tpu_name(name: str) -> bool:
  """Whether a --target value names a TPU kind (known or not: `v` and a digit, or `tpu`)."""
  n = name.strip().lower()
  return n in kinds() or (len(n) > 1 and n[0] == "v" and n[1].isdigit()) or n.startswith("tpu")


def target(name: str) -> TpuKind:
  """The TPU compile target called `name` (case-insensitive); KindError lists the targets otherwise."""
  kind = kinds().get(name.strip().lower())
  if kind is None:
    raise KindError(f"unknown TPU --target={name!r}: choose one of {', '.join(targets())}")
  if not kind.compile_target:
    raise KindError(f"--target={kind.name}: libtpu's compile-only {kind.title} gives each chip's"
                    f" {kind.devices_per_chip} TensorCores as devices, where JAX on a {kind.title} VM gives one per"
                    f" chip, so its programs would not be the ones that run; TPU targets: {', '.join(targets())}")
  return kind


@functools.cache
def by_device_kind() -> dict[str, TpuKind]:
  return {dk: k for k in kinds().values() for dk in k.device_kinds}


def lookup(device_kind: str) -> TpuKind | None:
  """The kind whose JAX device_kind is exactly `device_kind` (surrounding spaces ignored)."""
  return by_device_kind().get(device_kind.strip())
