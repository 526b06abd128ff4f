"""Multi-process `microbench` jobs on this host (jax.distributed + gloo), started without any launcher."""

import json
import os
import time

import pytest

from support import finish_job, start_job
from microbench.output.run_folder import latest

pytestmark = pytest.mark.slow


def _records(outdir):
  with open(os.path.join(outdir, "results.jsonl")) as f:
    return [json.loads(line) for line in f]


def _meta(outdir):
  with open(os.path.join(outdir, "meta.json")) as f:
    return json.load(f)


def _process_of_position(meta):
  return {d["mesh_position"]: p["process"] for p in meta["processes"] for d in p["devices"]}


def test_two_hosts_two_devices_each(tmp_path):
  out = tmp_path / "run"
  args = ["--collectives=all_reduce,all_gather,ppermute", "--scopes=scale_up,scale_out", "--min_bytes=1K",
          "--max_bytes=2K", "--iters=6", "--samples=2", f"--outdir={out}"]
  results = finish_job(start_job(args, 2, devices_per_process=2, hosts=["h0", "h1"]))
  for code, _, err in results:
    assert code == 0, err[-2000:]
  assert "all_gather over scale_out" in results[0][1]
  assert "# microbench" not in results[1][1] and "all_gather over" not in results[1][1]  # only process 0 prints
  meta = _meta(out)
  assert meta["process_count"] == 2 and meta["topology"] == {"racks": 1, "nodes": 2, "gpus": 2}
  assert [p["host"] for p in meta["processes"]] == ["h0", "h1"]
  owner = _process_of_position(meta)
  # scale_up groups stay inside one host's process; scale_out groups span both.
  assert all(len({owner[d] for d in g}) == 1 for g in meta["scopes"]["scale_up"]["groups"])
  assert all({owner[d] for d in g} == {0, 1} for g in meta["scopes"]["scale_out"]["groups"])
  recs = _records(out)
  assert len(recs) == 3 * 2 * 2
  assert all(r["status"] == "ok" and r["wrong"] == 0 and r["num_processes"] == 2 for r in recs)


def test_four_processes_on_two_interleaved_hosts(tmp_path):
  out = tmp_path / "run"
  args = ["--collectives=reduce_scatter,all_to_all", "--scopes=scale_up,scale_out,global", "--min_bytes=4K",
          "--max_bytes=4K", "--iters=6", "--samples=2", f"--outdir={out}"]
  results = finish_job(start_job(args, 4, hosts=["a", "b", "a", "b"]))
  for code, _, err in results:
    assert code == 0, err[-2000:]
  meta = _meta(out)
  assert meta["topology"] == {"racks": 1, "nodes": 2, "gpus": 2}
  owner = _process_of_position(meta)
  # Processes 0 and 2 share host a: they form one node, so one scale_up group.
  assert sorted(sorted(owner[d] for d in g) for g in meta["scopes"]["scale_up"]["groups"]) == [[0, 2], [1, 3]]
  recs = _records(out)
  assert len(recs) == 2 * 3 and all(r["status"] == "ok" and r["wrong"] == 0 for r in recs)


def test_a_slow_rank_is_flagged_as_straggler(tmp_path):
  out = tmp_path / "run"
  args = ["--collectives=all_reduce", "--scopes=global", "--min_bytes=1K", "--max_bytes=2K", "--iters=6",
          "--samples=3", "--inject_delay=1:20", f"--outdir={out}"]
  results = finish_job(start_job(args, 2, hosts=["h0", "h1"]))
  assert results[0][0] == 0, results[0][2][-2000:]
  assert "STRAGGLER rank 1" in results[0][1]
  for r in _records(out):
    assert r["straggler"] and r["slowest_rank"] == 1 and r["time_spread"] > 0.1
    assert r["time_us"] > 20e3 / 2  # 20 ms per operation on rank 1: the reported time is the slowest process's


def test_dead_rank_ends_the_job_and_resume_finishes_it(tmp_path):
  out = tmp_path / "run"
  args = ["--collectives=all_reduce", "--scopes=global", "--min_bytes=1K", "--max_bytes=32K", "--iters=6",
          "--samples=2", f"--outdir={out}"]
  t0 = time.monotonic()
  results = finish_job(start_job([*args, "--inject_crash=1:3"], 2, hosts=["h0", "h1"]), timeout=90)
  assert time.monotonic() - t0 < 60
  assert all(code != 0 for code, _, _ in results)
  assert "a process of the job failed" in results[0][1]
  recs = _records(out)  # every line valid JSON; the point in progress when the peer died is named as failed
  assert [r["status"] for r in recs] == ["ok"] * 3 + ["failed"]
  assert "a process of the job failed during point 4/6" in recs[3]["reason"]
  assert _meta(out)["status"] == "failed"
  results = finish_job(start_job([f"--resume={out}"], 2, hosts=["h0", "h1"]))
  assert all(code == 0 for code, _, _ in results), results[0][2][-2000:]
  recs = latest(_records(out))
  assert sorted(r["bytes"] for r in recs) == [1024 << i for i in range(6)]
  assert all(r["status"] == "ok" for r in recs)


