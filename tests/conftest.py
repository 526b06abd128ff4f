"""Shared test set-up: 8 virtual CPU devices for in-process tests, and helpers to run the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

# Must happen before JAX's backend starts: every in-process test sees 8 CPU devices.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

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
                        timeout=timeout, env=clean_env(**env), cwd=ROOT)


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
  import signal
  import time
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


def netns_problem() -> str | None:
  """Why the emulated cluster (network namespaces) cannot run here, or None."""
  from microbench.cluster import testbed as tbm  # pylint: disable=g-import-not-at-top
  if not sys.platform.startswith("linux"):
    return "network namespaces need Linux"
  return tbm.permission_problem() or (None if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode
                                      == 0 else "`ip netns` does not work here")


# ------------------------------------------------------------------------------------------- test groups
# README's `python -m pytest -q tests` runs the fast suite: every layer, in minutes on two cores. The rest is
# behind markers (pyproject.toml deselects them by default; `.ci/run` runs them all):
#   cluster      needs root and Debian's slurm-wlm / munge / Open MPI: the emulated cluster, SLURM, mpirun.
#                Derived from the test's own skip condition, so a new test of that kind is marked by itself.
#   gpu_compile  needs the gpu-compile extra (XLA:GPU through JAX's CUDA plugin); always slow too.
#   slow         end-to-end runs, multi-process launches, exhaustive property tests, GPU-target compiles:
#                the node ids below (a file, a test, or a test's parameter prefix), chosen from --durations.
SLOW = (
)
_CLUSTER_REASONS = ("emulated cluster", "testbed cannot run", "SLURM", "mpirun", "needs root")
_PLUGIN_REASONS = ("CUDA PJRT plugin",)


def _skip_reasons(item) -> str:
  return " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    reasons = _skip_reasons(item)
    if any(r in reasons for r in _CLUSTER_REASONS):
      item.add_marker(pytest.mark.cluster)
    if any(r in reasons for r in _PLUGIN_REASONS) or "gpu_mesh" in getattr(item, "fixturenames", ()):
      item.add_marker(pytest.mark.gpu_compile)
      item.add_marker(pytest.mark.slow)
    if item.nodeid.startswith(SLOW):
      item.add_marker(pytest.mark.slow)


def pytest_report_header(config):
  expr = config.getoption("markexpr")
  if expr == "not slow and not cluster":
    return ("fast suite: tests marked slow or cluster are deselected; -m 'slow or cluster' runs them,"
            " -m '' runs everything")
  return None


def pytest_addoption(parser):
  parser.addoption("--update-golden", action="store_true", default=False,
                   help="rewrite tests/golden/*.json from this run instead of comparing with them")


@pytest.fixture(scope="session")
def update_golden(request) -> bool:
  """True when the golden files should be regenerated (`--update-golden` or MICROBENCH_UPDATE_GOLDEN=1)."""
  return bool(request.config.getoption("--update-golden") or os.environ.get("MICROBENCH_UPDATE_GOLDEN"))


@pytest.fixture(scope="session")
def parsed_flags():
  """absl flags parsed with defaults, for in-process calls into code that reads FLAGS."""
  from absl import flags
  import microbench.cli.bench  # noqa: F401  (defines the flags)
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["pytest"])
  return flags.FLAGS
