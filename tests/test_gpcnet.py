"""GPCNeT's congestors and congestion impact factor: the factor on hand-checked numbers (and
broken factors that must fail), the congestors' flows on a described testbed, the predicted factor where
congestors share the canary's uplink and where they share nothing, the proxies running the congestor
programs, and one short experiment on the emulated cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from microbench.study import congestors as cg
from microbench.study import gpcnet
from microbench.study import impact as im
from microbench.study import machines as mm
from microbench.study import predict as pr


TESTBED = "testbed:racks=4,hosts_per_rack=2,host_rate=400mbit,uplink_rate=100mbit"
ISOLATED = [1.0] * 9 + [2.0]
CONGESTED = [3.0] * 9 + [4.0]


def check_hand_computed(impact_fn) -> None:
  """The factors of ISOLATED/CONGESTED worked by hand: means 1.1 and 3.1; the 99th percentiles, linear
  between the 9th and 10th order statistics at 0.99 x 9 = 8.91: 1 + 0.91 = 1.91 and 3 + 0.91 = 3.91."""
  out = impact_fn(ISOLATED, CONGESTED)
  assert out["mean"]["cif"] == pytest.approx(3.1 / 1.1)
  assert out["p99"]["cif"] == pytest.approx(3.91 / 1.91)
  assert out["p99"]["isolated_s"] == pytest.approx(1.91) and out["p99"]["congested_s"] == pytest.approx(3.91)
  for name in ("mean", "p99"):
    f = out[name]
    assert f["low"] <= f["cif"] <= f["high"] and f["resolved"]  # every congested time exceeds every isolated one
    assert f["low"] >= 1.5 and f["high"] <= 4.0  # the ratio's extremes: 3/2 and 4/1


def test_impact_factor_on_hand_computed_numbers():
  check_hand_computed(im.impact)


def test_broken_impact_factors_fail_the_hand_computed_check(monkeypatch):
  """The check above is not vacuous: isolated and congested swapped, or the 99th percentile taken as the
  mean (or the median), each fail it."""
  with pytest.raises(AssertionError):
    check_hand_computed(lambda iso, con: im.impact(con, iso))
  with monkeypatch.context() as m:
    m.setitem(im.STATS, "p99", im.STATS["mean"])
    with pytest.raises(AssertionError):
      check_hand_computed(im.impact)
  with monkeypatch.context() as m:
    m.setattr(im, "TAIL", 50.0)
    with pytest.raises(AssertionError):
      check_hand_computed(im.impact)


def test_an_unchanged_canary_is_unresolved_and_few_samples_have_no_interval():
  same = [1.0, 1.2, 0.9, 1.1, 1.05, 0.95, 1.15, 1.0]
  out = im.impact(same, list(reversed(same)))
  assert out["mean"]["cif"] == pytest.approx(1.0) and not out["mean"]["resolved"]
  assert any(n.startswith("mean: unresolved") for n in out["notes"])
  few = im.impact([1.0, 1.1, 1.2], [2.0, 2.1, 2.2])
  assert few["mean"]["low"] is None and not few["mean"]["resolved"]
  assert any("fewer than 5" in n for n in few["notes"])
  with pytest.raises(ValueError):
    im.impact([], [1.0])


def flows_of(kind: str, nodes: list[int], message_bytes: int = 1 << 20, seed: int = 0) -> dict[tuple, float]:
  """{path: bytes} of one round of a congestor on the described testbed."""
  machine = mm.parse(TESTBED)
  spec = gpcnet.Spec("c", "congestor", kind, tuple(nodes), message_bytes)
  job = gpcnet._model(spec, machine, gpcnet.Settings(out_dir="", seed=seed), pr.Links(machine, mm.fabric_of(machine)))
  out: dict[tuple, float] = {}
  seen = set()  # a collective appears in every member's program: count it once
  for steps in job.programs.values():
    for s in steps:
      if hasattr(s, "collective") and s.collective.key not in seen:
        seen.add(s.collective.key)
        for path, size in s.collective.flows:
          out[path] = out.get(path, 0.0) + size
  return out


def test_congestor_flows_load_the_links_they_cross():
  mib = float(1 << 20)
  # all-to-all over nodes 1 (rack 0) and 3 (rack 1): S/2 each way, across both racks' uplinks.
  assert flows_of("alltoall", [1, 3]) == {
      ("node1:out", "leaf0:up", "leaf1:down", "node3:in"): mib / 2,
      ("node3:out", "leaf1:up", "leaf0:down", "node1:in"): mib / 2}
  # incast into node 0: its rack-mate directly, the other rack's two hosts through leaf0's down link.
  inc = flows_of("incast", [0, 1, 2, 3])
  assert inc == {("node1:out", "node0:in"): mib, ("node2:out", "leaf1:up", "leaf0:down", "node0:in"): mib,
                 ("node3:out", "leaf1:up", "leaf0:down", "node0:in"): mib}
  # broadcast from node 0 along the chain 0 -> 2 -> 4: S on every hop.
  assert flows_of("broadcast", [0, 2, 4]) == {("node0:out", "leaf0:up", "leaf1:down", "node2:in"): mib,
                                               ("node2:out", "leaf1:up", "leaf2:down", "node4:in"): mib}
  # permutation: every rank sends S to another, the same targets for the same seed, others for another.
  perm = flows_of("permutation", [0, 2, 4, 6], seed=3)
  assert len(perm) == 4 and set(perm.values()) == {mib}
  assert {p[0] for p in perm} == {f"node{n}:out" for n in (0, 2, 4, 6)}
  assert {p[-1] for p in perm} == {f"node{n}:in" for n in (0, 2, 4, 6)}
  assert perm == flows_of("permutation", [0, 2, 4, 6], seed=3)
  assert any(flows_of("permutation", [0, 2, 4, 6], seed=s) != perm for s in range(4, 8))
  for s in range(20):
    p = cg.derangement(5, s)
    assert sorted(p) == list(range(5)) and all(p[i] != i for i in range(5))


def predicted(canary: str, congestors: list[str], **kw) -> dict:
  machine = mm.parse(TESTBED)
  s = gpcnet.Settings(out_dir="", **kw)
  c = gpcnet.parse_canary(canary, machine)
  congs = gpcnet.size_congestors(machine, gpcnet.parse_congestors(congestors, machine, c), s)
  return gpcnet.prediction(machine, c, congs, s)


@pytest.mark.parametrize("kind,across,inside", [
    ("alltoall", "alltoall@1,3", "alltoall@4,5"),
    ("incast", "incast@1,3,5", "incast@4,5"),
    ("broadcast", "broadcast@3,1", "broadcast@6,7"),
    ("permutation", "permutation@1,3", "permutation@6,7"),
])
def test_congestors_across_the_canary_uplink_are_predicted_to_slow_it_and_inside_other_racks_not(kind, across, inside):
  near = predicted("all_reduce:1M@0,2", [across])
  assert near["cif"] > 1.3 and near["shared_links"], (kind, near)
  far = predicted("all_reduce:1M@0,2", [inside])
  assert far["cif"] == pytest.approx(1.0) and far["shared_links"] == [], (kind, far)


def test_a_strategy_canary_and_congestors_spread_over_the_free_nodes():
  out = predicted("dp@0,2", ["alltoall,incast"], bytes_scale=0.005)
  assert out["cif"] > 1.0  # the spread congestors (nodes 1,3,4 and 5,6,7) cross racks 0 and 1's uplinks
  machine = mm.parse(TESTBED)
  c = gpcnet.parse_canary("dp@0,2", machine)
  spread = gpcnet.parse_congestors(["alltoall,incast"], machine, c)
  assert [n for _, _, n in spread] == [(1, 3, 4), (5, 6, 7)]


def test_congestors_are_sized_to_load_their_links_for_the_asked_time():
  machine = mm.parse(TESTBED)
  c = gpcnet.parse_canary("all_reduce:1M@0,2", machine)
  s = gpcnet.Settings(out_dir="", congestor_seconds=2.0)
  (spec,) = gpcnet.size_congestors(machine, gpcnet.parse_congestors(["alltoall@1,3"], machine, c), s)
  # S/2 each way through a 100 Mbit/s (12.5 MB/s) uplink in 2 s: S = 50 MB.
  assert spec.message_bytes == pytest.approx(2 * 2.0 * 12.5e6, rel=1e-3)


def study(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "microbench.cli.study", *args], capture_output=True, text=True,
                        timeout=timeout, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("args,needle", [
    (["--canary=dp@0,2", "--congestors=nosuch@1,3"], "unknown congestor 'nosuch'"),
    (["--canary=all_reduce@0,2", "--congestors=alltoall@1,3"], "needs its size"),
    (["--canary=dp@0,2", "--congestors=alltoall@2,3"], "are the canary's"),
    (["--canary=dp@0,9", "--congestors=alltoall"], "distinct nodes in 0..7"),
    (["--canary=dp", "--congestors=alltoall"], "STRATEGY[:MODEL]@NODES"),
])
def test_bad_gpcnet_input_is_one_line(tmp_path, args, needle):
  r = study("gpcnet", f"--machine={TESTBED}", *args, f"--out={tmp_path}", "--nomeasure")
  assert r.returncode != 0 and "Traceback" not in r.stderr
  assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_prediction_only_writes_the_report(tmp_path):
  r = study("gpcnet", f"--machine={TESTBED}", "--canary=all_reduce:1M@0,2", "--congestors=incast@1,3,5",
            f"--out={tmp_path}", "--nomeasure")
  assert r.returncode == 0, r.stderr
  res = json.load(open(os.path.join(tmp_path, "gpcnet.json")))
  assert res["predicted"]["cif"] > 1.3 and "impact" not in res
  assert "Not measured" in open(os.path.join(tmp_path, "report.md")).read()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["incast", "permutation"])
def test_the_proxy_runs_a_congestor_program(tmp_path, kind):
  """Three local processes run the congestor for real (incast: two pair communicators started at once by
  its root); process 0 records each round."""
  from support import finish_job, start_job  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "c.jsonl")
  procs = start_job(["proxy", f"--congestor={kind}", "--message_bytes=64K", "--iters=3", "--warmup=0",
                     f"--records={out}"], 3, module="microbench.cli.study")
  for code, _, err in finish_job(procs):
    assert code == 0, err[-2000:]
  recs = [json.loads(line) for line in open(out)]
  assert recs[0]["schedule"] == f"congestor/{kind}" and recs[0]["gpus"] == 3
  assert len([r for r in recs if r["kind"] == "iter"]) == 3


def test_coverage_of_the_canary_window():
  rounds = [{"t_start": 0.0, "runtime_s": 4.0}, {"t_start": 5.0, "runtime_s": 10.0}]
  assert gpcnet.coverage((2.0, 12.0), rounds) == pytest.approx((2.0 + 7.0) / 10.0)
  assert gpcnet.coverage((20.0, 30.0), rounds) == 0.0
  assert gpcnet.coverage((20.0, 30.0), rounds, stopped=31.0) == 1.0  # still in its next round when stopped


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
def test_an_alltoall_across_the_canary_uplink_raises_its_impact_factor_on_the_testbed(tmp_path):
  """A 2-host all-reduce canary across racks 0 and 1, then beside an all-to-all on the two other hosts of
  those racks: both cross the same shaped uplinks, so the canary's mean slows by about 2 (1.71 and 1.99 measured)."""
  r = study("gpcnet", "--machine=testbed:racks=2,hosts_per_rack=2,host_rate=400mbit,uplink_rate=100mbit",
            "--canary=all_reduce:512K@0,2", "--congestors=alltoall@1,3", "--backend=testbed", "--iters=15",
            "--proxy_dtype=float32", "--grace=5", f"--out={tmp_path}", timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "removed testbed" in r.stderr
  res = json.load(open(os.path.join(tmp_path, "gpcnet.json")))
  assert res["predicted"]["cif"] == pytest.approx(2.0)
  assert res["impact"]["mean"]["cif"] > 1.3 and res["impact"]["mean"]["resolved"], res["impact"]
  assert min(res["measured"]["congested"]["congestor_coverage"].values()) > 0.9