def test_a_hung_rank_ends_the_job_and_the_point_is_recorded(tmp_path):
  """Rank 1 stops inside point 2's timed runs (a collective that never returns, as a lost NCCL peer would
  leave it): the watchdog ends every process within its deadline, well before gloo's own timeout, with the
  point recorded as failed and named."""
  out = tmp_path / "run"
  args = ["--collectives=all_reduce", "--scopes=global", "--min_bytes=1K", "--max_bytes=4K", "--iters=6",
          "--samples=2", "--hang_timeout=5", "--inject_hang=1:1", f"--outdir={out}"]
  t0 = time.monotonic()
  results = finish_job(start_job(args, 2, hosts=["h0", "h1"]), timeout=120)
  assert time.monotonic() - t0 < 40  # gloo's collective timeout is 45 s: the watchdog ended it
  # Rank 0 records and exits 3; rank 1 exits 3 by its own watchdog, or is aborted by JAX's coordination
  # service (which lives in process 0) if rank 0 went first.
  assert results[0][0] == 3 and results[1][0] != 0, [err[-1500:] for _, _, err in results]
  # Both watchdogs expire at about the same time: rank 0's names the point itself, or rank 1's went first and
  # rank 0 saw its peer vanish inside the same point. Either way the point is recorded as failed, named.
  point = "point 2/3 (all_reduce over global, float32, 2048 B)"
  assert (f"{point} did not finish within 5 s" in results[0][1]
          or f"a process of the job failed during {point}" in results[0][1]), results[0][1][-1500:]
  recs = _records(out)
  assert [r["status"] for r in recs] == ["ok", "failed"]
  assert recs[1]["point"] == 2 and point in recs[1]["reason"]
  meta = _meta(out)
  assert meta["status"] == "failed" and point in meta["reason"]


def test_training_runs_as_a_distributed_job(tmp_path):
  """microbench-train across 2 processes x 2 devices (dp x tp) matches the same run in one process."""
  import subprocess
  import sys
  from support import ROOT, clean_env

  common = ["--model=gpt2", "--size=tiny", "--batch=4", "--seq_len=32", "--steps=3", "--warmup_steps=1"]
  out = tmp_path / "dist"
  results = finish_job(start_job([*common, "--parallelism=dp:2,tp:2", f"--outdir={out}"], 2,
                                 devices_per_process=2, hosts=["h0", "h1"], module="microbench.cli.train"))
  for code, _, err in results:
    assert code == 0, err[-2000:]
  single = tmp_path / "single"
  r = subprocess.run([sys.executable, "-m", "microbench.cli.train", *common, "--parallelism=dp:1",
                      f"--outdir={single}"], capture_output=True, text=True, env=clean_env(JAX_NUM_CPU_DEVICES="1"),
                     cwd=ROOT, timeout=240)
  assert r.returncode == 0, r.stderr[-2000:]

  def losses(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
      return [rec["loss"] for rec in map(json.loads, f) if "loss" in rec and "step" in rec]

  dist, one = losses(out), losses(single)
  assert len(dist) == 3 and all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(dist, one)), (dist, one)


def test_a_study_preset_runs_across_processes_with_the_launcher(tmp_path):
  """--preset=study-dp-pp through microbench-launch, 2 processes x 4 CPU devices: pp:2 over the processes (each
  stage in its own process, activations and gradients cross between them), dp:4 inside; the losses equal the
  same preset in one process of 8 devices."""
  import subprocess
  import sys
  from support import ROOT, clean_env

  common = ["--preset=study-dp-pp", "--steps=3", "--warmup_steps=1", "--nomeasure_overheads"]
  runs = {}
  for name, launch in (("two", ["-m", "microbench.cli.launch", "--num_processes=2", "--devices_per_process=4",
                                "--timeout=300", f"--log_dir={tmp_path / 'logs'}", "--", sys.executable]),
                       ("one", [])):
    out = tmp_path / name
    env = clean_env(**({} if launch else {"JAX_NUM_CPU_DEVICES": "8"}))
    r = subprocess.run([sys.executable, *launch, "-m", "microbench.cli.train", *common, f"--outdir={out}"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
      runs[name] = [json.loads(line) for line in f]
  config = runs["two"][0]
  assert config["processes"] == 2 and config["parallelism"] == "pp:2,dp:4" and config["preset"] == "study-dp-pp"
  assert "16 microbatches, gpipe" in config["preset_note"]
  two, one = ([r["loss"] for r in recs if r["kind"] == "step"] for recs in (runs["two"], runs["one"]))
  assert len(two) == 3 and all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(two, one)), (two, one)
  assert runs["two"][-1]["comm"]["collective-permute"]["count"] > 0
