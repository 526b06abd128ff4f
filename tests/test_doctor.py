"""microbench-doctor (docs/doctor.md): the schedule (rounds of disjoint pairs, bounded), the diagnosis (a planted
fault named exactly, a healthy partner never blamed, what it cannot resolve said), the outputs and exit codes,
on a simulated fleet up to 512 nodes; then on the emulated cluster, a slow host link, a slow uplink and a lossy
link planted on testbeds of 4 and 8 hosts, a healthy testbed under CPU load, and the same through SLURM."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import secrets
import subprocess
import sys

import pytest

from support import clean_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from microbench.doctor import diagnose, pair_rounds, simulate, survey, verdict  # pylint: disable=g-import-not-at-top
from microbench.doctor.fleet import Fleet, Test as PairTest  # pylint: disable=g-import-not-at-top
from microbench.fabric import description as fd  # pylint: disable=g-import-not-at-top


# ------------------------------------------------------------------------------------------- the schedule
def _check_rounds(rounds: list[list[tuple[int, int]]], n: int) -> None:
  for pairs in rounds:
    nodes = [x for p in pairs for x in p]
    assert len(nodes) == len(set(nodes)), f"a node twice in one round: {pairs}"
    assert all(0 <= a < b < n for a, b in pairs)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 16])
def test_circle_method_is_a_complete_round_robin(n):
  rounds = [pair_rounds.circle_round(range(n), r) for r in range(pair_rounds.full_round_count(n))]
  _check_rounds(rounds, n)
  met = [p for pairs in rounds for p in pairs]
  assert sorted(met) == sorted(itertools.combinations(range(n), 2)), "every pair exactly once"
  assert all(len(pairs) == n // 2 for pairs in rounds), "every round as full as it can be"


def test_survey_is_bounded_and_disjoint_whatever_the_fleet():
  for n, per in [(2, 2), (4, 2), (5, 5), (8, 2), (8, 4), (12, 5), (64, 8), (512, 32), (600, 18)]:
    racks = tuple(i // per for i in range(n))
    rounds = pair_rounds.survey(racks)
    assert len(rounds) == min(pair_rounds.SURVEY_ROUNDS, pair_rounds.full_round_count(n)), (n, per)
    _check_rounds(rounds, n)
    tried = {x for pairs in rounds for p in pairs for x in p}
    assert tried == set(range(n)), "every node tried"
  # Several racks: round 0 keeps pairs inside racks (every node's own link tried without an uplink).
  rounds = pair_rounds.survey(tuple(i // 32 for i in range(512)))
  assert all(a // 32 == b // 32 for a, b in rounds[0]) and len(rounds[0]) == 256
  assert len({p for pairs in rounds for p in pairs}) == 4 * 256, "no pair twice"


def test_pack_puts_no_node_twice_in_a_round():
  rounds = pair_rounds.pack([(0, 1), (1, 2), (2, 3), (0, 3), (4, 5)])
  _check_rounds(rounds, 6)
  assert rounds[0] == [(0, 1), (2, 3), (4, 5)]


# ------------------------------------------------------------------------------------------- the diagnosis
def _run(fleet: Fleet, faults: list[str], seed: int = 0, noise: float = 0.05, **settings) -> survey.Outcome:
  sim = simulate.SimulatedFleet(fleet, simulate.parse_faults(faults, fleet), noise=noise, seed=seed)
  return survey.run(fleet, sim.measure, survey.Settings(**settings))


def _names_exactly(outcome: survey.Outcome, planted: set[str]) -> None:
  """The check every diagnosis must pass: the planted parts named, nothing else, nothing left unresolved."""
  named = set(outcome.verdict.culprits)
  assert named == planted, f"named {sorted(named)}, planted {sorted(planted)}"
  assert not outcome.verdict.unresolved, outcome.verdict.unresolved
  assert verdict.exit_status(outcome) == (verdict.FOUND if planted else verdict.HEALTHY)


LEONARDO_64 = dataclasses.replace(fd.parse("leonardo"), nodes_per_leaf=8)

CASES = [  # (fleet, planted faults, the parts that must be named)
    (Fleet.dense(4, 2), ["h2:rate=0.25"], {"h2"}),
    (Fleet.dense(8, 2), ["uplink1:rate=0.25"], {"uplink1"}),  # 4 racks of 2
    (Fleet.dense(8, 4), ["h5:loss=2%"], {"h5"}),
    (Fleet.dense(16, 4), ["h3:delay=2ms"], {"h3"}),
    (Fleet.dense(16, 4, gpus_per_node=4), ["h9.gpus:rate=0.3"], {"h9.gpus"}),
    (Fleet.dense(16, 4, rails=4), ["h6.nic2:rate=0.25"], {"h6.nic2"}),
    (Fleet.dense(16, 4), ["h0:rate=0.25", "h1:rate=0.25"], {"h0", "h1"}),  # two slow nodes paired in round 0
    (Fleet.dense(64, 8, fabric=LEONARDO_64), ["h17:rate=0.25", "uplink5:rate=0.25"], {"h17", "uplink5"}),
    (Fleet.dense(512, 32), ["h100:rate=0.25"], {"h100"}),
    (Fleet.dense(512, 32), ["uplink7:rate=0.25"], {"uplink7"}),
    (Fleet.dense(512, 32), ["h300:loss=2%"], {"h300"}),
]


@pytest.mark.parametrize("fleet,faults,named", CASES, ids=[f"{c[0].nodes}n-{'+'.join(c[1])}" for c in CASES])
def test_a_planted_fault_is_named_exactly(fleet, faults, named):
  outcome = _run(fleet, faults)
  _names_exactly(outcome, named)
  assert outcome.survey_rounds <= pair_rounds.SURVEY_ROUNDS and outcome.confirm_rounds <= survey.CONFIRM_ROUNDS


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("nodes,per", [(4, 2), (8, 4), (64, 8)])
def test_a_healthy_fleet_is_healthy(nodes, per, seed):
  _names_exactly(_run(Fleet.dense(nodes, per), [], seed=seed, noise=0.15), set())


def _blame_both_ends(fleet: Fleet, results, min_partners: int = 2) -> diagnose.Verdict:
  """The naive diagnosis: every part of every slow test is bad."""
  del min_partners
  bad = {p for r in results if r.slow for p in fleet.parts(r.test)}
  return diagnose.Verdict({p: [] for p in sorted(bad)}, {}, [], set())


@pytest.mark.parametrize("fleet,faults,named", CASES[:3] + CASES[-3:-1])
def test_blaming_both_ends_of_a_slow_pair_fails_the_check(monkeypatch, fleet, faults, named):
  """Mutation test: the check above rejects a diagnosis that blames the healthy partner of a slow node."""
  monkeypatch.setattr(diagnose, "verdict", _blame_both_ends)
  outcome = _run(fleet, faults)
  with pytest.raises(AssertionError, match="named"):
    _names_exactly(outcome, named)


def test_evidence_needs_every_other_part_cleared(monkeypatch):
  """Mutation test: h0 and h2 are slow; h1 only ever met them (survey and confirmation), so nothing tells whether
  h1 is slow too: it is said to be unresolved, not blamed. Evidence that does not require a slow test's other
  parts to be cleared blames h1 for its partners' slowness."""
  fleet = Fleet.dense(6, 6)
  scale = diagnose.Scale(None, 1.0)
  survey = [(0, 1, 4.0), (1, 2, 4.0), (0, 3, 4.0), (2, 4, 4.0), (3, 4, 1.0), (4, 5, 1.0), (3, 5, 1.0)]
  confirm = [(0, 5, 4.0), (2, 3, 4.0), (1, 2, 4.0)]
  results = [diagnose.judge(PairTest("p2p", a, b, 0, r), m, None, scale) for r, (a, b, m) in enumerate(survey)]
  results += [diagnose.judge(PairTest("p2p", a, b, 0, 9, "confirm"), m, None, scale) for a, b, m in confirm]
  v = diagnose.verdict(fleet, results)
  assert set(v.culprits) == {"h0", "h2"} and list(v.unresolved) == ["h1"]
  assert "not proven healthy" in v.unresolved["h1"]
  original = diagnose.evidence
  monkeypatch.setattr(diagnose, "evidence", lambda fl, rs, block, ok: original(fl, rs, block, ok | set(
      p for r in rs for p in fl.parts(r.test))))
  assert "h1" in diagnose.verdict(fleet, results).culprits


