"""Multi-process runs: `jax.distributed` start-up, flags shared by every command, and the process map.

Every command of the toolkit imports this module, so its flags exist everywhere. With `--distributed`
and nothing else, JAX auto-detects SLURM and Open MPI; the explicit flags override. Timeouts are short
so a dead peer ends the job in seconds instead of hanging it.
"""

from __future__ import annotations

import functools
import os
import socket

import numpy as np
from absl import flags

FLAGS = flags.FLAGS

flags.DEFINE_bool("distributed", False, "Initialise jax.distributed (auto-detects SLURM / Open MPI).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator.")
flags.DEFINE_integer("num_processes", None, "Number of processes in the job.", lower_bound=1)
flags.DEFINE_integer("process_id", None, "This process's index.", lower_bound=0)
flags.DEFINE_integer("nodes_per_rack", None,
                     "Group this many nodes (hosts) into one rack (NVLink domain). Default: one rack.",
                     lower_bound=1)
flags.DEFINE_integer("heartbeat_timeout", 10,
                     "Seconds without a heartbeat before a peer is declared dead.", lower_bound=1)
flags.DEFINE_integer("init_timeout", 120, "Seconds to wait for all processes to join.", lower_bound=1)
flags.DEFINE_integer("collective_timeout", 45,
                     "Seconds a CPU (gloo) collective may wait for its peers before failing.", lower_bound=1)

HOSTNAME_ENV = "MICROBENCH_HOSTNAME"  # lets tests and the testbed present processes as separate hosts


def hostname() -> str:
  return os.environ.get(HOSTNAME_ENV) or socket.gethostname()


def initialize() -> None:
  """Starts jax.distributed when `--distributed` is set; a no-op otherwise. Call before any JAX use."""
  if not FLAGS.distributed:
    return
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_collective_timeout_seconds" not in xla_flags:  # read when the backend starts, i.e. later
    os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_cpu_collective_timeout_seconds={FLAGS.collective_timeout}".strip()
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=FLAGS.coordinator_address,
      num_processes=FLAGS.num_processes,
      process_id=FLAGS.process_id,
      initialization_timeout=FLAGS.init_timeout,
      heartbeat_timeout_seconds=FLAGS.heartbeat_timeout,
      shutdown_timeout_seconds=max(5, FLAGS.heartbeat_timeout),
  )


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
