"""What the fabric model expects beside each measured point: the machine, each scope's shape and share, LOW."""

import csv
import dataclasses
import json
import os

import pytest

from microbench.meshes.scopes import plan_scopes
from microbench.meshes.topology import Topology
from microbench.fabric import collective_model as fabric_collectives
from microbench.fabric import description, expected
from microbench.output import table
from support import run_cli


def _models(fab, topo: Topology, scopes=("scale_up", "scale_out", "rack_scale", "global")):
  return {p.name: expected.scope_model(fab, "why", p.groups, topo.shape)
          for p in plan_scopes(topo, scopes) if not p.skip_reason}


def _record(model, family: str, size: int, slower: float, n: int) -> dict:
  """An ok record measured `slower` times the model's time."""
  pred = fabric_collectives.predict(model.fabric, family, size, model.shape)
  time_us = pred.time_us * slower
  factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n}[family]
  return {"status": "ok", "bytes": size, "time_us": time_us, "busbw_gbps": size / (time_us * 1e3) * factor}


@pytest.mark.parametrize("kind,per_node,want", [
    ("NVIDIA A100-SXM4-40GB", 4, "leonardo"), ("NVIDIA A100-SXM4-80GB", 8, "dgx"),
    ("NVIDIA GB200", 4, "nvl72")])
def test_a_described_system_is_detected_from_the_gpu_kind_and_gpus_per_node(kind, per_node, want):
  found = expected.machine(None, kind, "gpu", per_node)
  assert found.fabric is not None and found.fabric.name == want and "detected" in found.source


def test_a_kind_without_a_described_system_gets_its_nvlink_only_and_says_so():
  found = expected.machine(None, "NVIDIA H100 80GB HBM3", "gpu", 8)
  assert found.fabric.scale_up_gbps == 450.0 and found.fabric.nic_gbps is None
  assert "NVLink only" in found.source
  topo = Topology(1, 2, 8)
  models = _models(found.fabric, topo)
  assert models["scale_up"].fabric is not None and models["scale_up"].shape.per_domain == 8
  assert models["scale_out"].fabric is None and "no rate for nic" in models["scale_out"].reason
  gh = expected.machine(None, "NVIDIA GH200 480GB", "gpu", 4)  # alps and jupiter both: not guessed
  assert "alps, jupiter" in gh.source and gh.fabric.nic_gbps is None


def test_cpu_unknown_kinds_and_none_give_no_expectation_with_a_reason():
  assert expected.machine(None, "cpu", "cpu", 4).fabric is None
  assert "testbed" in expected.machine(None, "cpu", "cpu", 4).source
  assert expected.machine(None, "Some GPU 9000", "gpu", 8).fabric is None
  assert expected.machine("none", "NVIDIA A100-SXM4-80GB", "gpu", 8).fabric is None
  with pytest.raises(description.FabricError):
    expected.machine("atlantis", "cpu", "cpu", 1)


def test_groups_that_share_a_node_share_its_nics():
  """On a DGX (8 NICs per node) the scale_out scope is 8 rails at once, one per GPU: each gets one NIC, so a
  2-node all-reduce expects one HDR port's 25 GB/s of busbw, not the node's 200. The same group alone gets all."""
  dgx = description.system("dgx")
  topo = Topology(1, 2, 8)
  rail = _models(dgx, topo)["scale_out"]
  assert rail.shape.ranks == 2 and rail.fabric.nics_per_node == 1  # dgx: a node per leaf, 1x1x1x2
  assert any("share of each nic unit" in n for n in rail.notes)
  rec = _record(rail, "all_reduce", 1 << 30, 1.0, 2)
  fields = expected.point(rail, "all_reduce", rec)
  assert fields["expected_busbw_gbps"] == pytest.approx(25.0, rel=0.01) and fields["expected_bound"] == "nic"
  plan = next(p for p in plan_scopes(topo, ["scale_out"]))
  alone = expected.scope_model(dgx, "", plan.groups[:1], topo.shape)  # mutant: concurrency ignored
  assert expected.point(alone, "all_reduce", rec)["expected_busbw_gbps"] == pytest.approx(200.0, rel=0.01)


