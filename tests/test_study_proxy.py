"""Proxies as processes (one per rank, gloo on CPU): the records they write, a whole local study through the
command line, a proxy derived from a training step, and a small study on the emulated cluster (root only)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from support import clean_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDY = [sys.executable, "-m", "microbench.cli.study"]
LAUNCH = [sys.executable, "-m", "microbench.cli.launch"]


def study(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
  return subprocess.run([*STUDY, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=clean_env(),
                        check=False)


def records(path: str) -> list[dict]:
  return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.mark.slow
def test_proxy_records_every_rank_and_the_slowest(tmp_path):
  out = tmp_path / "dp.jsonl"
  r = subprocess.run([*LAUNCH, "--num_processes=2", f"--log_dir={tmp_path}", "--", *STUDY, "proxy",
                      "--strategy=fsdp", "--bytes_scale=1e-5", "--compute_scale=0.005", "--iters=3",
                      f"--records={out}"],
                     capture_output=True, text=True, timeout=240, cwd=REPO, env=clean_env(), check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  recs = records(str(out))
  head, iters = recs[0], recs[1:]
  assert head["kind"] == "proxy" and head["gpus"] == 2 and head["meta"]["degrees"] == {"data": 1, "stages": 1,
                                                                                        "inner": 2}
  assert head["full"]["bytes_per_iteration_rank0"]["allgather"] > 1e10  # unscaled: the study's sizes
  assert head["scaled"]["collectives_rank0"] == {"all_gather:allgather": 31, "reduce_scatter:reduce_scatter": 16}
  assert [x["iter"] for x in iters] == [0, 1, 2, 3] and [x["warmup"] for x in iters] == [True, False, False, False]
  for x in iters:
    runtimes = x["ranks"]["runtime_s"]
    assert x["slowest_rank"] == runtimes.index(max(runtimes))
    assert x["runtime_s"] == pytest.approx(max(runtimes), rel=1e-5)
    assert x["throughput"] == pytest.approx(head["samples_per_iteration"] / x["runtime_s"], rel=1e-6)
    assert 0 < x["exposed_s"] < x["runtime_s"] and 0 <= x["comm_share"] <= 1
    assert min(x["ranks"]["compute_s"]) >= 0.9 * head["scaled"]["compute_s_max"]  # the host really waited


@pytest.mark.slow
def test_local_study_end_to_end(tmp_path):
  plan, res = str(tmp_path / "plan"), str(tmp_path / "res")
  r = study("plan", "--machine=testbed:racks=2,hosts_per_rack=2", "--jobs=dp@0,2", "--jobs=dp@1,3", f"--out={plan}")
  assert r.returncode == 0, r.stderr
  r = study("run", f"--plan={plan}", f"--out={res}", "--backend=local", "--bytes_scale=1e-4", "--compute_scale=0.1",
            "--small_job_threshold=1",
            "--iters=4", "--grace=60")  # an upper bound: a proxy that stops promptly ends the wait
  assert r.returncode == 0, r.stderr[-3000:]
  units = records(os.path.join(res, "units.jsonl"))
  assert [u["status"] for u in units] == ["done", "done"] and units[1]["ended"] == "large jobs finished"
  stopped = [i for j in units[1]["jobs"] for i in j["instances"] if i["outcome"] == "stopped"]
  # a respawned proxy ends on SIGUSR1 (its handler, or the default action before it is installed), not SIGKILL
  assert all(i["returncode"] in (0, -signal.SIGUSR1) for i in stopped)
  r = study("run", f"--plan={plan}", f"--out={res}", "--backend=local", "--bytes_scale=1e-4", "--compute_scale=0.1",
            "--small_job_threshold=1",
            "--iters=4", "--resume")
  assert r.returncode == 0 and "2 unit(s) already done, 0 to run" in r.stderr
  r = study("report", f"--results={res}", "--noplots")
  assert r.returncode == 0, r.stderr
  assert "| dp | vit-h | 2 | intra-group |" in r.stdout and "**" in r.stdout


def test_plan_can_derive_a_strategys_proxies(tmp_path):
  r = study("plan", "--machine=testbed:racks=2,hosts_per_rack=2", "--jobs=fsdp@0,2", "--jobs=dp@1,3",
            "--derive=fsdp=gpt2-tiny", f"--out={tmp_path}")
  assert r.returncode == 0, r.stderr
  jobs = json.load(open(tmp_path / "experiments" / "e000.json"))["jobs"]
  assert jobs[0]["proxy_from"] == "gpt2-tiny,fsdp" and jobs[0]["model"] == "gpt2-tiny"
  assert "proxy_from" not in jobs[1]
  from microbench.study import machines, run_plan
  cmd = run_plan.proxy_command(jobs[0], machines.parse("testbed"), run_plan.RunSettings("p", "o"), "raw", "t")
  assert "--proxy_from=gpt2-tiny,fsdp" in cmd


def test_busy_compute_occupies_the_device():
  import time

  import jax

  from microbench.study import proxy
  kernel = proxy.BusyKernel(jax.devices()[0])
  t = time.perf_counter()
  kernel(0.2)
  assert time.perf_counter() - t >= 0.1  # a kernel that did not run would return at once


@pytest.mark.slow
def test_derived_proxy_runs_the_training_steps_collectives(tmp_path):
  out = tmp_path / "derived.jsonl"
  r = subprocess.run([*LAUNCH, "--num_processes=2", f"--log_dir={tmp_path}", "--", *STUDY, "proxy",
                      "--proxy_from=gpt2-tiny,dp", "--iters=2", "--compute_scale=0.01", f"--records={out}"],
                     capture_output=True, text=True, timeout=300, cwd=REPO, env=clean_env(), check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  head = records(str(out))[0]
  assert head["meta"]["proxy_from"] == "gpt2-tiny,dp" and head["meta"]["parallelism"] == "dp:2"
  assert set(head["scaled"]["collectives_rank0"]) == {"all_reduce:data"}
  assert head["scaled"]["bytes_per_iteration_rank0"]["data"] >= 4 * head["meta"]["params"]


@pytest.mark.slow
@pytest.mark.parametrize("args,needle", [
    (["proxy", "--strategy=zero3"], "unknown strategy"),
    (["plan", "--machine=summit", "--out=/tmp/x"], "unknown machine"),
    (["plan", "--jobs=dp", "--out=/tmp/x"], "STRATEGY[:MODEL]@NODES"),
    (["plan", "--machine=testbed", "--jobs=dp@0,1", "--jobs=dp@1,2", "--out=/tmp/x"], "already used"),
    (["run", "--plan=/nonexistent"], "--out"),
    (["run", "--plan=/nonexistent", "--out=/tmp/microbench-study-none"], "cannot read the plan"),
    (["report", "--results=/nonexistent"], "no finished unit"),
    (["schedule", "--proxy_from=resnet-tiny,dp+pp", "--gpus=4"], "resnet has none to split"),
    (["frobnicate"], "want one mode"),
    (["plan", "--machine=testbed", "--size_divisor=8", "--derive=dp+pp=gpt5-tiny", "--out=/tmp/x"],
     "unknown model 'gpt5'"),
    (["plan", "--machine=testbed", "--size_divisor=8", "--derive=fsdp", "--out=/tmp/x"], "STRATEGY=MODEL"),
])
def test_bad_input_is_one_line(args, needle):
  r = study(*args, timeout=120)
  assert r.returncode != 0 and "Traceback" not in r.stderr
  assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
def test_shared_uplink_slows_jobs_down_on_the_testbed(tmp_path):
  """Two 2-rank DP jobs whose traffic crosses the same shaped rack uplinks: sigma well above 1."""
  plan, res = str(tmp_path / "plan"), str(tmp_path / "res")
  machine = "--machine=testbed:racks=2,hosts_per_rack=2,host_rate=400mbit,uplink_rate=100mbit"
  assert study("plan", machine, "--jobs=dp@0,2", "--jobs=dp@1,3", f"--out={plan}").returncode == 0
  r = study("run", f"--plan={plan}", f"--out={res}", "--backend=testbed", "--bytes_scale=0.0015", "--iters=20",
            "--grace=60", "--small_job_threshold=1", timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "removed testbed" in r.stderr
  r = study("report", f"--results={res}", "--noplots")
  table = json.load(open(os.path.join(res, "report", "sigma.json")))
  sigma = table[0]["sigma"]
  # Two flows on one uplink get half of it each: sigma near 2 (1.8-1.9 measured). The interval is left to
  # the rehearsal in docs/measured-figures.md: ~19 samples per job here, some taken while the other job starts
  # (20 iterations, not 7: on a busy machine a starved start-up outlasted 7 and the jobs barely overlapped).
  assert sigma["sigma"] > 1.3 and sigma["share_slower"] >= 0.5, sigma


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_slurm")
def test_slurm_backend_runs_steps_in_one_allocation(tmp_path):
  """A DGX-like mix (two 4-rank jobs sharing one node, 4 of its 8 GPUs each) as srun --exact steps inside one
  salloc, on a real SLURM started here over a one-host emulated cluster."""
  from microbench.cluster import slurm_testbed
  from microbench.cluster import testbed as tbm
  plan, res = str(tmp_path / "plan"), str(tmp_path / "res")
  assert study("plan", "--machine=dgx", "--samples_per_bin=1", "--max_experiments=1", f"--out={plan}").returncode == 0
  bed = tbm.Testbed.new(hosts=1)
  bed.up()
  try:
    with slurm_testbed.SlurmTestbed(bed, str(tmp_path / "slurm"), cpus=8, gpus=8) as slurm:
      r = slurm.run(["salloc", "-N1", "-n8", "--gres=gpu:8", *STUDY, "run", "--backend=slurm", f"--plan={plan}",
                     f"--out={res}", "--bytes_scale=1e-4", "--compute_scale=0.02", "--iters=3", "--grace=60",
                     "--small_job_threshold=1"],
                    timeout=300, cwd=REPO, env=slurm.env(clean_env()))
  finally:
    bed.down()
  assert r.returncode == 0, r.stderr[-3000:]
  units = records(os.path.join(res, "units.jsonl"))
  assert all(u["status"] == "done" for u in units) and units[-1]["kind"] == "concurrent"
  for job in units[-1]["jobs"]:
    first = records(os.path.join(res, job["instances"][0]["raw"]))
    assert first[0]["gpus"] == job["gpus"] and sum(1 for x in first if x["kind"] == "iter") == 4
