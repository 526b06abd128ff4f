"""Where a job's processes run: local processes, the emulated cluster (testbed), or SLURM job steps.

Every backend turns one job of an experiment (its nodes and ranks per node) and the proxy's command line
into `launch.Proc`s, not yet started; the runner starts, watches, respawns and stops them. One process per
rank: ranks [k * r, (k + 1) * r) run on the job's k-th node (r = ranks per node).

- local: every rank on this machine; each node's ranks report one host name (`node<i>`).
- testbed: each machine node is a testbed host (a network namespace); the job's ranks run inside their
  node's host, so jobs on nodes of one rack share its uplink and jobs on one host share its link.
- slurm: one `srun --exact` step per job instance inside the study's allocation, on the job's nodes (machine
  node i = the allocation's i-th host, or the node map's host names); jax.distributed reads SLURM's task
  settings, the coordinator (first node, a port drawn per instance) is passed explicitly so concurrent steps
  sharing a first node don't collide on JAX's port derived from the job id.
"""

from __future__ import annotations

import os
import random
import shlex
import subprocess
import sys
from collections.abc import Sequence

from microbench.cluster import launch, testbed_jobs
from microbench.cluster import testbed as tbm
from microbench.study import machines as mm
from microbench.fabric import rates

BACKENDS = ("local", "testbed", "slurm")


class BackendError(RuntimeError):
  """The backend can't run here (no SLURM allocation, no root for the testbed, ...); one line."""


