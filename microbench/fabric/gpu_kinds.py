"""The GPU kinds the toolkit knows, one data file each under `gpu_specs/` (facts with their sources).

A kind gives the device names CUDA reports for it (JAX's `device_kind`, matched exactly), its NVLink
generation (the scale-up link peak; `rack_nvlink` where the NVLink domain spans a rack's nodes), its dense
bf16 and tf32 peaks (MFU's denominator), the node and rack shape it usually comes in, its device memory,
and, for kinds that can be compile targets, an `[xla]` table: the `stream_executor.GpuTargetConfigProto`
fields XLA:GPU's compiler reads (compute capability, SMs, clocks, memory bandwidth, caches, cuDNN version).

Every figure names its source, and the loader refuses a file where one does not:
- `[memory]`: what the device reports, `mib` (nvidia-smi's `memory.total`, MiB) and `bytes` = mib x 1048576,
  with `source` saying where the report was posted ("reported: ..."); a kind with no report found keeps the
  datasheet's decimal figure and its source says "datasheet, unverified". The CUDA-visible total
  (cudaMemGetInfo / cuDeviceTotalMem, what JAX's allocator takes its fraction of) is lower by the driver's
  reservation (0.4-0.9%, varies with the driver); sources quote it where a report was found.
- `peak_cite`: the bf16 and tf32 peaks' source.
- `[[sources]]`: `figures = [...]` (the other top-level figures and every `[xla]` field) and `cite`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from microbench.fabric import spec_files

SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")
MIB = 1 << 20
MEMORY_PROVENANCE = ("reported", "datasheet, unverified")  # how a [memory] source must begin


@dataclasses.dataclass(frozen=True)
class GpuKind:
  name: str                 # the --target name, e.g. "h100"
  title: str
  device_kinds: tuple[str, ...]
  nvlink: str | None        # link name in microbench.fabric.link_peaks.LINKS (scale_up)
  rack_nvlink: str | None   # an NVLink domain spanning the rack's nodes (NVL72), else None
  gpus_per_node: int
  nodes_per_rack: int
  bf16_tflops: float
  tf32_tflops: float
  peak_cite: str
  memory_bytes: int         # what the device reports (nvidia-smi memory.total), MiB x 1048576
  memory_source: str        # "reported: ..." or "datasheet, unverified: ..."
  xla: dict[str, Any] | None  # the compiler's device description; None: not a compile target
  sources: dict[str, str]   # figure -> where it comes from (every figure of the kind has one)
  source_file: str

  @property
  def memory_mib(self) -> int:
    return self.memory_bytes // MIB

  @property
  def device_kind(self) -> str:
    """The name a compile-only device of this kind reports (the first CUDA name)."""
    return self.device_kinds[0]

  def figures(self) -> tuple[str, ...]:
    """The names of every figure this kind states (each has a source: `source(name)`)."""
    return _figures(self.nvlink, self.rack_nvlink, self.xla)

  def source(self, figure: str) -> str:
    """Where `figure` (a name from `figures()`) comes from."""
    return self.sources[figure]

  def target_config(self) -> str:
    """The GpuTargetConfigProto text XLA:GPU compiles against (raises KindError for a kind without one)."""
    if not self.xla:
      raise KindError(f"GPU kind {self.name!r} has no compiler description (it is known for its peaks only);"
                      f" compile targets: {', '.join(targets())}")
    x = self.xla
    major, minor = x["compute_capability"]
    dnn = x["cudnn"]
    info = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32,
        "shared_memory_per_block": x["shared_memory_per_block"],
        "shared_memory_per_block_optin": x["shared_memory_per_block_optin"],
        "shared_memory_per_core": x["shared_memory_per_sm"], "threads_per_core_limit": x["threads_per_sm"],
        "core_count": x["sm_count"], "fpus_per_core": x["fp32_cores_per_sm"],
        "block_dim_limit_x": 2147483647, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
        "memory_bandwidth": x["memory_bandwidth"], "l2_cache_size": x["l2_cache_bytes"],
        "clock_rate_ghz": x["clock_ghz"], "device_memory_size": self.memory_bytes,
        "registers_per_core_limit": x["registers_per_sm"], "registers_per_block_limit": x["registers_per_block"],
    }
    body = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return (f"gpu_device_info {{\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n{body}\n}}\n"
            f'platform_name: "CUDA"\n'
            f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}\n"
            f'device_description_str: "{self.device_kind}"\n')


class KindError(ValueError):
  """An unknown kind, or one that can't be a compile target; the message lists the allowed ones."""


