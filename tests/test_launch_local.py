"""microbench-launch: correct multi-process results, and no rank left behind on failure,
timeout or Ctrl-C (a hung multi-host job is the failure users hit most)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from support import interrupt_when_ready

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = ["-m", "microbench.cli.launch"]  # the microbench-launch console script
JOB = os.path.join(REPO, "tests", "_psum_job.py")


def launch(args: list[str], job_args: list[str] = (), timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *LAUNCHER, *args, "--", sys.executable, JOB, *job_args],
                        capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False)


def read(path: str | os.PathLike) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def pids(pid_dir: str) -> dict[int, int]:
  return {int(os.path.basename(p)[4:-4]): int(read(p)) for p in glob.glob(os.path.join(pid_dir, "rank*.pid"))}


def alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:  # A zombie is dead for our purposes.
    return read(f"/proc/{pid}/stat").split(") ")[1][0] != "Z"
  except (OSError, IndexError):
    return False


def assert_all_dead(pid_dir: str, expected: int) -> None:
  found = pids(pid_dir)
  assert len(found) == expected, found
  assert not [r for r, p in found.items() if alive(p)], f"ranks still running: {found}"


def test_two_processes_two_devices(tmp_path):
  r = launch(["--num_processes=2", "--devices_per_process=2", f"--log_dir={tmp_path}"])
  assert r.returncode == 0, r.stderr[-3000:]
  assert "RESULT rank=0 processes=2 devices=4 psum=6.0 expected=6.0 OK" in r.stdout  # rank 0 passes through
  assert "RESULT rank=1 processes=2 devices=4 psum=6.0 expected=6.0 OK" in read(tmp_path / "rank1.log")
  assert "RESULT rank=1" not in r.stdout  # other ranks only go to their logs
  assert f"logs in {tmp_path}" in r.stderr


@pytest.mark.slow
def test_four_processes_as_two_fake_hosts(tmp_path):
  r = launch(["--num_processes=4", "--processes_per_host=2", f"--log_dir={tmp_path}"])
  assert r.returncode == 0, r.stderr[-3000:]
  for rank in range(4):
    log = read(tmp_path / f"rank{rank}.log")
    assert f"RESULT rank={rank} processes=4 devices=4 psum=10.0 expected=10.0 OK" in log
    assert f"rank {rank} host host{rank // 2} started" in log


def test_env_only(tmp_path):
  r = launch(["--num_processes=2", "--pass_flags=false", f"--log_dir={tmp_path}"], ["--from_env"])
  assert r.returncode == 0, r.stderr[-3000:]
  assert "psum=3.0 expected=3.0 OK" in read(tmp_path / "rank1.log")


@pytest.mark.slow
def test_failed_rank_is_named_and_others_stopped(tmp_path):
  start = time.monotonic()
  r = launch(["--num_processes=3", f"--log_dir={tmp_path}"],
             ["--fail_rank=1", "--fail_code=7", f"--pid_dir={tmp_path}"])
  assert time.monotonic() - start < 60
  assert r.returncode == 7
  assert "rank 1 failed with exit code 7" in r.stderr
  assert "rank 1 failing on purpose" in r.stderr  # the tail of its log
  assert_all_dead(str(tmp_path), 3)  # ranks 0 and 2 were waiting for rank 1 in jax.distributed


@pytest.mark.slow
def test_timeout_stops_everything(tmp_path):
  start = time.monotonic()
  r = launch(["--num_processes=2", "--timeout=4", "--grace=1", f"--log_dir={tmp_path}"],
             ["--hang_rank=1", f"--pid_dir={tmp_path}"])
  assert r.returncode == 124
  assert time.monotonic() - start < 30
  assert "timeout after 4 s" in r.stderr
  assert_all_dead(str(tmp_path), 2)


@pytest.mark.slow
def test_sigint_stops_all_children(tmp_path):
  proc = subprocess.Popen([sys.executable, *LAUNCHER, "--num_processes=2", "--grace=1", f"--log_dir={tmp_path}",
                           "--", sys.executable, JOB, "--sleep=300", f"--pid_dir={tmp_path}"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
  err = interrupt_when_ready(
      proc, lambda: len(pids(str(tmp_path))) >= 2 and "RESULT" in read(tmp_path / "rank1.log"))
  assert proc.returncode == 130
  assert "interrupted (SIGINT)" in err
  assert_all_dead(str(tmp_path), 2)


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["--num_processes=2"],  # no command
    ["--", "true"],  # no --num_processes
    ["--num_processes=2", "--", "no-such-command-xyz"],
])
def test_usage_errors_are_one_line(args):
  r = subprocess.run([sys.executable, *LAUNCHER, *args], capture_output=True, text=True, timeout=60, check=False)
  assert r.returncode != 0
  assert "Traceback" not in r.stderr
  assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("name", ["slurm_scale_up.sbatch", "slurm_scale_out.sbatch", "slurm_rack_scale.sbatch",
                                  "mpirun_example.sh"])
def test_cluster_templates_are_valid_bash(name):
  """They can't run without a cluster; at least keep them parseable and pointed at the right entry point."""
  path = os.path.join(REPO, "scripts", name)
  subprocess.run(["bash", "-n", path], check=True)
  text = read(path)
  assert "python -m microbench" in text and '"$@"' in text
  if name != "slurm_scale_up.sbatch":
    assert "--distributed" in text


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_mpirun_example_on_localhost(tmp_path):
  hostfile = tmp_path / "hosts"
  hostfile.write_text("localhost slots=2\n")
  env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             PYTHONPATH=REPO, MICROBENCH_PORT=str(20000 + os.getpid() % 20000))
  r = subprocess.run([os.path.join(REPO, "scripts", "mpirun_example.sh"), str(hostfile), "2",
                      "--collectives=all_reduce", "--min_bytes=64K", "--max_bytes=64K", "--iters=6", "--samples=2",
                      f"--outdir={tmp_path / 'run'}"],
                     capture_output=True, text=True, timeout=120, cwd=REPO, env=env, check=False)
  assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
  assert "2 process(es)" in r.stdout
  meta = json.loads(read(tmp_path / "run" / "meta.json"))  # Open MPI's ranks joined one jax.distributed job
  assert meta["status"] == "finished" and meta["process_count"] == 2
  assert [p["process"] for p in meta["processes"]] == [0, 1]
