"""XLA:GPU compile-only devices: a GPU cluster's shape on a machine without a GPU.

JAX's deviceless ahead-of-time path (`jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`)
returns devices of a described GPU kind, laid out as hosts of G GPUs, that programs can be lowered and
compiled for but never run. It needs JAX's CUDA PJRT plugin (the `gpu-compile` extra); no driver, no GPU.
Compiled programs give XLA:GPU's own optimised HLO (`as_text()`) and its memory analysis per device.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any

from microbench.aot import quiet_start
from microbench.fabric.gpu_kinds import GpuKind, KindError, target

INSTALL_HINT = "pip install -e '.[gpu-compile]'"


class TargetError(RuntimeError):
  """The compile-only target can't be set up; the message says what to do."""


def plugin_available() -> bool:
  """Whether JAX's CUDA PJRT plugin is installed (it is what compiles for GPUs here)."""
  return quiet_start.plugin_installed()


def require_plugin() -> None:
  if not plugin_available():
    raise TargetError(f"--target compiles with XLA:GPU, which needs JAX's CUDA plugin: {INSTALL_HINT}"
                      " (about 3 GB with cuDNN, no GPU or driver needed)")


def keep_default_backend_on_cpu() -> None:
  """With the CUDA plugin installed and no GPU, JAX would still try CUDA first: the default backend stays
  the CPU (call before JAX starts its backends; a user's JAX_PLATFORMS is respected)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


@dataclasses.dataclass(frozen=True)
class Target:
  kind: GpuKind
  hosts: int
  gpus_per_host: int
  devices: tuple[Any, ...]  # compile-only devices, ordered by (host, id)
  cuda_version: str | None = None  # the CUDA driver and runtime the description says the nodes run

  @property
  def memory_bytes(self) -> int:
    return int(self.kind.memory_bytes or 0)

  def describe(self) -> dict[str, Any]:
    """meta.json's and every record's view of the target."""
    return {"kind": self.kind.name, "title": self.kind.title, "device_kind": self.kind.device_kind,
            "hosts": self.hosts, "gpus_per_host": self.gpus_per_host, "devices": len(self.devices),
            "memory_bytes": self.memory_bytes, "spec_file": os.path.basename(self.kind.source_file),
            "cuda_version": self.cuda_version}


# XLA:GPU reads the CUDA driver and runtime versions from the device description and, below 12.3, leaves
# collectives, loops and conditionals out of command buffers (no stream capture into graphs, no device-side
# control flow). A deviceless description has no versions (0.0.0), so every compile for a target left them out
# where a current node keeps them. The description says the nodes run the CUDA the plugin was built with (the
# runtime JAX's CUDA wheels install, and a driver at least that new); on a node whose driver is older than 12.3
# the run's own check says the collective stayed outside.
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def plugin_cuda_version() -> str | None:
  """The CUDA version JAX's CUDA plugin was built with (`12.9.0`), None when it can't say."""
  for name in _CUDA_PLUGINS:
    try:
      build = int(importlib.import_module(f"{name}._versions").cuda_runtime_build_version())
    except Exception:  # pylint: disable=broad-except
      continue
    return f"{build // 1000}.{build % 1000 // 10}.0"
  return None


def with_cuda_versions(target_config: str, version: str | None) -> str:
  """The GpuTargetConfigProto text with the driver, runtime and toolkit versions of its device set."""
  if not version:
    return target_config
  fields = "".join(f'  {k}: "{version}"\n' for k in ("driver_version", "runtime_version",
                                                     "compile_time_toolkit_version"))
  return target_config.replace("gpu_device_info {\n", "gpu_device_info {\n" + fields, 1)


def make_target(name: str, hosts: int, gpus_per_host: int) -> Target:
  """Compile-only devices of kind `name` on `hosts` hosts of `gpus_per_host` GPUs (raises KindError for an
  unknown kind, TargetError without the plugin)."""
  kind = target(name)
  require_plugin()
  keep_default_backend_on_cpu()
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  cuda = plugin_cuda_version()
  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=with_cuda_versions(kind.target_config(), cuda),
                                        topology=f"1x{hosts}x{gpus_per_host}")
  except Exception as e:  # pylint: disable=broad-except
    raise TargetError(f"XLA:GPU could not describe {hosts} x {gpus_per_host} {kind.title}: "
                      f"{str(e).strip().splitlines()[0][:300]}") from None
  devices = tuple(sorted(topo.devices, key=lambda d: (d.process_index, d.id)))
  return Target(kind, hosts, gpus_per_host, devices, cuda)


# Without a GPU, XLA:GPU cannot autotune: its Triton GEMM fusions take heuristic tile sizes, and for some shapes
# (ViT-H's 16 x 257-token batches) none fits ("Couldn't find output tile sizes"). A real GPU would autotune
# them; here such a program is compiled again with those GEMMs left to cuBLAS, and the record says so.
TRITON_GEMM_OFF = {"xla_gpu_enable_triton_gemm": False}


def compile_for_target(compile_fn, options: dict | None) -> tuple[Any, str | None]:
  """`compile_fn(options)`, retried with Triton GEMM fusions off when deviceless XLA:GPU finds no tile sizes
  for one; returns the compiled program and a note (None when the first compile went through)."""
  try:
    return compile_fn(options), None
  except Exception as e:  # pylint: disable=broad-except
    if "Couldn't find output tile sizes" not in str(e):
      raise
  return compile_fn({**(options or {}), **TRITON_GEMM_OFF}), (
      "compiled with xla_gpu_enable_triton_gemm=false: without a GPU to autotune on, XLA:GPU found no Triton"
      " tile sizes for a GEMM (a real GPU autotunes them); those GEMMs are cuBLAS calls here")


def memory(compiled) -> dict[str, int] | None:
  """XLA's per-device memory analysis of a compiled program: arguments, outputs, temporaries, aliased bytes
  and the total the device must hold at once (arguments + outputs - aliased + temporaries + code)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if m is None:
    return None
  args, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
  alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
  code = int(m.generated_code_size_in_bytes)
  return {"argument_bytes": args, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
          "code_bytes": code, "total_bytes": args + out - alias + temp + code}


