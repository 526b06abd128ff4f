"""Peak dense matmul TFLOP/s per device, the denominator of MFU.

Accelerators: the vendor's dense (not 2:4 sparse) figure, matched on the exact device kind JAX reports (the
CUDA device name), never on a substring: an H100 PCIe must not get the SXM's peak, nor an H200 NVL the
H200's. TPUs: the kind's dense bf16 figure from the TPU kinds table (microbench/fabric/tpu_specs), matched on
JAX's device_kind ("TPU v5" is a v5p, "TPU v5 lite" a v5e); float32 matmuls on a TPU run as bfloat16 passes
at JAX's default precision, so the bf16 peak is their peak too. An unknown kind gets no peak and no MFU, with a
note saying so. float32 compute on NVIDIA runs on
TF32 tensor cores (JAX's default matmul precision), so its peak is the dense TF32 figure. An MI250X module
is two GCDs and JAX sees each GCD as a device, so its per-device figure is half the module's.
CPU has no spec sheet: a jitted matmul is timed in several calibration runs and their median is the peak,
labelled as measured, with the spread in the record; the CPU devices of one process share its cores, so
each gets an equal share. The calibration is made once per machine (CPU model, core count, dtype) and kept in
a small JSON file with its spread and date (`MICROBENCH_PEAK_CACHE`, default ~/.cache/microbench/cpu_peaks.json):
re-measured in every run it moved 38% between runs, so two runs' MFU differed more than their throughput.
`MICROBENCH_REMEASURE_PEAK=1` measures again and replaces the entry.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

from microbench.fabric import gpu_kinds, tpu_kinds


@dataclasses.dataclass(frozen=True)
class Peak:
  tflops: float | None  # per device; None: unknown, so no MFU
  source: str
  calibration: dict[str, Any] | None = None  # CPU: the calibration runs


@dataclasses.dataclass(frozen=True)
class PeakEntry:
  kinds: tuple[str, ...]  # exact device_kind strings (CUDA device names) of this product
  name: str
  bf16: float  # dense TFLOP/s per device
  tf32: float
  cite: str


# Dense figures (half the datasheets' "with sparsity" ones), one entry per kind of the GPU kinds table
# (microbench/fabric/gpu_specs/*.toml: each figure with its source, the peaks' in `peak_cite`, quoted in every
# Peak's source). Device names: what CUDA reports (cudaDeviceProp.name), which is JAX's device_kind on NVIDIA
# GPUs; an MI250X GCD's is the ROCm marketing name.
PEAK_TABLE: tuple[PeakEntry, ...] = tuple(
    PeakEntry(k.device_kinds, k.title, k.bf16_tflops, k.tf32_tflops, k.peak_cite)
    for k in gpu_kinds.kinds().values())
_BY_KIND = {kind: e for e in PEAK_TABLE for kind in e.kinds}


def table_peak(device_kind: str, dtype: str) -> Peak | None:
  """Spec-sheet peak for a device kind matched exactly (surrounding spaces ignored), or None."""
  e = _BY_KIND.get(device_kind.strip())
  if e is None:
    return tpu_peak(device_kind, dtype)
  bf16 = dtype == "bfloat16"
  return Peak(e.bf16 if bf16 else e.tf32, f"{e.name} dense {'bf16' if bf16 else 'tf32/fp32'} spec ({e.cite})")


def tpu_peak(device_kind: str, dtype: str) -> Peak | None:
  """A TPU kind's dense bf16 peak per chip (one JAX device per chip), or None for a kind the table lacks."""
  kind = tpu_kinds.lookup(device_kind)
  if kind is None:
    return None
  how = "bf16" if dtype == "bfloat16" else "bf16 (float32 matmuls run as bf16 passes at JAX's default precision)"
  return Peak(kind.bf16_tflops, f"{kind.title} dense {how} spec ({kind.peak_cite})")


def _time_matmul(f, a, b, reps: int) -> float:
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return best


