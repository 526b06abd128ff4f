"""A real SLURM on the emulated cluster (microbench.cluster.slurm_testbed): munged, slurmctld and one slurmd per
testbed host, started here and stopped at the end. The real paths run under it: `microbench --distributed`
under srun (JAX reads SLURM's settings), the scale-up and scale-out sbatch templates, and the study's sbatch
script (srun --exact steps, the SIGUSR1/SIGKILL kill sequence) on shared uplinks. They need root, network
namespaces and Debian's slurm-wlm and munge (CI installs them); elsewhere they skip, saying which is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from support import clean_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from microbench.cluster import slurm_testbed as stb  # pylint: disable=g-import-not-at-top
from microbench.cluster import testbed as tbm  # pylint: disable=g-import-not-at-top

TINY = ["--collectives=all_reduce", "--min_bytes=64K", "--max_bytes=64K", "--iters=6", "--samples=2"]


def records(path: str) -> list[dict]:
  return [json.loads(line) for line in open(path, encoding="utf-8")]


# Pure functions: run everywhere.
def test_config_names_every_host_at_its_address_and_the_racks():
  bed = tbm.Testbed(prefix="tbabc123", hosts=4, racks=2)
  conf = stb.slurm_conf(bed, "/w", 6817, 6818, cpus=8, gpus=2)
  assert "SlurmctldHost=tbabc123-h0(10.77.0.1)" in conf and "TopologyPlugin=topology/tree" in conf
  assert "NodeName=tbabc123-h3 NodeAddr=10.77.0.4 CPUs=8 RealMemory=1000 Gres=gpu:2 State=UNKNOWN" in conf
  assert "StateSaveLocation=/w/state" in conf and "cgroup" not in conf.lower()
  assert stb.topology_conf(bed).splitlines() == ["SwitchName=rack0 Nodes=tbabc123-h0,tbabc123-h1",
                                                 "SwitchName=rack1 Nodes=tbabc123-h2,tbabc123-h3",
                                                 "SwitchName=core Switches=rack0,rack1"]
  one_rack = tbm.Testbed(prefix="tbabc123", hosts=2)
  assert stb.topology_conf(one_rack) == "SwitchName=rack0 Nodes=tbabc123-h0,tbabc123-h1\n"


# The real thing.
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
  """4 hosts in 2 racks (400 Mbit/s host links, 100 Mbit/s uplinks) with SLURM up; all removed afterwards."""
  bed = tbm.Testbed.new(hosts=4, racks=2, host_rate=400_000_000, uplink_rate=100_000_000)
  bed.up()
  cluster = stb.SlurmTestbed(bed, str(tmp_path_factory.mktemp("slurm")), slurmd_timeout=10)
  try:
    cluster.up()
    yield cluster
  finally:
    pids = cluster.daemon_pids()
    cluster.down()
    bed.down()
    assert not [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read()
                .split(") ")[1][:1]], "a SLURM daemon survived"
    assert not [ns for ns in tbm.list_netns() if ns.startswith(bed.prefix + "-")]


@pytest.mark.cluster
@pytest.mark.usefixtures("needs_slurm")
def test_nodes_are_the_testbed_hosts_in_their_racks(slurm):
  bed = slurm.bed
  assert slurm.node_states() == {bed.host_name(i): "idle" for i in range(4)}
  topo = slurm.run(["scontrol", "show", "topology"]).stdout
  assert f"SwitchName=rack1 Level=0 LinkSpeed=1 Nodes={bed.host_name(2)},{bed.host_name(3)}" in topo
  assert "SwitchName=core Level=1" in topo
  r = slurm.run(["srun", "-N4", "-n4", "-l", "sh", "-c", "echo $(hostname) $SLURMD_NODENAME"])
  assert r.returncode == 0, r.stderr
  assert sorted(r.stdout.split("\n")[:4]) == [f"{k}: {bed.host_name(k)} {bed.host_name(k)}" for k in range(4)]


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_slurm")
def test_distributed_detects_slurm_under_srun(slurm, tmp_path):
  """`--distributed` alone: JAX takes the coordinator, ranks and count from srun's SLURM_* variables."""
  bed = slurm.bed
  out = tmp_path / "run"
  r = slurm.run(["srun", "-N2", "--ntasks-per-node=2", f"--nodelist={bed.host_name(1)},{bed.host_name(2)}",
                 sys.executable, "-m", "microbench", "--distributed", *TINY, f"--outdir={out}"],
                env=slurm.env(clean_env()), cwd=REPO, timeout=180)
  assert r.returncode == 0, r.stderr[-3000:]
  meta = json.load(open(out / "meta.json", encoding="utf-8"))
  assert meta["status"] == "finished" and meta["process_count"] == 4
  assert [p["host"] for p in meta["processes"]] == [bed.host_name(h) for h in (1, 1, 2, 2)]
  assert meta["topology"] == {"racks": 1, "nodes": 2, "gpus": 2}
  scopes = {row["scope"] for row in records(str(out / "results.jsonl")) if row.get("wrong") == 0}
  assert {"scale_up", "scale_out", "global"} <= scopes, scopes


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_slurm")
def test_sbatch_templates(slurm, tmp_path):
  """The scale-up, scale-out, rack-scale and per-node templates as written, with tiny sizes, submitted together (each asks
  for whole nodes, so SLURM runs them as nodes free up); 2 CPU devices stand in for a node's GPUs in scale-up,
  and the rack-scale sweep is told the testbed's racks (2 nodes each)."""
  jobs = {
      "up": slurm.submit(["--gpus-per-node=2", f"--output={tmp_path}/up.out", "scripts/slurm_scale_up.sbatch", *TINY,
                          "--topology=racks:1,nodes:1,gpus:2", f"--outdir={tmp_path}/up"],
                         cwd=REPO, env=clean_env(JAX_NUM_CPU_DEVICES="2")),
      "out": slurm.submit(["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1",
                           f"--output={tmp_path}/out.out", "scripts/slurm_scale_out.sbatch", *TINY,
                           f"--outdir={tmp_path}/out"], cwd=REPO, env=clean_env()),
      "rack": slurm.submit(["--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1",
                            f"--output={tmp_path}/rack.out", "scripts/slurm_rack_scale.sbatch", *TINY,
                            "--nodes_per_rack=2", f"--outdir={tmp_path}/rack"], cwd=REPO, env=clean_env()),
      "pernode": slurm.submit(["--nodes=2", "--gpus-per-node=2", "--cpus-per-task=1",
                               f"--output={tmp_path}/pernode.out", "scripts/slurm_per_node.sbatch", *TINY,
                               f"--outdir={tmp_path}/pernode"], cwd=REPO, env=clean_env(JAX_NUM_CPU_DEVICES="2")),
  }
  for name, job in jobs.items():
    state, code = slurm.wait(job, timeout=240)
    assert (state, code) == ("COMPLETED", "0:0"), (name, state, open(tmp_path / f"{name}.out").read()[-3000:])
  meta = {name: json.load(open(tmp_path / name / "meta.json", encoding="utf-8")) for name in jobs}
  assert meta["up"]["process_count"] == 1 and meta["up"]["status"] == "finished"
  assert meta["out"]["process_count"] == 4 and meta["out"]["topology"]["nodes"] == 2
  assert meta["rack"]["process_count"] == 4 and meta["rack"]["topology"]["racks"] == 2
  # one process per node, each driving both of its node's devices (the binding rule says so)
  assert meta["pernode"]["process_count"] == 2 and meta["pernode"]["topology"] == {"racks": 1, "nodes": 2, "gpus": 2}
  assert meta["pernode"]["environment"]["gpu_binding"]["rule"] == "one_per_node"
  assert [p["host"] for p in meta["rack"]["processes"]] == [slurm.bed.host_name(i) for i in range(4)]
  scopes = {row["scope"] for row in records(str(tmp_path / "rack" / "results.jsonl")) if row.get("wrong") == 0}
  assert {"rack_scale", "scale_out"} <= scopes, scopes  # global: the same group as scale_out here