DEFAULT_MEM_FRACTION = 0.75  # JAX on GPU preallocates this share of device memory for XLA's allocator


def mem_fraction() -> float:
  """The share of device memory a JAX process on the GPU will use: XLA_CLIENT_MEM_FRACTION (current JAX's name)
  or XLA_PYTHON_CLIENT_MEM_FRACTION (the older one) as the run would see it, else JAX's default 0.75."""
  text = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  try:
    value = float(text or DEFAULT_MEM_FRACTION)
  except ValueError:
    return DEFAULT_MEM_FRACTION
  return value if 0 < value <= 1 else DEFAULT_MEM_FRACTION


TPU_MEM_FRACTION = 1.0  # JAX on TPU preallocates nothing: XLA:TPU's allocator has the whole HBM it reports


def fit(total_bytes: int, memory_bytes: int, fraction: float | None = None) -> dict[str, Any]:
  """Whether a program needing `total_bytes` per device fits what JAX gets of a device of `memory_bytes`
  (`fraction` of it, by default mem_fraction(): a GPU's), with the margin; `fits_whole_device` says whether it
  would with all of it."""
  fraction = mem_fraction() if fraction is None else fraction
  usable = int(memory_bytes * fraction)
  return {"fits": total_bytes <= usable, "device_memory_bytes": memory_bytes, "usable_bytes": usable,
          "mem_fraction": fraction, "margin_bytes": usable - total_bytes,
          "fits_whole_device": total_bytes <= memory_bytes,
          "memory_used_pct": 100.0 * total_bytes / usable if usable else None}


__all__ = ["Target", "TargetError", "KindError", "make_target", "memory", "fit", "plugin_available",
           "plugin_cuda_version", "with_cuda_versions", "INSTALL_HINT"]