def test_what_cannot_be_told_apart_is_said_not_guessed():
  """A node alone in its rack: every test through its link crosses its rack's uplink, so a slow one is
  `h1+uplink1`; two racks: every cross-rack pair crosses both uplinks, so a slow one is `uplink0+uplink1`.
  Named as the block, never as one of its parts. Two nodes and no model: nothing to compare with, said."""
  for fleet, fault, block in [(Fleet.dense(4, 1), "h1:rate=0.25", "h1+uplink1"),
                              (Fleet.dense(4, 1), "uplink2:rate=0.25", "h2+uplink2"),
                              (Fleet.dense(4, 2), "uplink0:rate=0.25", "uplink0+uplink1")]:
    outcome = _run(fleet, [fault])
    assert list(outcome.verdict.culprits) == [block], (fault, outcome.verdict)
    assert verdict.exit_status(outcome) == verdict.FOUND
  outcome = _run(Fleet.dense(2, 2), ["h1:rate=0.25"])
  assert not outcome.verdict.culprits and verdict.exit_status(outcome) == verdict.HEALTHY
  assert "two nodes" in verdict.table(verdict.to_json(Fleet.dense(2, 2), outcome, dict(survey.SIZES), {}))


def test_an_uplink_the_pairs_cannot_load_is_unresolved_not_guessed():
  """Leonardo's leaf uplinks carry their 10 nodes x 4 NICs: one at a tenth of its rate is slow only when many
  pairs cross it at once, and the rounds' pairs leave the other racks' uplinks unproven, so no test points at it
  alone. The doctor names nothing, says which uplinks it suspects (the planted one among them) and exits 3."""
  fab = fd.parse("leonardo")
  fleet = Fleet.dense(120, fab.nodes_per_leaf, fabric=fab, rails=4, gpus_per_node=4)
  outcome = _run(fleet, ["uplink9:rate=0.1"])
  assert not outcome.verdict.culprits and "uplink9" in outcome.verdict.unresolved
  assert all(p.startswith("uplink") for p in outcome.verdict.unresolved)
  assert verdict.exit_status(outcome) == verdict.UNRESOLVED


