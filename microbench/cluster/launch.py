"""Runs the processes of one or more distributed jobs and stops them all when one fails.

Shared by `microbench-launch` (every process on this host) and `microbench-testbed` (each process inside
an emulated host). A multi-process JAX job whose rank dies leaves the others blocked in
a collective or the coordinator until their own timeouts fire, so the runner watches every rank and, at
the first failure, names it, shows its log tail and stops the rest (SIGTERM to the whole process group,
SIGKILL after a grace period). Every process's output goes to its own log file; rank 0's is also passed
through so an interactive run looks like a single-process one.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

ENV_COORDINATOR = "MICROBENCH_COORDINATOR"
ENV_NUM_PROCESSES = "MICROBENCH_NUM_PROCESSES"
ENV_PROCESS_ID = "MICROBENCH_PROCESS_ID"
ENV_HOSTNAME = "MICROBENCH_HOSTNAME"
ENV_JOB = "MICROBENCH_JOB"
ENV_NUM_CPU_DEVICES = "JAX_NUM_CPU_DEVICES"

EXIT_TIMEOUT = 124
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # microbench/cluster/ -> root


class Interrupted(Exception):
  """Raised in the main thread on SIGINT/SIGTERM/SIGHUP so cleanup code runs."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def install_signal_handlers() -> None:
  """Turns SIGINT, SIGTERM and SIGHUP into `Interrupted`, so `finally` blocks stop children and clean up."""

  def handler(signum: int, frame: object) -> None:
    del frame
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      signal.signal(sig, signal.SIG_IGN)  # One interruption is enough: let the cleanup finish.
    raise Interrupted(signum)

  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, handler)


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free on `host` a moment ago (the coordinator binds it shortly after)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def distributed_flags(coordinator: str, num_processes: int, process_id: int) -> list[str]:
  """The flags appended to each process's command line (see microbench.cli.cluster_flags)."""
  return ["--distributed", f"--coordinator_address={coordinator}", f"--num_processes={num_processes}",
          f"--process_id={process_id}"]


def distributed_env(coordinator: str, num_processes: int, process_id: int, devices: int,
                    hostname: str | None, job: str | None = None) -> dict[str, str]:
  """The environment each process gets, for commands that read it instead of flags."""
  env = {
      ENV_COORDINATOR: coordinator,
      ENV_NUM_PROCESSES: str(num_processes),
      ENV_PROCESS_ID: str(process_id),
      ENV_NUM_CPU_DEVICES: str(devices),
      "PYTHONUNBUFFERED": "1",
  }
  if hostname:
    env[ENV_HOSTNAME] = hostname
  if job is not None:
    env[ENV_JOB] = job
  return env


def with_repo_on_path(env: dict[str, str]) -> dict[str, str]:
  """Puts the repository root first on PYTHONPATH so `python -m microbench` works from any directory."""
  parts = [REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != REPO_ROOT]
  env["PYTHONPATH"] = os.pathsep.join(parts)
  return env


def rank_env(coordinator: str, num_processes: int, process_id: int, devices: int, hostname: str | None,
             job: str | None = None) -> dict[str, str]:
  """This process's environment for one rank of a job: its distributed settings, the checkout on PYTHONPATH."""
  return with_repo_on_path(dict(os.environ, **distributed_env(coordinator, num_processes, process_id, devices,
                                                              hostname, job)))


@dataclasses.dataclass
class Proc:
  """One process of a job: what to run, where its log goes, and (once started) its state."""
  job: str
  rank: int
  argv: list[str]
  env: dict[str, str]
  log_path: str
  passthrough: bool = False
  prefix: str = ""
  popen: subprocess.Popen | None = None
  returncode: int | None = None  # Set by the waiter thread, together with exit_time.
  exit_time: float = 0.0
  stopped_by_us: bool = False
  threads: list[threading.Thread] = dataclasses.field(default_factory=list)

  @property
  def name(self) -> str:
    return f"rank {self.rank}" if not self.job else f"job {self.job} rank {self.rank}"


@dataclasses.dataclass
class JobResult:
  """How one job ended: `failed_rank` is the first rank seen exiting non-zero (None if all succeeded)."""
  job: str
  returncode: int
  failed_rank: int | None = None
  failed_code: int | None = None
  reason: str = ""
  seconds: float = 0.0


def _pump(src: IO[bytes], log: IO[bytes], lock: threading.Lock, out: IO[bytes] | None, prefix: bytes) -> None:
  """Copies a child's pipe into its log file and, for passed-through ranks, to our own stdout/stderr."""
  for line in iter(src.readline, b""):
    with lock:
      log.write(line)
      log.flush()
    if out is not None:
      try:
        out.write(prefix + line)
        out.flush()
      except (BrokenPipeError, ValueError):
        out = None
  src.close()


def _wait(proc: Proc) -> None:
  """Records when the rank exited: the first rank to die is the one to blame, not its peers that
  noticed a moment later (a few ms apart, so polling could not tell them apart)."""
  code = proc.popen.wait()
  proc.exit_time = time.monotonic()
  proc.returncode = code


