"""The software and hardware stack a run ran on, for meta.json and the stdout header.

Two runs that differ only in NCCL_ALGO, XLA_FLAGS, the driver or the jaxlib build are different
experiments; the run folder must say which. Every fact is gathered on its own and a fact that can't be had
is null: capturing the environment never fails a run. Process 0's view is recorded (the variables of
other processes are assumed the same, as launchers export them to every rank).
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from microbench.cluster import binding, launch

ENV_PREFIXES = ("NCCL_", "JAX_", "TF_CPP_", "XLA_CLIENT_", "XLA_PYTHON_CLIENT_")  # the last two: device memory
ENV_NAMES = ("XLA_FLAGS", "CUDA_VISIBLE_DEVICES")
# Distributions whose versions matter to a result: the JAX stack, its GPU/TPU plugins, NCCL's wheel.
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy")
_PLUGIN_PREFIXES = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu", "nvidia-nccl")


def _safe(fn: Callable[[], Any]) -> Any:
  try:
    return fn()
  except Exception:  # pylint: disable=broad-except
    return None


def variables(environ: dict[str, str] | None = None) -> dict[str, str]:
  """XLA_FLAGS, CUDA_VISIBLE_DEVICES and every NCCL_*, JAX_*, TF_CPP_*, XLA_[PYTHON_]CLIENT_* variable set."""
  environ = os.environ if environ is None else environ
  return {k: v for k, v in sorted(environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def package_versions() -> dict[str, str | None]:
  out: dict[str, str | None] = {name: _safe(lambda n=name: importlib.metadata.version(n)) for name in _PACKAGES}
  for dist in _safe(lambda: list(importlib.metadata.distributions())) or []:
    name = _safe(lambda d=dist: d.metadata["Name"]) or ""
    if name.lower().startswith(_PLUGIN_PREFIXES):
      out[name] = _safe(lambda d=dist: d.version)
  return out


def toolkit() -> dict[str, Any]:
  """microbench's version, and the git commit when it runs from a checkout."""
  root = launch.REPO_ROOT
  info: dict[str, Any] = {"version": _safe(lambda: importlib.metadata.version("microbench")),
                          "git_commit": None, "git_dirty": None}
  if os.path.exists(os.path.join(root, ".git")):
    def git(*args: str) -> str:
      return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10,
                            check=True).stdout.strip()
    info["git_commit"] = _safe(lambda: git("rev-parse", "HEAD")) or None
    status = _safe(lambda: git("status", "--porcelain", "--untracked-files=no"))
    info["git_dirty"] = None if status is None else bool(status)
  return info


def _cuda_version(code: int | None) -> str | None:
  """CUDA's 1000 * major + 10 * minor -> 'major.minor'."""
  return None if not code else f"{code // 1000}.{code % 1000 // 10}"


def _nccl_version() -> str | None:
  """ncclGetVersion from the libnccl the CUDA plugin ships (or the system's); codes are
  major*10000 + minor*100 + patch since NCCL 2.9."""
  candidates = []
  spec = _safe(lambda: importlib.util.find_spec("nvidia.nccl"))
  for base in (spec.submodule_search_locations or []) if spec else []:
    candidates += glob.glob(os.path.join(base, "lib", "libnccl.so*"))
  candidates.append("libnccl.so.2")
  for path in candidates:
    lib = _safe(lambda p=path: ctypes.CDLL(p))
    if lib is None:
      continue
    code = ctypes.c_int(0)
    if _safe(lambda: lib.ncclGetVersion(ctypes.byref(code))) == 0 and code.value:
      v = code.value
      return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v >= 20900 else f"{v // 1000}.{v % 1000 // 100}.{v % 100}"
  return None


def _nvidia_driver() -> str | None:
  """The kernel driver version, e.g. 550.54.15, from /proc (no nvidia-smi process needed)."""
  with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
    words = f.readline().split()
  for i, w in enumerate(words):
    if w == "Kernel" and i + 2 < len(words) and words[i + 1] == "Module":
      return words[i + 2]
  return None


def gpu_stack() -> dict[str, Any]:
  """CUDA driver and runtime, cuDNN and NCCL versions (null where not found)."""
  versions = None
  for pkg in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jaxlib.cuda"):
    versions = _safe(lambda p=pkg: importlib.import_module(f"{p}._versions"))
    if versions is not None:
      break
  call = (lambda name: _safe(getattr(versions, name))) if versions is not None else (lambda name: None)
  cudnn = call("cudnn_get_version")
  return {
      "nvidia_driver": _safe(_nvidia_driver),
      "cuda_driver_api": _cuda_version(call("cuda_driver_get_version")),
      "cuda_runtime": _cuda_version(call("cuda_runtime_get_version")),
      "cudnn": None if not cudnn else f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}",
      "nccl": _safe(_nccl_version),
  }