_FIELDS = ("name", "title", "device_kinds", "gpus_per_node", "nodes_per_rack", "bf16_tflops", "tf32_tflops",
           "peak_cite", "memory")
XLA_FIELDS = ("compute_capability", "sm_count", "fp32_cores_per_sm", "clock_ghz", "memory_bandwidth",
              "l2_cache_bytes", "shared_memory_per_block", "shared_memory_per_block_optin", "shared_memory_per_sm",
              "threads_per_sm", "registers_per_sm", "registers_per_block", "cudnn")


def _figures(nvlink: str | None, rack_nvlink: str | None, xla: dict[str, Any] | None) -> tuple[str, ...]:
  links = (("nvlink",) if nvlink else ()) + (("rack_nvlink",) if rack_nvlink else ())
  return ("memory", "bf16_tflops", "tf32_tflops", *links, "gpus_per_node", "nodes_per_rack",
          *(XLA_FIELDS if xla else ()))


def _memory(path: str, m: dict[str, Any]) -> tuple[int, str]:
  """[memory] -> (bytes, source), checking the unit conversion and that the source says how it is known."""
  mib, nbytes, source = m.get("mib"), m.get("bytes"), str(m.get("source", "")).strip()
  if not isinstance(mib, int) or nbytes != mib * MIB:
    raise ValueError(f"{path}: [memory] wants mib (an integer, nvidia-smi's memory.total) and bytes = mib x"
                     f" {MIB}; got mib={mib!r}, bytes={nbytes!r}")
  if not source.startswith(MEMORY_PROVENANCE):
    raise ValueError(f"{path}: [memory] source must begin with one of {MEMORY_PROVENANCE}: {source[:60]!r}")
  return nbytes, source


def _sources(path: str, d: dict[str, Any], memory_source: str) -> dict[str, str]:
  """figure -> source: [memory]'s, peak_cite for the peaks, and [[sources]] for every other figure."""
  return spec_files.sources(path, d, {"memory": memory_source, "bf16_tflops": d["peak_cite"],
                                      "tf32_tflops": d["peak_cite"]},
                            _figures(d.get("nvlink"), d.get("rack_nvlink"), d.get("xla")))


@functools.cache
def kinds() -> dict[str, GpuKind]:
  """Every kind in gpu_specs/, by name."""
  out = {}
  for path, d in spec_files.read(SPECS, _FIELDS):
    xla = d.get("xla")
    if xla and set(xla) != set(XLA_FIELDS):
      raise ValueError(f"{path}: [xla] wants exactly {', '.join(XLA_FIELDS)}")
    memory_bytes, memory_source = _memory(path, d["memory"])
    out[d["name"]] = GpuKind(
        name=d["name"], title=d["title"], device_kinds=tuple(d["device_kinds"]), nvlink=d.get("nvlink"),
        rack_nvlink=d.get("rack_nvlink"), gpus_per_node=int(d["gpus_per_node"]),
        nodes_per_rack=int(d["nodes_per_rack"]), bf16_tflops=float(d["bf16_tflops"]),
        tf32_tflops=float(d["tf32_tflops"]), peak_cite=d["peak_cite"], memory_bytes=memory_bytes,
        memory_source=memory_source, xla=xla, sources=_sources(path, d, memory_source), source_file=path)
  return out


def targets() -> tuple[str, ...]:
  """The kinds XLA:GPU can compile for (those with an [xla] description)."""
  return tuple(k for k, v in kinds().items() if v.xla)


def target(name: str) -> GpuKind:
  """The compile target called `name` (case-insensitive); KindError lists the targets otherwise."""
  kind = kinds().get(name.strip().lower())
  if kind is None or not kind.xla:
    raise KindError(f"unknown --target={name!r}: choose one of {', '.join(targets())}")
  return kind


@functools.cache
def by_device_kind() -> dict[str, GpuKind]:
  """CUDA device name (exact) -> kind."""
  return {dk: k for k in kinds().values() for dk in k.device_kinds}


def lookup(device_kind: str) -> GpuKind | None:
  """The kind whose CUDA device name is exactly `device_kind` (surrounding spaces ignored)."""
  return by_device_kind().get(device_kind.strip())
