"""A real SLURM on the emulated cluster: munged, a slurmctld, and one slurmd per testbed host.

Each testbed host (a network namespace) runs its own `slurmd -N <host>`, listening on the host's address, so
SLURM's steps, srun's I/O and the jobs' traffic all cross the testbed's shaped links; the controller runs in
host 0's namespace (a head node that is also a compute node). Daemons share one private configuration in a
work folder (slurm.conf, topology.conf with one switch per rack under a core switch, gres.conf with fake GPU
files), run as root in the foreground as children of this process, without cgroups (proctrack/linuxproc,
task/none), and are killed by process id in `down`; removing the testbed afterwards kills whatever their
steps left in the namespaces. munged runs in host 0's namespace too (its socket is a file, reachable from every
namespace), so after a crash `microbench-testbed down` removes every daemon with the namespaces.

SLURM's clients (sbatch, srun, salloc, sinfo) must run inside a host's namespace, where the controller's
address is reachable: `exec_argv` wraps a command, `env` points it at the configuration (SLURM_CONF).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

from microbench.cluster import testbed as tbm

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "salloc", "sinfo", "scontrol", "squeue", "scancel")
PARTITION = "testbed"


class SlurmTestbedError(Exception):
  """A one-line reason why SLURM could not be started on the testbed."""


def missing_parts() -> str | None:
  """What is missing to run SLURM on the testbed (Debian: `apt-get install slurm-wlm munge`), or None."""
  missing = [t for t in DAEMONS + CLIENTS if shutil.which(t) is None and not os.path.exists(f"/usr/sbin/{t}")]
  if missing:
    return f"SLURM's {', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge)"
  if shutil.which("unshare") is None:
    return "`unshare` (util-linux) not found on PATH"
  return tbm.permission_problem()


def _daemon(name: str) -> str:
  return shutil.which(name) or f"/usr/sbin/{name}"


def slurm_conf(bed: tbm.Testbed, work: str, ctld_port: int, slurmd_port: int, cpus: int, gpus: int,
               slurmd_timeout: int = 30) -> str:
  """slurm.conf for the testbed: node i is host i's namespace name at its testbed address. A node whose slurmd
  does not answer for slurmd_timeout seconds is set DOWN and its batch jobs are requeued (JobRequeue=1)."""
  ctl = bed.host_name(0)
  lines = [
      f"ClusterName={bed.prefix}",
      f"SlurmctldHost={ctl}({bed.addr(0)})", "MailProg=/bin/true",
      "SlurmUser=root", "SlurmdUser=root",
      f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}",
      "AuthType=auth/munge", "CredType=cred/munge",
      # cred_expire also delays a requeued batch job's restart (default 120 s)
      f"AuthInfo=socket={os.path.join(work, 'munge.socket')},cred_expire=20",
      f"StateSaveLocation={os.path.join(work, 'state')}",
      f"SlurmdSpoolDir={os.path.join(work, 'spool', '%n')}",
      f"SlurmctldPidFile={os.path.join(work, 'slurmctld.pid')}",
      f"SlurmdPidFile={os.path.join(work, 'spool', '%n', 'slurmd.pid')}",
      f"SlurmctldLogFile={os.path.join(work, 'log', 'slurmctld.log')}",
      f"SlurmdLogFile={os.path.join(work, 'log', 'slurmd-%n.log')}",
      "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
      "AccountingStorageType=accounting_storage/none", "MpiDefault=none",
      "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "TopologyPlugin=topology/tree",
      "SchedulerType=sched/backfill", "JobRequeue=1", "SchedulerParameters=sched_interval=1",
      "SlurmdParameters=config_overrides",  # CPUs as configured, not as this machine has
      "ReturnToService=2", "SlurmctldTimeout=30", f"SlurmdTimeout={slurmd_timeout}", "InactiveLimit=0",
      "MinJobAge=30", "KillWait=5", "MessageTimeout=20", "UnkillableStepTimeout=30",
      "GresTypes=gpu" if gpus else "",
  ]
  gres = f" Gres=gpu:{gpus}" if gpus else ""
  for i in range(bed.hosts):
    lines.append(f"NodeName={bed.host_name(i)} NodeAddr={bed.addr(i)} CPUs={cpus} RealMemory=1000{gres} "
                 "State=UNKNOWN")
  names = [bed.host_name(i) for i in range(bed.hosts)]
  lines.append(f"PartitionName={PARTITION} Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP")
  return "\n".join(line for line in lines if line) + "\n"


def topology_conf(bed: tbm.Testbed) -> str:
  """topology/tree: one leaf switch per rack; with several racks, a core switch above them."""
  racks: dict[int, list[str]] = {}
  for i in range(bed.hosts):
    racks.setdefault(bed.rack_of(i), []).append(bed.host_name(i))
  lines = [f"SwitchName=rack{r} Nodes={','.join(nodes)}" for r, nodes in sorted(racks.items())]
  if len(racks) > 1:
    lines.append(f"SwitchName=core Switches={','.join(f'rack{r}' for r in sorted(racks))}")
  return "\n".join(lines) + "\n"


class SlurmTestbed:
  """SLURM over a built testbed; `up()` starts it and waits until every node is idle, `down()` stops it.

  `cpus` and `gpus` are what each node declares (the GPUs are empty files: GRES bookkeeping only)."""

  def __init__(self, bed: tbm.Testbed, work: str, *, cpus: int = 8, gpus: int = 8, slurmd_timeout: int = 30):
    self.bed = bed
    self.slurmd_timeout = slurmd_timeout
    self.work = os.path.abspath(work)
    self.cpus = cpus
    self.gpus = gpus
    self.conf = os.path.join(self.work, "slurm.conf")
    self._procs: list[subprocess.Popen] = []
    self._logs: dict[int, str] = {}  # pid -> the daemon's stdout/stderr file
    self._slurmd: dict[int, subprocess.Popen] = {}

  def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for SLURM's clients: base (default os.environ) with SLURM_CONF and no inherited job."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = self.conf
    return env

  def exec_argv(self, argv: Sequence[str], host: int = 0) -> list[str]:
    """A command run inside host `host`'s namespace (where the controller is reachable)."""
    return self.bed.exec_argv(host, list(argv))

  def daemon_argv(self, argv: Sequence[str], host: int) -> list[str]:
    """A daemon run inside host `host`'s namespace under the host's name (its own UTS namespace), so that
    slurmctld finds itself in SlurmctldHost and each step's processes see their node's host name."""
    return self.exec_argv(["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.bed.host_name(host),
                           *argv], host)

  def run(self, argv: Sequence[str], host: int = 0, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("env", self.env())
    return subprocess.run(self.exec_argv(argv, host), capture_output=True, text=True, timeout=timeout,
                          check=False, **kwargs)

  # Life cycle.
  def _write_config(self) -> None:
    for sub in ("state", "log", "dev") + tuple(os.path.join("spool", self.bed.host_name(i))
                                               for i in range(self.bed.hosts)):
      os.makedirs(os.path.join(self.work, sub), exist_ok=True)
    ctld_port = self.bed.free_port(0)
    slurmd_port = self.bed.free_port(0)
    while slurmd_port == ctld_port:
      slurmd_port = self.bed.free_port(0)
    with open(self.conf, "w", encoding="ascii") as f:
      f.write(slurm_conf(self.bed, self.work, ctld_port, slurmd_port, self.cpus, self.gpus, self.slurmd_timeout))
    with open(os.path.join(self.work, "topology.conf"), "w", encoding="ascii") as f:
      f.write(topology_conf(self.bed))
    with open(os.path.join(self.work, "gres.conf"), "w", encoding="ascii") as f:
      if self.gpus:
        for g in range(self.gpus):
          open(os.path.join(self.work, "dev", f"gpu{g}"), "a", encoding="ascii").close()
        f.write(f"Name=gpu File={os.path.join(self.work, 'dev', 'gpu')}[0-{self.gpus - 1}]\n")
    with open(os.path.join(self.work, "cgroup.conf"), "w", encoding="ascii") as f:
      # slurmd 22.05 loads a cgroup plugin even when no other plugin uses it, and `ip netns exec` mounts a
      # fresh /sys without cgroups, where autodetection fails; v1 named explicitly loads without a mount.
      f.write("CgroupPlugin=cgroup/v1\n")
    key = os.path.join(self.work, "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400), "wb") as f:
      f.write(os.urandom(1024))

  def _start(self, argv: list[str], log: str) -> subprocess.Popen:
    path = os.path.join(self.work, "log", log)
    with open(path, "ab") as out:
      proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                              env=self.env(), start_new_session=True)
    self._procs.append(proc)
    self._logs[proc.pid] = path
    return proc

  def up(self, timeout: float = 60) -> None:
    """Starts munged, slurmctld and the slurmds; on any error stops what it started and raises."""
    problem = missing_parts()
    if problem:
      raise SlurmTestbedError(problem)
    self.bed.check_alive()
    try:
      self._write_config()
      w = self.work
      self._start(self.exec_argv([_daemon("munged"), "--foreground", "--force", f"--socket={w}/munge.socket",
                                  f"--key-file={w}/munge.key", f"--pid-file={w}/munged.pid",
                                  f"--log-file={w}/log/munged.log", f"--seed-file={w}/munged.seed"]), "munged.out")
      self._wait(lambda: os.path.exists(f"{w}/munge.socket"), timeout, "munged did not create its socket")
      self._start(self.daemon_argv([_daemon("slurmctld"), "-D", "-i", "-f", self.conf], 0), "slurmctld.out")
      for i in range(self.bed.hosts):
        self._start_slurmd(i)
      self._wait(self._all_idle, timeout, "the nodes did not come up idle")
    except BaseException:
      self.down()
      raise

  def _start_slurmd(self, host: int) -> None:
    name = self.bed.host_name(host)
    self._slurmd[host] = self._start(self.daemon_argv([_daemon("slurmd"), "-D", "-N", name, "-f", self.conf], host),
                                     f"slurmd-{name}.out")

  def _wait(self, ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
      dead = next((p for p in self._procs if p.poll() is not None), None)
      if dead is not None:
        name = next((os.path.basename(a) for a in dead.args if os.path.basename(a) in DAEMONS), "a daemon")
        try:
          with open(self._logs[dead.pid], encoding="utf-8", errors="replace") as f:
            last = (f.read().strip().splitlines() or [""])[-1]
        except OSError:
          last = ""
        raise SlurmTestbedError(f"{name} exited with {dead.returncode}{': ' + last if last else ''} "
                                f"(logs in {self.work}/log)")
      if time.monotonic() > deadline:
        raise SlurmTestbedError(f"{what} within {timeout:.0f} s; logs in {self.work}/log")
      time.sleep(0.25)

  def node_states(self) -> dict[str, str]:
    r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
    return dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2) if r.returncode == 0 else {}

  def _all_idle(self) -> bool:
    states = self.node_states()
    return len(states) == self.bed.hosts and all(s == "idle" for s in states.values())

  def job_state(self, job_id: str) -> tuple[str, str]:
    """(JobState, ExitCode) of a job, e.g. ('COMPLETED', '0:0'); ('', '') once SLURM forgot it."""
    r = self.run(["scontrol", "-o", "show", "job", job_id], timeout=30)
    fields = dict(f.split("=", 1) for f in r.stdout.split() if "=" in f) if r.returncode == 0 else {}
    return fields.get("JobState", ""), fields.get("ExitCode", "")

  def submit(self, args: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
             host: int = 0) -> str:
    """Submits `sbatch ARGS` from host `host` (env: the job's environment, default os.environ); the job id."""
    r = self.run(["sbatch", "--parsable", *args], host=host, cwd=cwd, env=self.env(env), timeout=60)
    if r.returncode != 0:
      raise SlurmTestbedError(f"sbatch failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout.strip().split(";")[0]

  def sbatch(self, args: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
             timeout: float = 300, host: int = 0) -> tuple[str, str, str]:
    """Submits `sbatch ARGS` and waits for the job to end: (job id, state, exit code)."""
    job_id = self.submit(args, cwd=cwd, env=env, host=host)
    return (job_id,) + self.wait(job_id, timeout)

  def wait(self, job_id: str, timeout: float = 300) -> tuple[str, str]:
    """Waits for a job to end: (state, exit code). Polls scontrol twice a second (`sbatch --wait` polls every
    few seconds); cancels the job on a timeout."""
    deadline = time.monotonic() + timeout
    while True:
      state, code = self.job_state(job_id)
      if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
        return state, code
      if time.monotonic() > deadline:
        self.run(["scancel", job_id])
        raise SlurmTestbedError(f"job {job_id} still {state or 'unknown'} after {timeout:.0f} s; cancelled")
      time.sleep(0.5)

  def fail_node(self, host: int) -> None:
    """Host `host` fails: its slurmd and every process in its namespace (steps, tasks) are SIGKILLed."""
    if host == 0:
      raise ValueError("host 0 runs the controller; fail another host")
    proc = self._slurmd.pop(host, None)
    if proc is not None:
      if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
      self._procs.remove(proc)
    pids = subprocess.run(["ip", "netns", "pids", self.bed.host_ns(host)], capture_output=True, text=True,
                          check=False).stdout.split()
    for pid in pids:
      try:
        os.kill(int(pid), signal.SIGKILL)
      except (ProcessLookupError, ValueError):
        pass  # already gone

  def restore_node(self, host: int, timeout: float = 60) -> None:
    """Starts host `host`'s slurmd again and waits until SLURM has it back (ReturnToService=2)."""
    name = self.bed.host_name(host)
    self._start_slurmd(host)
    self._wait(lambda: self.node_states().get(name) in ("idle", "mix", "alloc"), timeout, f"{name} did not return")

  def daemon_pids(self) -> list[int]:
    """Process ids of the daemons started and not stopped by this object."""
    return [p.pid for p in self._procs]

  def down(self) -> None:
    """Stops every daemon this object started (SIGTERM, SIGKILL after 5 s), in reverse order."""
    for proc in reversed(self._procs):
      if proc.poll() is None:
        try:
          os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
          pass
    deadline = time.monotonic() + 5
    for proc in reversed(self._procs):
      try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    self._procs.clear()
    self._slurmd.clear()

  def __enter__(self) -> SlurmTestbed:
    self.up()
    return self

  def __exit__(self, *exc) -> None:
    self.down()