def nics() -> list[dict[str, Any]]:
  """InfiniBand/RoCE ports the host has, with rate and state (Slingshot shows as cxi devices)."""
  out = []
  for port in sorted(glob.glob("/sys/class/infiniband/*/ports/*")):
    def read(name: str, p: str = port) -> str | None:
      return _safe(lambda: open(os.path.join(p, name), encoding="utf-8").read().strip())
    out.append({"device": port.split(os.sep)[-3], "port": port.split(os.sep)[-1], "rate": read("rate"),
                "state": read("state"), "link_layer": read("link_layer")})
  out += [{"device": os.path.basename(d), "port": None, "rate": None, "state": None, "link_layer": "cxi"}
          for d in sorted(glob.glob("/sys/class/cxi/*"))]
  return out


def devices() -> list[dict[str, Any]]:
  """Device kinds of the job with their counts, and each local kind's memory limit."""
  import jax  # pylint: disable=g-import-not-at-top
  kinds: dict[str, dict[str, Any]] = {}
  for d in jax.devices():
    k = kinds.setdefault(d.device_kind, {"kind": d.device_kind, "platform": d.platform, "count": 0,
                                         "memory_bytes": None})
    k["count"] += 1
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top  # imports JAX and the target layer
  for d in jax.local_devices():
    if kinds[d.device_kind]["memory_bytes"] is None:
      kinds[d.device_kind]["memory_bytes"] = machine.device_memory(d)
  return list(kinds.values())


def gpu_binding() -> dict[str, Any] | None:
  """Which GPUs this process was given and by which rule (microbench.cluster.binding), with the launcher's
  variables it read; None when nothing decided one (a library caller that never ran distributed.initialize)."""
  bound = binding.current()
  return bound.record() if bound else None


def capture(hosts: list[str] | None = None, gpu: bool | None = None) -> dict[str, Any]:
  """Everything above; `gpu` None: look for the CUDA stack when JAX's backend is a GPU."""
  if gpu is None:
    gpu = bool(_safe(lambda: __import__("jax").default_backend() in ("gpu", "cuda", "rocm")))
  return {
      "variables": _safe(variables) or {},
      "python": sys.version.split()[0],
      "python_implementation": platform.python_implementation(),
      "os": _safe(platform.platform),
      "toolkit": _safe(toolkit) or {"version": None, "git_commit": None, "git_dirty": None},
      "packages": _safe(package_versions) or {},
      "gpu": (_safe(gpu_stack) if gpu else None),
      "devices": _safe(devices),
      "hosts": sorted(set(hosts)) if hosts else None,
      "nics": _safe(nics),
      "gpu_binding": _safe(gpu_binding),
  }


def header(env: dict[str, Any]) -> list[str]:
  """The stdout header lines (nccl-tests prints its own and NCCL's version on every run)."""
  tk = env.get("toolkit") or {}
  pk = env.get("packages") or {}
  commit = tk.get("git_commit")
  where = f" (git {commit[:10]}{', modified' if tk.get('git_dirty') else ''})" if commit else ""
  plugins = ", ".join(f"{k} {v}" for k, v in pk.items() if k.lower().startswith(_PLUGIN_PREFIXES))
  lines = [f"# microbench {tk.get('version')}{where}; python {env.get('python')}; jax {pk.get('jax')},"
           f" jaxlib {pk.get('jaxlib')}{'; ' + plugins if plugins else ''}"]
  g = env.get("gpu")
  if g:
    lines.append(f"# NVIDIA driver {g.get('nvidia_driver')}, CUDA driver API {g.get('cuda_driver_api')},"
                 f" CUDA runtime {g.get('cuda_runtime')}, cuDNN {g.get('cudnn')}, NCCL {g.get('nccl')}")
  bound = env.get("gpu_binding")
  if bound and bound.get("rule") not in ("single_process", "no_launcher"):
    ids = bound.get("local_device_ids")
    lines.append(f"# GPU binding (process 0): {'all it sees' if ids is None else ','.join(map(str, ids))}"
                 f" by rule {bound.get('rule')}: {bound.get('reason')}")
  variables_set = env.get("variables") or {}
  lines.append("# " + ("; ".join(f"{k}={v}" for k, v in variables_set.items()) if variables_set
                       else "no XLA_FLAGS, NCCL_*, JAX_* or TF_CPP_* variables set"))
  return lines