@functools.cache
def calibrate_cpu_matmul(dtype: str = "float32", n: int = 1024, runs: int = 5, reps: int = 3) -> dict[str, Any]:
  """TFLOP/s of an n x n x n jitted matmul on the first CPU device (all cores): `runs` calibrations, each the
  best of `reps` calls; the median is the peak, the spread `(max - min) / median` says how steady it was."""
  dev = jax.devices("cpu")[0]
  dt = jnp.dtype(dtype)
  a = jax.device_put(jnp.ones((n, n), dt), dev)
  b = jax.device_put(jnp.full((n, n), 0.5, dt), dev)
  f = jax.jit(lambda x, y: x @ y)
  f(a, b).block_until_ready()
  values = [2.0 * n ** 3 / _time_matmul(f, a, b, reps) / 1e12 for _ in range(runs)]
  med = statistics.median(values)
  return {"tflops_runs": values, "median_tflops": med, "spread": (max(values) - min(values)) / med,
          "matmul": f"{n}^3 {dtype}", "best_of": reps}


def _cache_path() -> str:
  return os.environ.get("MICROBENCH_PEAK_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "microbench", "cpu_peaks.json")


def _machine_key(dtype: str) -> str:
  """What the peak depends on: the CPU model, its core count, the dtype (the matmul's size is fixed)."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
  except OSError:  # no /proc (not Linux): platform's name stands
    pass
  return f"{model} | {os.cpu_count()} cores | {dtype}"


# No CPU core reaches this (AVX-512 fp32 is ~0.2 TFLOP/s per core, AMX bf16 ~2): a calibration above it timed
# something other than the matmul (a clock or a call that did not wait), and an MFU from it would be ~0%.
PLAUSIBLE_TFLOPS_PER_CORE = 5.0


def plausible(cal: dict[str, Any]) -> bool:
  """Whether a CPU calibration could be this machine's matmul rate."""
  return 0 < cal.get("median_tflops", 0) <= PLAUSIBLE_TFLOPS_PER_CORE * (os.cpu_count() or 1)


def machine_cpu_peak(dtype: str) -> dict[str, Any]:
  """This machine's CPU calibration: measured once (calibrate_cpu_matmul), then read back from the cache file
  with its date and spread; a cache that can't be read or written is measured around, never fatal."""
  path, key = _cache_path(), _machine_key(dtype)
  try:
    with open(path, encoding="utf-8") as f:
      cache = json.load(f)
  except (OSError, ValueError):
    cache = {}
  if key in cache and not os.environ.get("MICROBENCH_REMEASURE_PEAK") and plausible(cache[key]):
    return {**cache[key], "reused": True}
  cal = {**calibrate_cpu_matmul(dtype), "machine": key,
         "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  if not plausible(cal):
    return {**cal, "reused": False}  # never kept: the next run measures again
  cache[key] = cal
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(cache, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
  except OSError:  # a read-only home: this run uses its measurement, the next one measures again
    pass
  return {**cal, "reused": False}


def device_peak(device: jax.Device, dtype: str, local_devices: int) -> Peak:
  """Peak TFLOP/s of one device: the table for accelerators, this machine's measured matmul on CPU."""
  if device.platform == "cpu":
    cal = machine_cpu_peak(dtype)
    machine = cal["median_tflops"]
    if not plausible(cal):
      return Peak(None, f"CPU matmul calibration of {machine:.3g} TFLOP/s per process is above what"
                  f" {os.cpu_count()} cores can do ({PLAUSIBLE_TFLOPS_PER_CORE:g} per core): not kept, no MFU", cal)
    share = f", shared by {local_devices} CPU devices" if local_devices > 1 else ""
    when = f"measured {cal['measured_at'][:10]}, reused" if cal["reused"] else "measured now"
    return Peak(machine / local_devices,
                f"CPU matmul peak of this machine ({cal['matmul']}, median of {len(cal['tflops_runs'])} calibrations"
                f" {machine:.3f} TFLOP/s per process, spread {100 * cal['spread']:.0f}%, {when}{share})", cal)
  peak = table_peak(device.device_kind, dtype)
  if peak is None:
    return Peak(None, f"unknown device kind {device.device_kind!r}: no spec-sheet peak in"
                " microbench/train/flops_peaks.py, so no MFU (add the exact kind with its datasheet figure)")
  return peak