def test_groups_across_racks_share_the_uplinks_on_the_testbed():
  fab = description.parse("testbed:racks=2,hosts_per_rack=2,host_rate=800mbit,uplink_rate=100mbit")
  topo = Topology(2, 2, 1)
  models = _models(fab, topo)
  assert models["scale_out"].shape.text() == "1x2x2x1"  # one group of all 4 hosts: the whole uplink
  assert models["scale_out"].fabric.leaf_up_gbps == pytest.approx(0.0125)
  assert models["rack_scale"].shape.text() == "1x2x1x1"  # in-rack pairs: the NICs, no uplink


def test_a_point_far_below_at_a_bandwidth_bound_size_is_low_and_only_then():
  dgx = description.system("dgx")
  model = _models(dgx, Topology(1, 2, 8))["global"]
  big = expected.point(model, "all_reduce", _record(model, "all_reduce", 1 << 30, 3.0, 16))
  assert big["low"] and big["vs_expected"] == pytest.approx(1 / 3) and big["expected_bound"] != "latency"
  fine = expected.point(model, "all_reduce", _record(model, "all_reduce", 1 << 30, 1.8, 16))
  assert not fine["low"]  # 0.56 x: above LOW_RATIO
  small = expected.point(model, "all_reduce", _record(model, "all_reduce", 1024, 10.0, 16))
  assert small["expected_bound"] == "latency" and not small["low"]  # slow, but latency-bound: not flagged
  # Mutant: flagging by the ratio alone would flag the latency-bound point.
  assert small["vs_expected"] < expected.LOW_RATIO
  assert expected.point(model, "some_custom_collective", dict(big, time_us=1.0)) == {}


def test_the_table_shows_expected_beside_measured_and_flags_low():
  row = {"status": "ok", "bytes": 1 << 30, "count": 1 << 28, "dtype": "float32", "scope": "global",
         "group_size": 16, "num_groups": 1, "time_us": 100.0, "algbw_gbps": 10.0, "busbw_gbps": 18.75, "wrong": 0}
  assert " - " in table.format_row(row) and "LOW" not in table.format_row(row)
  low = dict(row, expected_busbw_gbps=75.0, vs_expected=0.25, expected_bound="nic", low=True)
  text = table.format_row(low)
  assert "75.000" in text and "0.25" in text and "LOW (0.25 x expected, nic-bound)" in text
  assert len(table.HEADER.split()) == len(text.split()[:len(table.HEADER.split())])


def test_a_sweep_records_the_expectation_in_rows_csv_and_meta(tmp_path):
  """A CPU sweep read against a fabric far faster than it: every bandwidth-bound point is LOW, the rest not;
  the fields are in results.jsonl and results.csv, the model's assumptions per scope in meta.json."""
  out = tmp_path / "run"
  r = run_cli(["--collectives=all_reduce", "--topology=racks:2,nodes:2,gpus:1", "--nodes_per_rack=2",
               "--fabric=testbed:racks=2,hosts_per_rack=2,host_rate=1000gbit,uplink_rate=500gbit",
               "--min_bytes=1K", "--max_bytes=4M", "--step_factor=64", "--samples=3", f"--outdir={out}"])
  assert r.returncode == 0, r.stderr[-2000:]
  recs = [json.loads(l) for l in open(out / "results.jsonl")]
  assert recs and all("expected_busbw_gbps" in x and "vs_expected" in x for x in recs)
  assert any(x["low"] for x in recs) and all(x["low"] == (x["expected_bound"] != "latency") for x in recs)
  assert "LOW (" in r.stdout and "# expected: testbed" in r.stdout
  with open(out / "results.csv") as f:
    header = next(csv.reader(f))
  assert {"expected_busbw_gbps", "vs_expected", "low"} <= set(header)
  meta = json.load(open(out / "meta.json"))["expected"]
  assert meta["low_ratio"] == expected.LOW_RATIO and set(meta["scopes"]) == {"scale_out", "rack_scale"}
  assert meta["scopes"]["scale_out"]["shape"] == "1x2x2x1" and meta["scopes"]["scale_out"]["fabric"]