def test_judge_is_relative_to_the_fleet():
  t = PairTest("p2p", 0, 1)
  assert not diagnose.judge(t, 1.9, 1.0, diagnose.Scale(1.0, 0)).slow
  assert diagnose.judge(t, 2.0, 1.0, diagnose.Scale(1.0, 0)).slow
  assert not diagnose.judge(t, 2.0, 1.0, diagnose.Scale(1.5, 0)).slow, "the fleet's own efficiency is no fault"
  assert diagnose.judge(PairTest("loss", 0, 1), 0.006, None, diagnose.Scale(None, 0.0)).slow
  assert not diagnose.judge(PairTest("loss", 0, 1), 0.004, None, diagnose.Scale(None, 0.0)).slow, "below the floor"


def test_fleet_typical_survives_a_slow_node_in_half_the_pairs():
  """One slow node of four is in half of a round robin's pairs: a median over tests would call it typical;
  the median of each node's best is the healthy time."""
  tests = [PairTest("p2p", a, b) for a, b in itertools.combinations(range(4), 2)]
  measured = [(t, 4.0 if 0 in t.nodes else 1.0, None) for t in tests]
  assert diagnose.fleet_scales(measured)["p2p"].time_s == 1.0


def test_simulated_512_nodes_takes_a_bounded_number_of_rounds():
  outcome = _run(Fleet.dense(512, 32), ["h100:rate=0.25"])
  assert outcome.survey_rounds == pair_rounds.SURVEY_ROUNDS == 4
  assert 1 <= outcome.confirm_rounds <= survey.CONFIRM_ROUNDS
  assert pair_rounds.full_round_count(512) == 511


# ------------------------------------------------------------------------------------------- outputs and the CLI
def test_json_and_table_say_measured_expected_and_fleet(tmp_path):
  fleet = Fleet.dense(8, 4, fabric=fd.testbed(4, 0.025, 0.025, racks=2))
  outcome = _run(fleet, ["h5:rate=0.25"])
  doc = verdict.to_json(fleet, outcome, dict(survey.SIZES), {})
  json_path, text_path = verdict.write(str(tmp_path), doc)
  doc = json.load(open(json_path, encoding="utf-8"))
  assert doc["status"] == 1 and [c["part"] for c in doc["culprits"]] == ["h5"]
  assert doc["culprits"][0]["hosts"] == ["node5"], "the host a prolog would drain"
  ev = {e["kind"]: e for e in doc["culprits"][0]["evidence"]}["p2p"]
  assert ev["measured_gbps"] < 0.5 * ev["fleet_gbps"] and ev["expected_gbps"] and 5 not in ev["partners"]
  assert doc["rounds"]["survey"] == 4 and doc["rounds"]["total"] == 4 + doc["rounds"]["confirm"]
  text = open(text_path, encoding="utf-8").read()
  assert "BAD h5: network link of node 5 (node5)" in text and "measured" in text and "expected" in text
  assert text.rstrip().endswith("(exit 1)")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "microbench.cli.doctor", *args], capture_output=True, text=True,
                        cwd=REPO, env=clean_env(), timeout=timeout, check=False)


