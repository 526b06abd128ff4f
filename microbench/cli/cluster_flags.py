"""Flags every command shares: joining a multi-process `jax.distributed` job, racks of nodes, and a GPU kind
to compile for without running (`--target`).

Importing this module defines them; `settings()` turns them into microbench.cluster.distributed.Settings.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from absl import app, flags

from microbench.cluster import binding
from microbench.cluster.distributed import Settings

FLAGS = flags.FLAGS

flags.DEFINE_bool("distributed", False, "Initialise jax.distributed (auto-detects SLURM / Open MPI).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator.")
flags.DEFINE_integer("num_processes", None, "Number of processes in the job.", lower_bound=1)
flags.DEFINE_integer("process_id", None, "This process's index.", lower_bound=0)
flags.DEFINE_string("local_device_ids", None,
                    "GPUs this process drives, as indices among the GPUs it sees (CUDA_VISIBLE_DEVICES renumbers"
                    " them from 0), e.g. 0,1,2,3. Default: from the launcher (one task per GPU: GPU numbered by the"
                    " local rank; a task SLURM bound to its own GPUs, or one task per node: all it sees); see"
                    " docs/clusters.md#gpu-binding.")
flags.DEFINE_integer("nodes_per_rack", None,
                     "Group this many nodes (hosts) into one rack (NVLink domain). Default: one rack.",
                     lower_bound=1)
flags.DEFINE_string("target", None, "Compile for a GPU cluster or a TPU pod without one: a GPU kind (a100, h100,"
                    " h200, gh200, b200, gb200, b300, gb300) whose compile-only devices, shaped by --topology (hosts"
                    " = racks x nodes), XLA:GPU compiles every program for (the gpu-compile extra), or a TPU kind"
                    " (v5e, v5p, v6e) with --topology a slice such as 4x4x4 or 16x16,slices:2, compiled by XLA:TPU"
                    " (the tpu-compile extra); nothing runs.")
flags.DEFINE_integer("heartbeat_timeout", 10,
                     "Seconds without a heartbeat before a peer is declared dead.", lower_bound=1)
flags.DEFINE_integer("init_timeout", 120, "Seconds to wait for all processes to join.", lower_bound=1)
flags.DEFINE_integer("collective_timeout", 45,
                     "Seconds a CPU (gloo) collective may wait for its peers before failing.", lower_bound=1)


# Flags of a job of several processes: with --target no process runs, so none of them does anything.
JOB_FLAGS = ("distributed", "coordinator_address", "num_processes", "process_id", "local_device_ids")


def refuse_with_target(names: Sequence[str]) -> None:
  """With --target nothing runs: a flag that only matters to a run, set to anything but its default, is
  refused with one line rather than silently ignored."""
  if not FLAGS.target:
    return
  given = [n for n in names if FLAGS[n].value != FLAGS[n].default]
  if given:
    raise app.UsageError(f"{', '.join('--' + n for n in given)} {'does' if len(given) == 1 else 'do'} nothing with"
                         f" --target={FLAGS.target} (compile only: no process runs, nothing is timed); drop"
                         f" {'it' if len(given) == 1 else 'them'}, or drop --target to run")


def settings() -> Settings:
  """The parsed flags as distributed-start-up settings, with this process's GPU binding decided (a bad
  --local_device_ids, or a launcher binding no rule can map, is one line here rather than a JAX error later)."""
  try:
    ids = binding.parse_ids(FLAGS.local_device_ids) if FLAGS.local_device_ids is not None else None
    bound = None if FLAGS.target else binding.decide(ids, FLAGS.distributed, os.environ)
  except binding.BindingError as e:
    raise app.UsageError(str(e)) from None
  return Settings(enabled=FLAGS.distributed, coordinator_address=FLAGS.coordinator_address,
                  num_processes=FLAGS.num_processes, process_id=FLAGS.process_id,
                  heartbeat_timeout=FLAGS.heartbeat_timeout, init_timeout=FLAGS.init_timeout,
                  collective_timeout=FLAGS.collective_timeout, local_device_ids=ids, binding=bound)