def start(proc: Proc) -> None:
  """Starts one process in its own session (process group), its output into its log (and, for passed-through
  ranks, also to ours); a waiter thread records its exit code and time."""
  log = open(proc.log_path, "ab", buffering=0)  # pylint: disable=consider-using-with
  env = dict(os.environ)
  env.update(proc.env)
  if proc.passthrough:
    proc.popen = subprocess.Popen(proc.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True)
    lock = threading.Lock()
    prefix = proc.prefix.encode()
    for src, out in ((proc.popen.stdout, sys.stdout.buffer), (proc.popen.stderr, sys.stderr.buffer)):
      t = threading.Thread(target=_pump, args=(src, log, lock, out, prefix), daemon=True)
      t.start()
      proc.threads.append(t)
  else:
    # Own session => own process group, so stopping a rank also stops whatever it spawned.
    proc.popen = subprocess.Popen(proc.argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
  threading.Thread(target=_wait, args=(proc,), daemon=True).start()


def signal_group(proc: Proc, sig: int) -> None:
  """Sends `sig` to the process group of a started proc (itself and what it spawned); gone groups are ignored."""
  if proc.popen is None:
    return
  try:
    os.killpg(proc.popen.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


def stop(procs: Sequence[Proc], grace: float) -> None:
  """SIGTERM to the process group of every live proc, SIGKILL to what is left after `grace` seconds."""
  live = [p for p in procs if p.popen is not None and p.popen.poll() is None]
  for p in live:
    p.stopped_by_us = True
    signal_group(p, signal.SIGTERM)
  deadline = time.monotonic() + grace
  while time.monotonic() < deadline and any(p.popen.poll() is None for p in live):
    time.sleep(0.05)
  for p in procs:
    # Kill the whole group even if its leader exited: grandchildren may linger.
    if p.popen is not None:
      signal_group(p, signal.SIGKILL)
  for p in live:
    try:
      p.popen.wait(timeout=5)
    except subprocess.TimeoutExpired:
      pass
  for p in procs:
    if p.popen is not None and p.returncode is None:
      p.returncode = p.popen.poll()
      p.exit_time = p.exit_time or time.monotonic()
    for t in p.threads:
      t.join(timeout=2)


def tail(path: str, lines: int = 20) -> str:
  """The last `lines` lines of a log file, for failure reports."""
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - 64 * 1024))
      text = f.read().decode(errors="replace")
  except OSError as e:
    return f"(cannot read {path}: {e})"
  return "\n".join(text.splitlines()[-lines:])


def describe_code(code: int) -> str:
  if code < 0:
    try:
      return f"signal {signal.Signals(-code).name}"
    except ValueError:
      return f"signal {-code}"
  return f"exit code {code}"


def launcher_code(code: int) -> int:
  """The launcher's own exit status for a rank that ended with `code` (never 0)."""
  if code < 0:
    return 128 - code
  return code if code > 0 else 1


def run_jobs(jobs: dict[str, list[Proc]], *, timeout: float | None = None, grace: float = 2.0,
             say: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
             tail_lines: int = 20, poll: float = 0.05) -> dict[str, JobResult]:
  """Starts every proc, waits, and returns each job's result.

  A job succeeds when all its ranks exit 0. When one rank exits non-zero, the job's other ranks are
  stopped (jobs are independent: other jobs go on). `timeout` bounds the whole call; SIGINT/SIGTERM
  (as `Interrupted`, see install_signal_handlers) stops everything and is re-raised after cleanup.
  """
  t0 = time.monotonic()
  results: dict[str, JobResult] = {}
  all_procs = [p for procs in jobs.values() for p in procs]
  try:
    for p in all_procs:
      start(p)
    while len(results) < len(jobs):
      for job, procs in jobs.items():
        if job in results:
          continue
        failed = sorted((p for p in procs if p.returncode not in (None, 0)), key=lambda p: p.exit_time)
        if failed:
          first = failed[0]
          others = [p for p in procs if p.returncode is None]
          say(f"{first.name} failed with {describe_code(first.returncode)}; stopping {len(others)} other "
              f"rank(s). Log: {first.log_path}")
          time.sleep(0.2)  # Let the pump threads flush the failing rank's last lines.
          say(f"---- last lines of {first.log_path} ----\n{tail(first.log_path, tail_lines)}\n----")
          stop(procs, grace)
          results[job] = JobResult(job, launcher_code(first.returncode), first.rank, first.returncode,
                                   f"{first.name} failed with {describe_code(first.returncode)}",
                                   time.monotonic() - t0)
        elif all(p.returncode == 0 for p in procs):
          for p in procs:
            for t in p.threads:
              t.join(timeout=5)
          results[job] = JobResult(job, 0, seconds=time.monotonic() - t0)
      if len(results) == len(jobs):
        break
      if timeout and time.monotonic() - t0 > timeout:
        pending = [j for j in jobs if j not in results]
        named = [j for j in pending if j]
        say(f"timeout after {timeout:g} s; stopping " + (f"job(s) {', '.join(named)}" if named else "all ranks"))
        for job in pending:
          stop(jobs[job], grace)
          alive = [p.rank for p in jobs[job] if p.stopped_by_us]
          results[job] = JobResult(job, EXIT_TIMEOUT, reason=f"timeout after {timeout:g} s (ranks still "
                                   f"running: {alive})", seconds=time.monotonic() - t0)
        break
      time.sleep(poll)
  except BaseException:
    # Interrupted, KeyboardInterrupt or a bug: never leave ranks behind.
    stop(all_procs, grace)
    raise
  return results


def local_job(command: Sequence[str], num_processes: int, devices_per_process: int, log_dir: str,
              coordinator: str, processes_per_host: int = 0, pass_flags: bool = True) -> list[Proc]:
  """The processes of one job on this host: rank I gets the distributed flags and environment, and with
  `processes_per_host` > 0 each group of that many ranks reports host name host0, host1, ..."""
  procs = []
  for i in range(num_processes):
    host = f"host{i // processes_per_host}" if processes_per_host else socket.gethostname()
    argv = list(command) + (distributed_flags(coordinator, num_processes, i) if pass_flags else [])
    env = rank_env(coordinator, num_processes, i, devices_per_process, host)
    procs.append(Proc("", i, argv, env, os.path.join(log_dir, f"rank{i}.log"), passthrough=(i == 0)))
  return procs