@pytest.mark.slow
def test_fabric_none_and_a_bad_fabric(tmp_path):
  r = run_cli(["--collectives=all_reduce", "--max_bytes=4K", "--samples=2", "--fabric=none",
               f"--outdir={tmp_path / 'a'}"])
  assert r.returncode == 0 and "# expected: none (--fabric=none" in r.stdout
  assert json.load(open(tmp_path / "a" / "meta.json"))["expected"]["lines"] == []
  bad = run_cli(["--fabric=atlantis", f"--outdir={tmp_path / 'b'}"])
  assert bad.returncode == 2 and "unknown fabric 'atlantis'" in bad.stderr and "Traceback" not in bad.stderr


def test_the_report_summary_and_problems_carry_the_expectation():
  from microbench.report import tables  # pylint: disable=g-import-not-at-top
  base = {"status": "ok", "collective": "all_reduce", "scope": "global", "dtype": "float32", "group_size": 16,
          "time_us": 100.0, "wrong": 0}
  recs = [dict(base, bytes=1 << 20, busbw_gbps=10.0, expected_busbw_gbps=12.0, vs_expected=0.83, low=False,
               expected_bound="nic", expected_algorithm="ring (auto)"),
          dict(base, bytes=1 << 30, busbw_gbps=20.0, expected_busbw_gbps=80.0, vs_expected=0.25, low=True,
               expected_bound="nic", expected_algorithm="ring (auto)")]
  (row,) = tables.summary_rows(recs)
  assert row[-4:] == (80.0, 0.25, 1, None)  # no platform form of the op to state
  (low,) = tables.problem_rows(recs)["far below the fabric model (LOW)"]
  assert low[3] == "1G" and "0.25 x expected" in low[4]
  (row,) = tables.summary_rows([{k: v for k, v in r.items() if "expected" not in k and k != "low"} for r in recs])
  assert row[-4:] == (None, None, None, None)


def test_the_emulated_cluster_describes_itself_to_its_jobs():
  """microbench-testbed gives its jobs the testbed as built (faults left out, so a planted fault shows as LOW);
  a CPU run on it reads that description, one elsewhere has none, and --fabric wins."""
  from microbench.cluster import testbed as tbm, testbed_jobs  # pylint: disable=g-import-not-at-top
  bed = tbm.Testbed(prefix="tbexp", hosts=4, racks=2, host_rate=300_000_000, uplink_rate=75_000_000,
                    queue="fair", faults=("h3:rate=0.25",))
  spec = testbed_jobs.fabric_spec(bed)
  found = expected.machine(None, "cpu", "cpu", 1, {testbed_jobs.FABRIC_ENV: spec})
  assert found.fabric.nic_gbps == pytest.approx(0.0375) and found.fabric.leaf_up_gbps == pytest.approx(0.009375)
  assert found.fabric.nodes_per_leaf == 2 and "emulated cluster" in found.source
  unshaped_up = testbed_jobs.fabric_spec(dataclasses.replace(bed, uplink_rate=None))
  assert expected.machine(None, "cpu", "cpu", 1, {testbed_jobs.FABRIC_ENV: unshaped_up}).fabric.leaf_up_gbps is None
  assert testbed_jobs.fabric_spec(dataclasses.replace(bed, host_rate=None, faults=())) is None
  assert expected.machine(None, "cpu", "cpu", 1, {}).fabric is None
  assert expected.machine("dgx", "cpu", "cpu", 1, {testbed_jobs.FABRIC_ENV: spec}).fabric.name == "dgx"