def test_simulate_512_nodes_from_the_command_line(tmp_path):
  r = _cli("--simulate=512", "--nodes_per_rack=32", "--fault=h100:rate=0.25", f"--out={tmp_path}")
  assert r.returncode == 1, r.stderr
  assert "512 node(s) in 16 rack(s)" in r.stdout and "4 survey round(s)" in r.stdout
  assert "BAD h100" in r.stdout and "511 rounds" in r.stdout
  r = _cli("--simulate=512", "--nodes_per_rack=32")
  assert r.returncode == 0 and "healthy" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("args,message", [
    (["--simulate=8", "--fault=h9:rate=0.5"], "no such part"),
    (["--simulate=8", "--fault=h1:speed=2"], "bad simulated fault"),
    (["--fault=h1:rate=0.5"], "only with --simulate"),
    (["--simulate=8", "--threshold=0.5"], "must be > 1"),
    (["--simulate=8", "--p2p_bytes=lots"], "p2p"),
    (["--simulate=8", "--fabric=nosuch"], "nosuch"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
  r = _cli(*args)
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_doctor_job_runs_every_rail_and_the_scale_up_with_correct_results(tmp_path):
  """Two local processes of 4 devices each, described as Leonardo nodes (4 NICs): 4 rails, one program per
  rail per kind, the node-local all-reduce, repeated operations (--reps=2); every result checked (a wrong one
  is a WRONG RESULT line), and the verdict written. Loopback is not a fabric: only the mechanics are tested."""
  from support import finish_job, start_job  # pylint: disable=g-import-not-at-top
  procs = start_job(["--fabric=leonardo", f"--out={tmp_path}", "--p2p_bytes=64K", "--samples=2", "--reps=2"], 2,
                    devices_per_process=4, hosts=["n0", "n1"], module="microbench.cli.doctor")
  results = finish_job(procs, timeout=240)
  assert all(rc in (0, 1, 3) for rc, _, _ in results), results[0][2][-3000:]
  assert not any("WRONG RESULT" in err or "Traceback" in err for _, _, err in results), results[0][2][-3000:]
  doc = json.load(open(tmp_path / "doctor.json", encoding="utf-8"))
  assert doc["rails"] == 4 and doc["hosts"] == ["n0", "n1"]
  assert {(r["kind"], r["rail"]) for r in doc["results"] if r["b"] >= 0} == {
      (k, rail) for k in ("p2p", "all_reduce", "loss") for rail in range(4)}
  assert sorted(r["a"] for r in doc["results"] if r["kind"] == "scale_up") == [0, 1]
  assert all(r["measured_s"] is not None for r in doc["results"])


# ------------------------------------------------------------------------------------------- the emulated cluster
RATES = ["--host_rate=200mbit", "--uplink_rate=200mbit"]


def _doctor_on_testbed(tmp_path, hosts: int, racks: int, *faults: str) -> tuple[subprocess.CompletedProcess, dict]:
  out = tmp_path / f"doctor-{secrets.token_hex(2)}"
  r = subprocess.run([sys.executable, "-m", "microbench.cli.testbed", f"--id=tbd{secrets.token_hex(3)}",
                      f"--hosts={hosts}", f"--racks={racks}", *RATES, *[f"--fault={f}" for f in faults], "--",
                      sys.executable, "-m", "microbench.cli.doctor", f"--out={out}"],
                     capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=240, check=False)
  assert os.path.exists(out / "doctor.json"), r.stderr[-3000:]
  return r, json.load(open(out / "doctor.json", encoding="utf-8"))


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
@pytest.mark.parametrize("hosts,racks,fault,part", [
    (4, 2, "h2:rate=0.25", "h2"),
    (8, 4, "uplink1:rate=0.25", "uplink1"),
    (4, 1, "h1:loss=5%", "h1"),
], ids=["host_link_4", "uplink_8", "lossy_4"])
def test_doctor_names_the_planted_part_on_the_testbed(tmp_path, hosts, racks, fault, part):
  r, doc = _doctor_on_testbed(tmp_path, hosts, racks, fault)
  assert [c["part"] for c in doc["culprits"]] == [part], (doc["culprits"], doc["unresolved"])
  assert doc["status"] == 1 and r.returncode == 1 and not doc["unresolved"]
  assert doc["racks"] == [i // (hosts // racks) for i in range(hosts)], "racks read from the testbed"
  assert f"BAD {part}" in r.stdout


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
def test_doctor_names_nothing_on_a_healthy_testbed_under_load(tmp_path):
  hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
  try:
    for _ in range(2):
      r, doc = _doctor_on_testbed(tmp_path, 4, 2)
      assert doc["status"] == 0 and not doc["culprits"] and not doc["unresolved"], (doc["culprits"],
                                                                                   doc["unresolved"])
      assert r.returncode == 0 and "healthy" in r.stdout
  finally:
    for h in hogs:
      h.kill()
      h.wait()


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_slurm")
def test_doctor_through_slurm_names_the_planted_part(tmp_path, tmp_path_factory):
  """scripts/slurm_doctor.sbatch on a SLURM of 4 testbed hosts in 2 racks with h3's link at a quarter of its
  rate: srun starts one doctor per node in the allocation, the job fails with exit 1 and names h3."""
  from microbench.cluster import slurm_testbed as stb  # pylint: disable=g-import-not-at-top
  from microbench.cluster import testbed as tbm  # pylint: disable=g-import-not-at-top
  bed = tbm.Testbed.new(hosts=4, racks=2, host_rate=200_000_000, uplink_rate=200_000_000, faults=("h3:rate=0.25",))
  bed.up()
  try:
    # a short work folder: munged's and slurmd's socket paths must fit in 108 bytes
    with stb.SlurmTestbed(bed, str(tmp_path_factory.mktemp("slurm")), slurmd_timeout=10) as cluster:
      _, state, code = cluster.sbatch(["--nodes=4", "--gpus-per-node=1", f"--output={tmp_path}/doctor.out",
                                       "scripts/slurm_doctor.sbatch", f"--out={tmp_path}/doctor"],
                                      cwd=REPO, env=clean_env(), timeout=240)
      log = open(tmp_path / "doctor.out", encoding="utf-8").read()
      assert (state, code) == ("FAILED", "1:0"), log[-3000:]
  finally:
    bed.down()
  doc = json.load(open(tmp_path / "doctor" / "doctor.json", encoding="utf-8"))
  assert [c["part"] for c in doc["culprits"]] == ["h3"] and not doc["unresolved"], (doc["culprits"], doc["unresolved"])
  assert doc["hosts"] == [bed.host_name(i) for i in range(4)] and doc["racks"] == [0, 0, 1, 1]
  assert f"BAD h3: network link of node 3 ({bed.host_name(3)})" in log


@pytest.mark.parametrize("settings,message", [
    (dict(threshold=1.0), "--threshold=1.0 must be > 1"),
    (dict(sizes=(("p2p", 2), ("all_reduce", 4096))), "--p2p_bytes must be at least 4 bytes"),
    (dict(sizes=(("p2p", 0), ("all_reduce", 3))), "--all_reduce_bytes must be at least 4 bytes"),
    (dict(survey_rounds=0), "--survey_rounds=0 must be >= 1"),
])
def test_the_library_refuses_what_the_command_line_refuses(monkeypatch, settings, message):
  """A doctor run started from Python is refused with the command line's line; without the check (a mutant)
  the same request would run."""
  fleet = Fleet.dense(4, 4)
  with pytest.raises(survey.SettingsError, match=re.escape(message)):
    survey.run(fleet, lambda tests: {t: 1.0 for t in tests}, survey.Settings(**settings))
  monkeypatch.setattr(survey, "check", lambda s: s)
  survey.run(fleet, lambda tests: {t: 1.0 for t in tests}, survey.Settings(**settings))  # runs unrefused


def test_the_command_line_prints_the_librarys_line():
  r = _cli("--simulate=8", "--all_reduce_bytes=2")
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      "microbench-doctor: error: --all_reduce_bytes must be at least 4 bytes (one float32)"], r.stderr