def rank_nodes(job: dict) -> list[int]:
  """The machine node of every rank of a job, in rank order."""
  per = job["ranks_per_node"]
  return [job["nodes"][r // per] for r in range(job["gpus"])]


class Backend:
  name = ""

  def open(self) -> None:
    """Acquire what the backend needs (the testbed's network); idempotent."""

  def close(self) -> None:
    """Release it (always called, also after a failure or an interruption)."""

  def procs(self, job: dict, command: Sequence[str], tag: str, log_dir: str) -> list[launch.Proc]:
    raise NotImplementedError

  def describe(self) -> str:
    return self.name


def rank_gpu(job: dict, rank: int) -> int:
  """The GPU index (on its node) of a rank: the job's first slot plus the rank's place on the node."""
  return job.get("first_slot", 0) + rank % job["ranks_per_node"]


class LocalBackend(Backend):
  """Every rank on this machine: one machine node's ranks report the host name node<i>; on a GPU machine
  (one node, e.g. the DGX preset) each rank sees only its own GPU (CUDA/HIP_VISIBLE_DEVICES)."""
  name = "local"

  def procs(self, job, command, tag, log_dir):
    os.makedirs(log_dir, exist_ok=True)
    coordinator = f"127.0.0.1:{launch.free_port()}"
    out = []
    for i, node in enumerate(rank_nodes(job)):
      argv = list(command) + launch.distributed_flags(coordinator, job["gpus"], i)
      env = launch.rank_env(coordinator, job["gpus"], i, 1, f"node{node}", job=tag)
      env["CUDA_VISIBLE_DEVICES"] = env["HIP_VISIBLE_DEVICES"] = str(rank_gpu(job, i))
      out.append(launch.Proc(tag, i, argv, env, os.path.join(log_dir, f"rank{i}.log")))
    return out


class TestbedBackend(Backend):
  """Builds a testbed for the machine (racks = L1 switches, hosts = nodes) unless given an existing one."""
  name = "testbed"

  def __init__(self, machine: mm.Machine, testbed_id: str | None = None, say=print):
    self.machine = machine
    self.testbed_id = testbed_id
    self.bed: tbm.Testbed | None = None
    self._owned = False
    self._say = say

  def open(self):
    if self.bed is not None:
      return
    m = self.machine
    if m.layout:
      raise BackendError("the testbed backend builds its own network: a node map describes a real allocation")
    racks = len(m.l1s())
    if self.testbed_id:
      bed = tbm.Testbed.load(tbm.state_path_for(self.testbed_id))
      bed.check_alive()
      if bed.hosts < m.nodes:
        raise BackendError(f"testbed {self.testbed_id} has {bed.hosts} hosts, the machine needs {m.nodes}")
      if any(bed.rack_of(n) != m.l1_of(n) for n in range(m.nodes)):
        raise BackendError(f"testbed {self.testbed_id}'s racks ({bed.racks}) do not match the machine's L1 "
                           f"switches ({racks} of {m.nodes_per_l1} nodes)")
      self.bed = bed
      return
    problem = tbm.permission_problem()
    if problem:
      raise BackendError(problem)
    try:
      bed = tbm.Testbed.new(hosts=m.nodes, racks=racks, host_rate=rates.parse_rate(m.host_rate),
                            uplink_rate=rates.parse_rate(m.uplink_rate) if racks > 1 else None, queue=m.queue,
                            faults=m.faults)
    except ValueError as e:
      raise BackendError(str(e)) from None
    self.bed = bed
    self._owned = True
    bed.up()
    self._say(bed.describe())

  def close(self):
    if self.bed is not None and self._owned:
      self.bed.down()
      self._say(f"removed testbed {self.bed.prefix}")
    self.bed = None

  def procs(self, job, command, tag, log_dir):
    assert self.bed is not None, "open() first"
    os.makedirs(log_dir, exist_ok=True)
    return testbed_jobs.job_procs(self.bed, rank_nodes(job), command, tag, log_dir, passthrough=False)

  def describe(self):
    return self.bed.describe() if self.bed else "testbed (not built)"


def allocation_hosts() -> list[str]:
  """The current SLURM allocation's host names, in order (`scontrol show hostnames`)."""
  nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
  if not nodelist:
    raise BackendError("the slurm backend runs inside an allocation (sbatch/salloc): SLURM_JOB_NODELIST is unset")
  try:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
  except (OSError, subprocess.CalledProcessError) as e:
    raise BackendError(f"cannot expand SLURM_JOB_NODELIST with scontrol: {e}") from None
  return out.stdout.split()


def coordinator_ports() -> tuple[int, int]:
  """[low, high) for a step's coordinator port: below the kernel's ephemeral range (srun's own I/O sockets
  and every outgoing connection take ports from it, so a port drawn there can be taken on the step's first
  host), from 10000 up; the remote host can't be probed before the step runs."""
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="utf-8") as f:
      low = int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    low = 32768
  return (10000, low) if low > 11000 else (20000, 60000)


class SlurmBackend(Backend):
  name = "slurm"

  def __init__(self, machine: mm.Machine, srun_args: Sequence[str] = (), gpu_flag: str = "--gres=gpu:{n}",
               hosts: Sequence[str] | None = None, python: str = sys.executable):
    self.machine = machine
    self.srun_args = list(srun_args)
    self.gpu_flag = gpu_flag
    self._hosts = list(hosts) if hosts is not None else None
    self.python = python

  def open(self):
    if self._hosts is None:
      m = self.machine
      self._hosts = [m.hostname(n) for n in range(m.nodes)] if m.layout else allocation_hosts()
    if len(self._hosts) < self.machine.nodes:
      raise BackendError(f"the allocation has {len(self._hosts)} nodes, the plan's machine {self.machine.nodes}")

  def srun_argv(self, job: dict, command: Sequence[str], tag: str, port: int) -> list[str]:
    hosts = [self._hosts[n] for n in job["nodes"]]
    per = job["ranks_per_node"]
    argv = ["srun", "--exact", f"--nodes={len(hosts)}", f"--ntasks={job['gpus']}", f"--ntasks-per-node={per}",
            f"--nodelist={','.join(hosts)}", "--kill-on-bad-exit=1", f"--job-name={tag}"]
    if self.gpu_flag:
      argv.append(self.gpu_flag.format(n=per))
    return argv + self.srun_args + list(command) + ["--distributed", f"--coordinator_address={hosts[0]}:{port}"]

  def procs(self, job, command, tag, log_dir):
    if self._hosts is None:
      self.open()
    os.makedirs(log_dir, exist_ok=True)
    port = random.Random(f"{tag}-{os.getpid()}").randrange(*coordinator_ports())
    argv = self.srun_argv(job, command, tag, port)
    env = launch.with_repo_on_path(dict(os.environ, PYTHONUNBUFFERED="1"))
    return [launch.Proc(tag, 0, argv, env, os.path.join(log_dir, "srun.log"))]

  def describe(self):
    return f"slurm ({len(self._hosts or [])} allocated nodes)"


def make(name: str, machine: mm.Machine, *, testbed_id: str | None = None, srun_args: str = "",
         gpu_flag: str = "--gres=gpu:{n}", say=print) -> Backend:
  if name == "local":
    return LocalBackend()
  if name == "testbed":
    return TestbedBackend(machine, testbed_id, say)
  if name == "slurm":
    return SlurmBackend(machine, shlex.split(srun_args), gpu_flag)
  raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
