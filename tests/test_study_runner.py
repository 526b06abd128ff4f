"""The study's runner without JAX: a stand-in proxy (tests/_fake_proxy.py) writes the real records, so
respawns, the kill sequence, failures, resume and the report are tested in seconds."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from microbench.cluster import launch
from microbench.study import backends as bk
from microbench.study import generator as gen
from microbench.study import machines as mm
from microbench.study import run_plan, sigma_report, stats

FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fake_proxy.py")
MACHINE = "testbed:racks=4,hosts_per_rack=2"


class FakeBackend(bk.Backend):
  """Runs the stand-in proxy; `behave(tag, job)` -> (iters, throughput, mode) for each job instance."""
  name = "fake"

  def __init__(self, behave):
    self.behave = behave
    self.started: list[str] = []

  def procs(self, job, command, tag, log_dir):
    out = next(a.split("=", 1)[1] for a in command if a.startswith("--records="))
    assert f"--strategy={job['strategy']}" in command and f"--gpus={job['gpus']}" in command
    iters, thr, mode = self.behave(tag, job)
    self.started.append(tag)
    os.makedirs(log_dir, exist_ok=True)
    return [launch.Proc(tag, 0, [sys.executable, FAKE, out, str(iters), str(thr), mode], dict(os.environ),
                        os.path.join(log_dir, "rank0.log"))]


def make_plan(tmp_path, mixes) -> str:
  m = mm.parse(MACHINE)
  exps = []
  for i, jobs in enumerate(mixes):
    e = gen.manual(m, jobs)
    e["id"] = f"e{i:03d}"
    exps.append(e)
  plan_dir = str(tmp_path / "plan")
  gen.write(plan_dir, gen.Settings(m), exps, {})
  return plan_dir


def run(tmp_path, plan_dir, backend, resume=False, **kw):
  s = run_plan.RunSettings(plan_dir=plan_dir, out_dir=str(tmp_path / "res"), backend="local",
                           grace=kw.pop("grace", 1.0), **kw)
  _, experiments, machine = run_plan.prepare(s, resume)
  lines: list[str] = []
  return run_plan.run(s, backend, machine, experiments, say=lines.append), s


def behave_by_kind(base_thr=100.0, conc=None, small_iters=2, large_iters=8, small_mode=""):
  conc = conc or {}

  def f(tag, job):
    concurrent = not tag.startswith("base-")
    iters = large_iters if job["gpus"] >= 4 else small_iters
    thr = conc.get(job["name"], base_thr) if concurrent else base_thr
    return iters, thr, small_mode if concurrent and job["gpus"] < 4 else ""
  return f


def test_small_jobs_respawn_until_the_large_one_finishes(tmp_path):
  plan = make_plan(tmp_path, [[("dp", None, [0, 2, 4, 6]), ("dp", None, [1, 3])]])
  backend = FakeBackend(behave_by_kind())
  recs, s = run(tmp_path, plan, backend, small_job_threshold=4, iters=3)
  assert [r["unit"] for r in recs] == ["base-dp-vit-h-g4-intra-group", "base-dp-vit-h-g2-intra-group", "e000"]
  e = recs[-1]
  assert e["status"] == "done" and e["ended"] == "large jobs finished"
  large, small = e["jobs"]
  assert large["large"] and not small["large"]
  assert [i["outcome"] for i in large["instances"]] == ["ok"]
  assert len(small["instances"]) >= 2 and all(i["outcome"] == "ok" for i in small["instances"][:-1])
  assert small["instances"][-1]["outcome"] in ("stopped", "ok")
  assert os.path.exists(os.path.join(s.out_dir, small["instances"][0]["raw"]))


def test_every_job_large_by_default_restarts_early_finishers(tmp_path):
  plan = make_plan(tmp_path, [[("dp", None, [0, 2, 4, 6]), ("dp", None, [1, 3])]])
  recs, _ = run(tmp_path, plan, FakeBackend(behave_by_kind()), baselines=False)
  small = recs[0]["jobs"][1]
  assert small["large"] and len(small["instances"]) >= 2  # it finished first and kept loading the network


def test_all_small_as_the_artifact_runs_every_mix_for_its_walltime(tmp_path):
  """microbench-study run's default threshold (the artifact's: none): no job is large, every one respawns
  until the walltime ends the mix."""
  plan = make_plan(tmp_path, [[("dp", None, [0, 2, 4, 6]), ("dp", None, [1, 3])]])
  recs, _ = run(tmp_path, plan, FakeBackend(behave_by_kind(large_iters=2)), baselines=False,
                small_job_threshold=run_plan.ALL_SMALL, walltime=3.0)
  e = recs[0]
  assert e["ended"] == "walltime" and not any(j["large"] for j in e["jobs"])
  assert all(len(j["instances"]) >= 2 for j in e["jobs"])  # both respawned, the 4-GPU job too


def test_kill_sequence_escalates_to_sigkill(tmp_path):
  plan = make_plan(tmp_path, [[("dp", None, [0, 2, 4, 6]), ("dp", None, [1, 3])]])
  recs, _ = run(tmp_path, plan, FakeBackend(behave_by_kind(small_mode="hang", large_iters=2)), baselines=False,
                small_job_threshold=4, grace=0.5)
  small = recs[0]["jobs"][1]["instances"]
  assert small[-1]["outcome"] == "stopped" and small[-1]["returncode"] == -signal.SIGKILL
  assert recs[0]["seconds"] < 10


def test_a_failing_job_fails_its_unit_and_resume_runs_it_again(tmp_path):
  plan = make_plan(tmp_path, [[("dp", None, [0, 2, 4, 6]), ("dp", None, [1, 3])]])
  recs, s = run(tmp_path, plan, FakeBackend(behave_by_kind(small_mode="fail")), small_job_threshold=4,
                max_failures=2)
  assert [r["status"] for r in recs] == ["done", "done", "failed"]
  assert "failed 2 times in a row" in recs[-1]["reason"]
  backend = FakeBackend(behave_by_kind())
  recs2, _ = run(tmp_path, plan, backend, resume=True, small_job_threshold=4, max_failures=2)
  assert [r["unit"] for r in recs2] == ["e000"] and recs2[0]["status"] == "done"
  assert all(t.startswith("e000.") for t in backend.started)  # baselines were not run again
  assert os.listdir(os.path.join(s.out_dir, "aborted"))  # the failed attempt's records were kept aside
  assert set(run_plan.done_units(s.out_dir)) == {"base-dp-vit-h-g4-intra-group", "base-dp-vit-h-g2-intra-group",
                                                "e000"}


def test_resume_refuses_other_settings_and_an_existing_folder(tmp_path):
  plan = make_plan(tmp_path, [[("dp", None, [0, 2]), ("dp", None, [1, 3])]])
  run(tmp_path, plan, FakeBackend(behave_by_kind()))
  with pytest.raises(run_plan.RunError, match="--resume"):
    run(tmp_path, plan, FakeBackend(behave_by_kind()))
  with pytest.raises(run_plan.RunError, match="bytes_scale"):
    run(tmp_path, plan, FakeBackend(behave_by_kind()), resume=True, bytes_scale=0.5)
  recs, _ = run(tmp_path, plan, FakeBackend(behave_by_kind()), resume=True)
  assert recs == []
  with open(os.path.join(tmp_path, "res", run_plan.UNITS_FILE), "a") as f:
    f.write('{"unit": "torn')  # a crash mid-line: ignored, and terminated before the next record
  assert len(run_plan.done_units(str(tmp_path / "res"))) == 2


def test_report_computes_sigma_from_the_records(tmp_path):
  plan = make_plan(tmp_path, [[("dp", None, [0, 2, 4, 6]), ("fsdp", None, [1, 3])]])
  _, s = run(tmp_path, plan, FakeBackend(behave_by_kind(conc={"j0": 50.0})), iters=12)
  samples, units = sigma_report.load(s.out_dir)
  assert {x.kind for x in samples} == {"baseline", "concurrent"}
  # the warm-up and the first timed iteration of every instance are left out
  raw = [json.loads(line) for line in open(os.path.join(s.out_dir, "raw", "e000", "j0.0.jsonl"))]
  kept = [x for x in samples if x.unit == "e000" and x.job == "j0" and x.instance == 0]
  assert [x.iteration for x in kept] == [r["iter"] for r in raw if r["kind"] == "iter"][2:]
  out = sigma_report.build(s.out_dir, plots=False, say=lambda m: None)
  k = out["keys"][("dp", "vit-h", 4, "intra-group")]
  base = [x.throughput for x in samples if x.kind == "baseline" and x.key == k.key]
  conc = [x.throughput for x in samples if x.kind == "concurrent" and x.key == k.key]
  assert k.sigma == stats.sigma(base, conc) and k.sigma.sigma == pytest.approx(2.0, rel=0.03)
  assert k.sigma.excludes_one and k.comm_share_baseline == pytest.approx(0.275, abs=0.03)
  fsdp = out["keys"][("fsdp", "llama3-8b", 2, "intra-group")]
  assert fsdp.sigma.sigma == pytest.approx(1.0, rel=0.03) and not fsdp.sigma.excludes_one
  md = open(os.path.join(out["report_dir"], "report.md")).read()
  assert "| dp | vit-h | 4 | intra-group |" in md and "## Experiments" in md
  table = json.load(open(os.path.join(out["report_dir"], "sigma.json")))
  assert {r["strategy"] for r in table} == {"dp", "fsdp"}
  assert os.listdir(os.path.join(out["report_dir"], "tensorboard"))


def test_report_plots(tmp_path):
  pytest.importorskip("matplotlib")
  plan = make_plan(tmp_path, [[("dp", None, [0, 2, 4, 6]), ("fsdp", None, [1, 3])]])
  _, s = run(tmp_path, plan, FakeBackend(behave_by_kind(conc={"j0": 50.0})))
  out = sigma_report.build(s.out_dir, say=lambda m: None)
  assert sorted(os.path.basename(p) for p in out["plots"]) == ["heatmap.png", "scaling.png", "violins.png"]
  for p in out["plots"]:
    assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 5000


def test_slurm_steps_and_template(tmp_path):
  m = mm.parse("leonardo:nodes=8")
  backend = bk.SlurmBackend(m, ["--mpi=cray_shasta"], hosts=[f"lrdn{i:04d}" for i in range(8)])
  backend.open()
  job = gen.job_entry("j0", "fsdp", 16, "intra-l1", [2, 3, 5, 6])
  procs = backend.procs(job, ["python", "-m", "microbench.cli.study", "proxy"], "e000.j0.0", str(tmp_path))
  argv = procs[0].argv
  assert argv[:8] == ["srun", "--exact", "--nodes=4", "--ntasks=16", "--ntasks-per-node=4",
                      "--nodelist=lrdn0002,lrdn0003,lrdn0005,lrdn0006", "--kill-on-bad-exit=1",
                      "--job-name=e000.j0.0"]
  assert "--gres=gpu:4" in argv and "--mpi=cray_shasta" in argv and "--distributed" in argv
  assert argv[-1].startswith("--coordinator_address=lrdn0002:")
  small = gen.job_entry("j1", "dp", 2, "intra-l1", [7])
  assert "--ntasks-per-node=2" in backend.procs(small, ["x"], "e000.j1.0", str(tmp_path))[0].argv
  with pytest.raises(bk.BackendError, match="allocation"):
    bk.SlurmBackend(mm.parse("leonardo:nodes=8"), hosts=["a"]).open()
  path = os.path.join(os.path.dirname(FAKE), "..", "scripts", "slurm_study.sbatch")
  import subprocess
  subprocess.run(["bash", "-n", path], check=True)
  text = open(path).read()
  assert "--backend=slurm" in text and '"$@"' in text and "--resume" in text


def test_rank_nodes_and_gpus_follow_ranks_per_node(tmp_path):
  job = gen.job_entry("j0", "dp", 6, "intra-group", [4, 9])
  assert bk.rank_nodes(job) == [4, 4, 4, 9, 9, 9]
  small = gen.job_entry("j1", "dp", 2, "intra-l1", [0], first_slot=4)
  procs = bk.LocalBackend().procs(small, ["true"], "t", str(tmp_path))
  assert [p.env["CUDA_VISIBLE_DEVICES"] for p in procs] == ["4", "5"]
  assert [p.env["MICROBENCH_HOSTNAME"] for p in procs] == ["node0", "node0"]
