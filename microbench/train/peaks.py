"""Peak dense matmul TFLOP/s per device, the denominator of MFU.

Accelerators: vendor dense (not sparse) figures per JAX device. float32 compute on NVIDIA uses TF32
tensor cores (JAX's default matmul precision), so its peak is the dense TF32 figure. An MI250X module
is two GCDs and JAX sees each GCD as a device, so its per-device figure is half the module's.
CPU has no spec sheet: a jitted matmul is timed and that is the peak, labelled as measured; the CPU
devices of one process share its cores, so each gets an equal share.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Peak:
  tflops: float  # per device
  source: str


# device_kind substring (checked in order, lower case) -> (bf16 dense, tf32/fp32-matrix dense) TFLOP/s.
PEAK_TABLE: tuple[tuple[str, str, float, float], ...] = (
    ("gh200", "NVIDIA GH200", 989.0, 494.0),
    ("h200", "NVIDIA H200", 989.0, 494.0),
    ("h100", "NVIDIA H100 SXM", 989.0, 494.0),
    ("a100", "NVIDIA A100", 312.0, 156.0),
    ("gb300", "NVIDIA GB300 (B300), unverified", 2500.0, 1250.0),
    ("b300", "NVIDIA B300, unverified", 2500.0, 1250.0),
    ("gb200", "NVIDIA GB200 (B200 class), unverified", 2250.0, 1100.0),
    ("b200", "NVIDIA B200, unverified", 2250.0, 1100.0),
    ("mi250x", "AMD MI250X, one GCD (half a module)", 191.5, 47.9),
)


def table_peak(device_kind: str, dtype: str) -> Peak | None:
  """Spec-sheet peak for a device kind, or None if the kind is not in the table."""
  kind = device_kind.lower()
  for key, name, bf16, fp32 in PEAK_TABLE:
    if key in kind:
      value = bf16 if dtype == "bfloat16" else fp32
      return Peak(value, f"{name} dense {'bf16' if dtype == 'bfloat16' else 'tf32/fp32'} spec")
  return None


@functools.cache
def measure_cpu_matmul_tflops(dtype: str = "float32", n: int = 1024, reps: int = 5) -> float:
  """Best-of-`reps` TFLOP/s of an n x n x n jitted matmul on the first CPU device (all cores)."""
  dev = jax.devices("cpu")[0]
  dt = jnp.dtype(dtype)
  a = jax.device_put(jnp.ones((n, n), dt), dev)
  b = jax.device_put(jnp.full((n, n), 0.5, dt), dev)
  f = jax.jit(lambda x, y: x @ y)
  f(a, b).block_until_ready()
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2.0 * n ** 3 / best / 1e12


def device_peak(device: jax.Device, dtype: str, local_devices: int) -> Peak:
  """Peak TFLOP/s of one device: the table for accelerators, a measured matmul on CPU."""
  if device.platform == "cpu":
    machine = measure_cpu_matmul_tflops(dtype)
    share = f", shared by {local_devices} CPU devices" if local_devices > 1 else ""
    return Peak(machine / local_devices, f"measured CPU matmul peak ({dtype}, 1024^3, {machine:.3f} TFLOP/s"
                f" per process{share})")
  peak = table_peak(device.device_kind, dtype)
  if peak is None:
    return Peak(float("nan"), f"unknown device kind {device.device_kind!r}: no peak, no MFU")
  return peak
