"""Sigma predicted before the run (study.predict on the fabric model), and the report putting it beside the
measured sigma."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from microbench.study import machines as mm
from microbench.study import predict, run_plan, sigma_report
from test_study_runner import FakeBackend, behave_by_kind, make_plan, run


def test_jobs_sharing_an_uplink_are_predicted_to_slow_down_and_isolated_ones_not(tmp_path):
  shared = make_plan(tmp_path / "a", [[("dp", None, [0, 2]), ("dp", None, [1, 3])]])  # racks 0 and 1, both jobs
  isolated = make_plan(tmp_path / "b", [[("dp", None, [0, 2]), ("dp", None, [4, 6])]])  # racks 0-1 and 2-3
  # Communication only: two equal jobs through one uplink pair take exactly twice as long.
  comm_only = predict.predict(shared, bytes_scale=0.005, compute_scale=0.0)
  assert [j["sigma"] for j in comm_only["experiments"]["e000"]["jobs"]] == pytest.approx([2.0, 2.0])
  assert {j["link"] for j in comm_only["experiments"]["e000"]["jobs"]} <= {"leaf0:up", "leaf1:down", "leaf0:down",
                                                                          "leaf1:up"}
  with_compute = predict.predict(shared, bytes_scale=0.005)
  sig = with_compute["keys"]["dp-vit-h-g2-intra-group"]["sigma"]
  assert 1.5 < sig < 2.0  # compute is not shared
  apart = predict.predict(isolated, bytes_scale=0.005)
  assert apart["keys"]["dp-vit-h-g2-intra-group"]["sigma"] == pytest.approx(1.0)


def test_the_report_puts_predicted_beside_measured_sigma(tmp_path):
  plan = make_plan(tmp_path, [[("dp", None, [0, 2, 4, 6]), ("fsdp", None, [1, 3])]])
  out_dir = str(tmp_path / "res")
  pred = predict.predict(plan, bytes_scale=0.001, compute_scale=0.1)
  predict.write(out_dir, pred)  # before the run, into the folder it fills
  _, s = run(tmp_path, plan, FakeBackend(behave_by_kind(conc={"j0": 50.0})), iters=12)
  out = sigma_report.build(s.out_dir, plots=False, say=lambda m: None)
  md = open(os.path.join(out["report_dir"], "report.md")).read()
  assert "## Predicted against measured sigma" in md and "- assumed: " in md
  section = md.split("## Predicted against measured sigma")[1]
  row = next(line for line in section.splitlines() if line.startswith("| dp | vit-h | 4 | intra-group |"))
  want = pred["keys"]["dp-vit-h-g4-intra-group"]["sigma"]
  measured = out["keys"][("dp", "vit-h", 4, "intra-group")].sigma.sigma
  assert f"{want:.3f}" in row and f"{100 * (want - measured) / measured:+.1f}%" in row
  table = json.load(open(os.path.join(out["report_dir"], "sigma.json")))
  assert {r["strategy"]: r["predicted"]["sigma"] for r in table}["dp"] == pytest.approx(want)


def test_predict_needs_a_plan_and_an_output_folder(tmp_path):
  r = subprocess.run([sys.executable, "-m", "microbench.cli.study", "predict", f"--plan={tmp_path}"],
                     capture_output=True, text=True, check=False, timeout=120)
  assert r.returncode != 0 and "--out=RESULTS_FOLDER are required" in r.stderr and "Traceback" not in r.stderr
  r = subprocess.run([sys.executable, "-m", "microbench.cli.study", "predict", f"--plan={tmp_path}",
                      f"--out={tmp_path / 'r'}"], capture_output=True, text=True, check=False, timeout=120)
  assert r.returncode != 0 and "cannot read the plan" in r.stderr and "Traceback" not in r.stderr


def test_placements_are_ranked_by_predicted_interference():
  from microbench.study import machines as mm  # pylint: disable=g-import-not-at-top
  from microbench.study import ranking  # pylint: disable=g-import-not-at-top
  m = mm.parse("testbed:racks=4,hosts_per_rack=2,host_rate=400mbit,uplink_rate=100mbit")
  ranked = ranking.rank(m, [("dp", 2), ("dp", 2)], bytes_scale=0.005)
  first, last = ranked[0], ranked[-1]
  assert first["worst_sigma"] == pytest.approx(1.0) and last["worst_sigma"] > 1.8
  assert all(a["worst_sigma"] <= b["worst_sigma"] + 1e-9 for a, b in zip(ranked, ranked[1:]))
  # Last: both jobs cross the same rack's uplink; first: nothing shared.
  assert {j["placement_class"] for j in last["jobs"]} == {"intra-group"}
  racks = [{m.l1_of(n) for n in j["nodes"]} for j in last["jobs"]]
  assert racks[0] & racks[1]


def test_place_writes_the_first_and_last_as_plans(tmp_path):
  r = subprocess.run([sys.executable, "-m", "microbench.cli.study", "place", "--machine=testbed:racks=2,hosts_per_rack=2",
                      "--jobs=dp:2", "--jobs=dp:2", "--bytes_scale=0.005", f"--out={tmp_path}"],
                     capture_output=True, text=True, check=False, timeout=300)
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines()[2].startswith("| 1 | 1.000 |")
  for name in ("first", "last"):
    assert os.path.exists(tmp_path / name / "plan.json")
  bad = subprocess.run([sys.executable, "-m", "microbench.cli.study", "place", "--jobs=dp@0,1"],
                       capture_output=True, text=True, check=False, timeout=120)
  assert bad.returncode != 0 and "place wants STRATEGY:GPUS" in bad.stderr and "Traceback" not in bad.stderr


def test_per_call_latency_makes_many_small_collectives_less_contended(tmp_path):
  shared = make_plan(tmp_path / "a", [[("fsdp", None, [0, 2]), ("fsdp", None, [1, 3])]])
  plain = predict.predict(shared, bytes_scale=0.005, compute_scale=0.0)["keys"]["fsdp-llama3-8b-g2-intra-group"]
  slow_calls = predict.predict(shared, bytes_scale=0.005, compute_scale=0.0, call_us=20000.0)
  key = slow_calls["keys"]["fsdp-llama3-8b-g2-intra-group"]
  assert plain["sigma"] == pytest.approx(2.0)  # all traffic, all shared
  assert 1.0 < key["sigma"] < plain["sigma"] - 0.05 and key["alone_s"] > plain["alone_s"]
  latency_bound = predict.predict(shared, bytes_scale=0.005, compute_scale=0.0, call_us=1e7)
  assert latency_bound["keys"]["fsdp-llama3-8b-g2-intra-group"]["sigma"] < 1.05  # 10 s per call: hardly shared
  assert slow_calls["settings"]["call_us"] == 20000.0 and any("20000 us per call" in a for a in slow_calls["assumptions"])


def test_predict_fits_the_links_from_sweeps(tmp_path):
  from microbench.report import alpha_beta  # pylint: disable=g-import-not-at-top
  plan = make_plan(tmp_path / "p", [[("dp", None, [0, 2]), ("dp", None, [1, 3])]])
  run_dir = tmp_path / "sweep"
  run_dir.mkdir()
  (run_dir / "meta.json").write_text(json.dumps({"topology": {"racks": 1, "nodes": 2, "gpus": 1},
                                                 "scopes": {"scale_out": {"axes": ["rack", "node"]}}}))
  steps = alpha_beta.ring_steps("all_reduce", 2)
  alpha_beta.write_model(str(run_dir), [alpha_beta.Fit("all_reduce", "scale_out", "float32", 2, 5, 1 << 20, 16 << 20,
                                                       400.0, 0.01, "test", 0.99, 0.01, 0.02, 1.0, 0.01, steps,
                                                       400.0 / steps)])
  said: list[str] = []
  got = predict.predict(str(plan), bytes_scale=0.005, fit_from=[str(run_dir)], say=said.append)
  assert "nic fitted: 0.01 GB/s from all_reduce over scale_out (2 ranks, float32), hop 200 us" in said
  assert any("fitted from sweeps: nic" in line for line in got["fabric"])
  described = predict.predict(str(plan), bytes_scale=0.005)
  assert not any("fitted from sweeps" in line for line in described["fabric"])
  assert got["keys"] != described["keys"]  # the fitted links change the prediction
  with pytest.raises(ValueError, match="no meta.json there"):
    predict.predict(str(plan), fit_from=[str(tmp_path)])
  # The command's thin layer: the same failure is one line.
  bad = subprocess.run([sys.executable, "-m", "microbench.cli.study", "predict", f"--plan={plan}",
                        f"--out={tmp_path / 'r'}", f"--fit_from={tmp_path}"], capture_output=True, text=True,
                       check=False, timeout=120)
  assert bad.returncode != 0 and "no meta.json there" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_jobs_whose_proxies_come_from_hlo_are_derived_and_predicted(tmp_path):
  plan, res = tmp_path / "plan", tmp_path / "res"
  study = [sys.executable, "-m", "microbench.cli.study"]
  r = subprocess.run([*study, "plan", "--machine=testbed:racks=2,hosts_per_rack=2", "--jobs=dp@0,2", "--jobs=dp@1,3",
                      "--derive=dp=gpt2-tiny", f"--out={plan}"], capture_output=True, text=True, check=False, timeout=120)
  assert r.returncode == 0, r.stderr
  plan_json, experiments = run_plan.load_plan(str(plan))
  with pytest.raises(ValueError, match="derive it first"):  # the model never guesses a derived schedule
    predict.predict_experiments(mm.Machine.from_json(plan_json["machine"]), experiments)
  r = subprocess.run([*study, "predict", f"--plan={plan}", f"--out={res}", "--compute_scale=0"],
                     capture_output=True, text=True, check=False, timeout=300)
  assert r.returncode == 0, r.stderr
  assert "deriving the schedules of 2 job(s) from their training steps' HLO (2 virtual devices)" in r.stderr
  key = predict.read(str(res))["keys"]["dp-gpt2-tiny-g2-intra-group"]
  assert key["sigma"] == pytest.approx(2.0) and key["alone_s"] > 0  # communication only, one uplink pair


def test_a_latency_bound_key_is_said_to_be(tmp_path):
  shared = make_plan(tmp_path / "a", [[("fsdp", None, [0, 2]), ("fsdp", None, [1, 3])]])
  key = "fsdp-llama3-8b-g2-intra-group"
  plain = predict.predict(shared, bytes_scale=0.005, compute_scale=0.0)["keys"][key]
  assert plain["latency_share"] == pytest.approx(0.0) and "note" not in plain  # the testbed: no latency described
  slow = predict.predict(shared, bytes_scale=0.005, compute_scale=0.0, call_us=1e7)["keys"][key]
  assert slow["latency_share"] > 0.9 and slow["note"] == predict.LATENCY_BOUND