def _print_study_logs(log: str, res: str) -> None:
  """On a failed study: its whole log and the tail of every step's srun log (pytest shows what a failed test
  printed, whole; an assertion message is cut)."""
  print(log)
  for root, _, files in sorted(os.walk(os.path.join(res, "logs"))):
    for name in sorted(files):
      with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
        print(f"--- {os.path.join(root, name)}\n{f.read()[-4000:]}")


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_slurm")
@pytest.mark.parametrize("jobs,shared", [(("dp@0,2", "dp@1,3"), True), (("dp@0,1", "dp@2,3"), False)],
                         ids=["shared_uplinks", "isolated_racks"])
def test_sbatch_study(slurm, tmp_path, jobs, shared):
  """The study's sbatch script: two 2-rank DP jobs as srun --exact steps; the one still running when the other
  finishes is stopped by SIGUSR1 (srun forwards it). Jobs across the racks share both uplinks: sigma near 2;
  jobs each inside its own rack share nothing: sigma near 1 (the testbed backend's rehearsal: ~1.83, ~0.99)."""
  plan, res = str(tmp_path / "plan"), str(tmp_path / "res")
  r = subprocess.run([sys.executable, "-m", "microbench.cli.study", "plan",
                      "--machine=testbed:racks=2,hosts_per_rack=2", *(f"--jobs={j}" for j in jobs), f"--out={plan}"],
                     capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=120, check=False)
  assert r.returncode == 0, r.stderr
  job, state, code = slurm.sbatch(["--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=1", "--time=10",
                                   f"--output={tmp_path}/study.out", "scripts/slurm_study.sbatch", plan, res,
                                   "--bytes_scale=0.0015", "--iters=7", "--grace=60", "--small_job_threshold=1"],
                                  cwd=REPO, env=clean_env(), timeout=300)
  log = open(tmp_path / "study.out", encoding="utf-8").read()
  if (state, code) != ("COMPLETED", "0:0"):
    _print_study_logs(log, res)
  assert (state, code) == ("COMPLETED", "0:0"), (job, state, code, "the study's log and srun logs are printed above")
  assert "on slurm (4 allocated nodes)" in log
  units = records(os.path.join(res, "units.jsonl"))
  assert [(u["kind"], u["status"]) for u in units] == [("baseline", "done"), ("concurrent", "done")]
  instances = [i for j in units[1]["jobs"] for i in j["instances"]]
  stopped = [i for i in instances if i["outcome"] == "stopped"]
  # Ended by SIGUSR1, which srun forwards, never by the SIGKILL after the grace: exit 0 (the proxy's handler),
  # 138 (SIGUSR1 before the handler is installed), 143 (one rank died of it; srun -K terminated the rest) or
  # -SIGUSR1 (srun itself, signalled before it set up its forwarding).
  assert stopped and all(i["returncode"] in (0, 128 + 10, 128 + 15, -10) for i in stopped), stopped
  assert os.path.exists(os.path.join(res, "logs", "e000", "j0.0", "srun.log"))
  sigma = json.load(open(os.path.join(res, "report", "sigma.json"), encoding="utf-8"))[0]["sigma"]
  if shared:
    assert sigma["sigma"] > 1.3 and sigma["share_slower"] >= 0.5, sigma
  else:
    # Nothing shared: no slowdown the samples resolve. Beside a second copy of the suite (2 cores, CPU-starved
    # proxies) the point estimate read 1.27 with an interval of 0.81-1.59; a shared uplink reads ~1.85, resolved.
    assert sigma["sigma"] < 1.2 or (not sigma["excludes_one"] and sigma["sigma"] < 1.5), sigma


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_slurm")
def test_failed_node_requeues_the_study_and_it_resumes(slurm, tmp_path):
  """A node fails mid-study (its slurmd and processes killed): SLURM sets it DOWN and requeues the batch job, whose
  study ends on SIGTERM with the unfinished unit left aside; once the node is back, the requeued job resumes."""
  plan, res, log = str(tmp_path / "plan"), str(tmp_path / "res"), tmp_path / "study.out"
  r = subprocess.run([sys.executable, "-m", "microbench.cli.study", "plan",
                      "--machine=testbed:racks=2,hosts_per_rack=2", "--jobs=dp@0,2", "--jobs=dp@1,3", f"--out={plan}"],
                     capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=120, check=False)
  assert r.returncode == 0, r.stderr
  job = slurm.submit(["--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=1", "--time=10",
                      f"--output={log}", "scripts/slurm_study.sbatch", plan, res, "--bytes_scale=0.0015",
                      "--iters=4", "--grace=60", "--nobaselines", "--small_job_threshold=1"], cwd=REPO, env=clean_env())
  deadline = time.monotonic() + 120
  while not os.path.exists(os.path.join(res, "raw", "e000", "j1.0.jsonl")):  # the concurrent unit has started
    assert time.monotonic() < deadline and slurm.job_state(job)[0] in ("PENDING", "RUNNING"), log.read_text()
    time.sleep(0.2)
  slurm.fail_node(3)
  while slurm.job_state(job)[0] != "PENDING":  # requeued
    assert time.monotonic() < deadline + 60, (slurm.job_state(job), slurm.node_states())
    time.sleep(0.5)
  assert slurm.node_states()[slurm.bed.host_name(3)].startswith("down")
  first = log.read_text()
  assert "DUE TO NODE FAILURE" in first and "interrupted (SIGTERM)" in first, first[-3000:]
  assert not os.path.exists(os.path.join(res, "units.jsonl"))  # no unit finished
  slurm.restore_node(3)
  state, code = slurm.wait(job, timeout=240)
  second = log.read_text()[len(first):]
  assert (state, code) == ("COMPLETED", "0:0"), second[-3000:]
  assert "0 unit(s) already done, 1 to run" in second
  assert [(u["unit"], u["status"]) for u in records(os.path.join(res, "units.jsonl"))] == [("e000", "done")]
  assert any(name.startswith("e000.") for name in os.listdir(os.path.join(res, "aborted")))
