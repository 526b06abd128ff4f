"""Helpers the test files share: child processes of the CLI and of multi-process jobs, and the probes that say why
the emulated cluster cannot run here. Test files import it (`from support import ...`); conftest.py holds only
fixtures and hooks."""

from __future__ import annotations

import fcntl
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env(**extra: str) -> dict[str, str]:
  """The environment for a child process: no inherited device-count choices unless given."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.update(extra)
  return env


def doubling(args: list[str]) -> list[str]:
  """The tests' size ranges were chosen for nccl-tests' doubling (`-f 2`); the sweep's default factor (4) is
  the newcomer's quick run. Added unless a test sets the factor itself."""
  return args if any(a.startswith("--step_factor") for a in args) else [*args, "--step_factor=2"]


def run_cli(args: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
  """Runs `python -m microbench ARGS` and returns the finished process (text output)."""
  return subprocess.run([sys.executable, "-m", "microbench", *doubling(args)], capture_output=True, text=True,
                        timeout=timeout, env=clean_env(**env), cwd=ROOT, check=False)


def start_job(args: list[str], num_processes: int, devices_per_process: int = 1,
              hosts: list[str] | None = None, module: str = "microbench") -> list[subprocess.Popen]:
  """Starts a job of several local processes (gloo) of `python -m MODULE`, without any launcher script."""
  from microbench.cluster.launch import free_port  # pylint: disable=g-import-not-at-top
  port = free_port()
  procs = []
  for i in range(num_processes):
    env = clean_env(JAX_NUM_CPU_DEVICES=str(devices_per_process))
    if hosts:
      env["MICROBENCH_HOSTNAME"] = hosts[i]
    cmd = [sys.executable, "-m", module, *(doubling(args) if module == "microbench" else args), "--distributed",
           f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}", f"--process_id={i}"]
    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                  cwd=ROOT))
  return procs


def finish_job(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str, str]]:
  """Waits for every process of a job: (returncode, stdout, stderr) each; on a timeout all are killed."""
  results = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    results.append((p.returncode, out, err))
  return results


def interrupt_when_ready(proc: subprocess.Popen, ready, timeout: float = 60) -> str:
  """Waits until `ready()` holds while `proc` runs, sends SIGINT, and returns its stderr."""
  try:
    deadline = time.monotonic() + timeout
    while not ready():
      assert time.monotonic() < deadline and proc.poll() is None, "job did not start"
      time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  return err


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
  """Folder `name`, made by `make(folder)` once per test session however many pytest-xdist workers need it (a
  module fixture runs once per worker: a tuning module's sweep ran twice, 40 s each, in the fast suite). The
  first worker to ask makes it under a lock while the others wait; a failed `make` leaves no done-marker, so the
  next worker clears what it left, tries again and fails with its own message."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # the workers' base folders sit side by side in one session folder
  folder, done = root / name, root / f"{name}.done"
  with open(root / f"{name}.lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      if folder.exists():
        shutil.rmtree(folder)
      make(folder)
      done.touch()
  return folder


# ------------------------------------------------------------------------------------------- the emulated cluster
# The probes build (and remove) a namespace, so they run once, when the first test that needs them is set up
# (conftest's needs_netns / needs_slurm fixtures), never when a test file is imported or collected.
@functools.cache
def _netns_add_problem() -> str | None:
  """Why `ip netns add` fails here (a container may grant the capabilities but not the mount), or None."""
  name = f"tbprobe{secrets.token_hex(2)}-sw"
  r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, check=False)
  if r.returncode != 0:
    return f"`ip netns add` not permitted here: {r.stderr.strip()}"
  subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
  return None


@functools.cache
def netns_problem() -> str | None:
  """Why the emulated cluster (microbench.cluster.testbed's network namespaces) cannot run here, or None."""
  if not sys.platform.startswith("linux"):
    return "network namespaces need Linux"
  from microbench.cluster import testbed as tbm  # pylint: disable=g-import-not-at-top
  return tbm.permission_problem() or _netns_add_problem()


@functools.cache
def slurm_problem() -> str | None:
  """Why a real SLURM on the emulated cluster (microbench.cluster.slurm_testbed) cannot run here, or None."""
  if not sys.platform.startswith("linux"):
    return "network namespaces need Linux"
  from microbench.cluster import slurm_testbed as stb  # pylint: disable=g-import-not-at-top
  return stb.missing_parts() or _netns_add_problem()
