"""Multi-process runs: `jax.distributed` start-up, each process's host, and whether an error means a peer died.

With `enabled` and nothing else, JAX auto-detects SLURM and Open MPI; the explicit settings override. Which
GPUs a process drives is decided here, not by JAX's local-rank rule (microbench.cluster.binding says why).
Timeouts are short so a dead peer ends the job in seconds instead of hanging it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket

import numpy as np

from microbench.cluster import binding as gpu_binding


@dataclasses.dataclass(frozen=True)
class Settings:
  """How to join a multi-process job (from the --distributed flags of microbench.cli.cluster_flags).

  `enabled` alone lets JAX auto-detect SLURM and Open MPI; the explicit fields override."""
  enabled: bool = False
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout: int = 10
  init_timeout: int = 120
  collective_timeout: int = 45
  local_device_ids: tuple[int, ...] | None = None  # --local_device_ids; None: decided from the launcher
  binding: gpu_binding.Binding | None = None  # decided already (the CLI does, to refuse a bad one in one line)


HOSTNAME_ENV = "MICROBENCH_HOSTNAME"  # lets tests and the testbed present processes as separate hosts


def hostname() -> str:
  return os.environ.get(HOSTNAME_ENV) or socket.gethostname()


def initialize(settings: Settings) -> gpu_binding.Binding:
  """Starts jax.distributed when `settings.enabled`, with the GPUs the binding rules give this process (without
  it only explicit --local_device_ids restrict them). Call before any JAX use; BindingError where no binding is
  right."""
  bound = settings.binding or gpu_binding.decide(settings.local_device_ids, settings.enabled, os.environ)
  gpu_binding.remember(bound)
  if not settings.enabled:
    if bound.local_device_ids is not None:  # what jax.distributed.initialize would set, read when the backend starts
      import jax  # pylint: disable=g-import-not-at-top
      ids = ",".join(map(str, bound.local_device_ids))
      jax.config.update("jax_cuda_visible_devices", ids)
      jax.config.update("jax_rocm_visible_devices", ids)
    return bound
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_collective_timeout_seconds" not in xla_flags:  # read when the backend starts, i.e. later
    os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_cpu_collective_timeout_seconds={settings.collective_timeout}".strip()
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=settings.coordinator_address,
      num_processes=settings.num_processes,
      process_id=settings.process_id,
      local_device_ids=bound.jax_argument(),
      initialization_timeout=settings.init_timeout,
      heartbeat_timeout_seconds=settings.heartbeat_timeout,
      shutdown_timeout_seconds=max(5, settings.heartbeat_timeout),
  )
  return bound


@functools.cache
def process_hosts() -> list[str]:
  """Hostname of every process, indexed by process index (a collective: every process must call it).

  Cached: hosts don't change while a process lives, and the topology and meta.json both need them."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  if jax.process_count() == 1:
    return [hostname()]
  raw = np.zeros(256, np.uint8)
  name = hostname().encode()[:256]
  raw[:len(name)] = np.frombuffer(name, np.uint8)
  everyone = np.asarray(multihost_utils.process_allgather(raw, tiled=False)).reshape(jax.process_count(), 256)
  return [bytes(row).rstrip(b"\0").decode() for row in everyone]


PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset", "heartbeat", "UNAVAILABLE",
                        "DEADLINE_EXCEEDED", "Gloo", "gloo", "timed out", "coordination service")


def is_peer_failure(message: str) -> bool:
  """Whether a runtime error means another process of the job is gone (the job can't go on)."""
  return any(m in message for m in PEER_FAILURE_MARKERS)
