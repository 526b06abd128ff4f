"""The study as the seed artifact runs it: the README's plan commands give the artifact's
experiments one by one (golden file: its generator's output at its commit), the JobPlacer port's packing and
fallbacks, size tables and models, and plans made inside a SLURM allocation from its topology."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from microbench.study import generator as gen
from microbench.study import machines as mm
from microbench.study import placement

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "study_artifact_plans.json")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The README's plan commands (microbench-study plan ...) as Settings; the artifact's commands are in GOLDEN.
README = {
    "leonardo": dict(machine="leonardo", patterns=("E",), n_stochastic=5, max_experiments=12, n_per_bin=1,
                     k_max=200, placement_cuts=(1.67, 2.55)),
    "lumi": dict(machine="lumi", patterns=("E",), n_stochastic=5, max_experiments=12, n_per_bin=1, k_max=100,
                 placement_cuts=(1.67, 2.55)),
    "dgx": dict(machine="dgx", patterns=("A", "E"), n_stochastic=5, max_experiments=60),
}


def _settings(name: str) -> gen.Settings:
  kw = dict(README[name])
  return gen.Settings(mm.parse(kw.pop("machine")), **kw)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dgx", "lumi", "leonardo"])
def test_readme_plans_are_the_artifacts_experiments(name):
  """Same count, same order, same mixes: pattern, labelling, entropy bin, class vector, placement bin and
  seed, experiment by experiment (Leonardo draws ~9e7 numbers for its placement vectors, as the artifact:
  ~30 s here)."""
  want = json.load(open(GOLDEN, encoding="utf-8"))[name]
  designs, dropped = gen.designs(_settings(name))
  got = [{"pattern_id": d["pattern"].id, "slots": list(d["pattern"].slots), "labelling": list(d["labelling"]),
          "entropy_bin": d["entropy_bin"]} for d in designs]
  assert len(got) == len(want) == {"leonardo": 12, "lumi": 12, "dgx": 10}[name]
  assert got == [{k: w[k] for k in ("pattern_id", "slots", "labelling", "entropy_bin")} for w in want]
  if name != "dgx":
    assert [list(d["classes"]) for d in designs] == [w["classes"] for w in want]
    assert [d["placement_bin"] for d in designs] == [w["placement_bin"] for w in want]
    assert [d["placement_seed"] for d in designs] == [w["placement_seed"] for w in want]
  assert dropped == {"no_labelling": 0, "no_placement_class": 0, "unplaceable": 0}
  if name == "dgx":  # the DGX's tiers give the (4, 2, 2) mix: 3 labellings of it among the 10
    assert sum(1 for d in designs if d["pattern"].slots == (4, 2, 2)) == 3


def test_every_designed_experiment_is_placed_and_says_how():
  experiments, dropped = gen.generate(_settings("lumi"))
  m = mm.parse("lumi")
  assert len(experiments) == 12 and dropped["unplaceable"] == 0
  tiers = {e["placement_tier"] for e in experiments}
  assert tiers <= set(placement.TIERS) and "any-nodes" in tiers  # 320 nodes packed full: see placement.py
  for e in experiments:
    flat = [n for j in e["jobs"] for n in j["nodes"]]
    assert len(flat) == len(set(flat))
    for j in e["jobs"]:
      assert j["requested_class"] in mm.CLASSES and j["placement_class"] in mm.CLASSES
      assert mm.satisfies(m, j["nodes"], j["placement_class"])
      assert bool(j["fallback"]) == (j["placer_class"] != j["requested_class"])
    assert e["placement_class_vector"] == [j["requested_class"] for j in e["jobs"]]


def test_fsdp_and_dp_pp_alternate_their_models():
  assert [gen.model_for("fsdp", i) for i in range(3)] == ["llama3-8b", "minerva-7b", "llama3-8b"]
  assert [gen.model_for("dp+pp", i) for i in range(2)] == ["llama3-8b", "minerva-7b"]
  assert gen.model_for("dp", 1) == "vit-h" and gen.model_for("dp+pp+tp", 1) == "llama3-70b"
  experiments, _ = gen.generate(_settings("dgx"))
  for e in experiments:
    for i, j in enumerate(e["jobs"]):
      assert j["model"] == gen.model_for(j["strategy"], i)
  assert {j["model"] for e in experiments for j in e["jobs"] if j["strategy"] == "fsdp"} == {"llama3-8b",
                                                                                           "minerva-7b"}


def test_size_tables():
  lumi = mm.parse("lumi:size_table=concurrent")
  s = gen.Settings(lumi)
  assert s.sizes("dp") == (16, 32) and s.sizes("dp+pp+tp") == (448, 512, 1024)  # q1 / 4 = 2
  ext = gen.Settings(mm.parse("lumi"))
  assert ext.table == "extended8" and ext.sizes("dp") == (16, 32, 64, 128)
  assert ext.placements("fsdp")[-2:] == ("intra-group", "inter-group")
  leo = gen.Settings(mm.parse("leonardo"))
  assert leo.sizes("dp") == (8, 16) and leo.min_job == 8
  assert gen.feasible_classes(leo, "dp+pp+tp", 512) == ["intra-group-same-l1-4", "inter-group-same-l1-4",
                                                       "inter-group"]  # the artifact caps no same-l1 class
  assert gen.feasible_classes(leo, "fsdp", 8) == ["intra-l1"]
  tb = gen.Settings(mm.parse("testbed"), size_divisor=8)
  assert "inter-group" not in gen.feasible_classes(tb, "dp", 2)  # one group: the class cannot exist
  assert gen.Settings(mm.parse("dgx")).sizes("dp") == (2, 4, 8)


def _machine(groups: int, l1s: int, per_l1: int) -> mm.Machine:
  return mm.parse(f"custom:gpus_per_node=4,nodes_per_l1={per_l1},l1_per_group={l1s},nodes={groups * l1s * per_l1}")


def test_placer_packs_blocks_and_falls_back():
  m = _machine(1, 2, 8)  # one group, two switches of 8 nodes
  # 12 nodes in pairs: JobPlacer takes up to 5 of 6 pairs from the richer switch, the rest from the other
  got = placement.place_tier(m, [(48, "intra-group-same-l1-2")], 3, "strict")
  nodes = got[0].nodes
  assert len(nodes) == 12 and mm.satisfies(m, nodes, "intra-group-same-l1-2")
  assert max(sum(1 for n in nodes if m.l1_of(n) == l) for l in (0, 1)) >= 6  # several pairs per switch
  # one block per switch (the toolkit's old placer) could not place DP+PP+TP at 512 GPUs as
  # intra-group-same-l1-4 on Leonardo (32 blocks, 18 switches a group) or JUPITER (15 switches a group)
  for name in ("leonardo", "jupiter"):
    machine = mm.parse(name)
    nodes = placement.place(machine, [(512, "intra-group-same-l1-4")], 0)
    assert nodes and mm.satisfies(machine, nodes[0], "intra-group-same-l1-4")
  # an intra-group job larger than the group: strict fails, relaxed spills to inter-group
  two = _machine(2, 2, 4)
  assert placement.place(two, [(40, "intra-group")], 0) is None
  placed, tier, _ = placement.place_jobs(two, [(40, "intra-group")], 0)
  assert tier == "relaxed" and placed[0].achieved == "inter-group"
  assert placed[0].fallback == "relaxed: intra-group -> inter-group"
  # intra-l1 larger than a switch: only best effort helps (intra-group)
  placed, tier, _ = placement.place_jobs(two, [(24, "intra-l1")], 0)
  assert (tier, placed[0].achieved) == ("best-effort", "intra-group")
  # same-l1-4 blocks that no group can give: relaxed to inter-group-same-l1-4
  placed, tier, _ = placement.place_jobs(two, [(48, "intra-group-same-l1-4")], 0)
  assert (tier, placed[0].achieved) == ("relaxed", "inter-group-same-l1-4")
  assert mm.satisfies(two, placed[0].nodes, "inter-group-same-l1-4")
  # inter-group needs two groups with free nodes: when only one has them, the last tier takes any nodes
  placed, tier, _ = placement.place_jobs(two, [(32, "intra-group"), (8, "inter-group")], 0)
  assert tier == "any-nodes" and placed[1].fallback.startswith("any-nodes: inter-group ->")
  assert placement.place_jobs(two, [(80, "inter-group")], 0) is None  # more nodes than the machine
  # seeded
  assert placement.place_jobs(m, [(16, "intra-group"), (8, "intra-l1")], 5) == \
      placement.place_jobs(m, [(16, "intra-group"), (8, "intra-l1")], 5)


def test_slurm_topology_and_allocation(tmp_path, monkeypatch):
  assert mm.expand_hostlist("nid00[5000-5002,5007],login1") == ["nid005000", "nid005001", "nid005002",
                                                                "nid005007", "login1"]
  assert mm.expand_hostlist("tb-h0,tb-h1") == ["tb-h0", "tb-h1"]
  conf = ("SwitchName=rack0 Nodes=tb-h[0-1]\nSwitchName=rack1 Nodes=tb-h[2-3]\n"
          "SwitchName=rack2 Nodes=tb-h[4-5]\nSwitchName=g0 Switches=rack[0-1]\nSwitchName=g1 Switches=rack2\n"
          "SwitchName=top Switches=g[0-1]\n")
  topo = mm.read_slurm_topology(conf)
  assert topo["tb-h3"] == ("g0", "rack1") and topo["tb-h4"] == ("g1", "rack2")
  # `scontrol show topology` prints Level= and LinkSpeed= too
  shown = mm.read_slurm_topology("SwitchName=rack0 Level=0 LinkSpeed=1 Nodes=a[1-2]\n"
                                 "SwitchName=core Level=1 LinkSpeed=1 Nodes=a[1-2] Switches=rack0\n")
  assert shown == {"a1": ("core", "rack0"), "a2": ("core", "rack0")}
  layout = mm.allocation_layout(["tb-h5", "tb-h0", "tb-h1", "tb-h4"], topo)
  assert layout == (("tb-h5", 0, 0), ("tb-h0", 1, 1), ("tb-h1", 1, 1), ("tb-h4", 0, 0))
  with pytest.raises(mm.MachineError, match="no switch"):
    mm.allocation_layout(["x9"], topo)
  # plan inside an allocation: hosts from SLURM (a stand-in scontrol), switches from topology.conf
  (tmp_path / "topology.conf").write_text(conf)
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "scontrol").write_text("#!/bin/sh\necho tb-h0 tb-h1 tb-h2 tb-h3 tb-h4 tb-h5\n")
  (bin_dir / "scontrol").chmod(0o755)
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="tb-h[0-5]")
  out = tmp_path / "plan"
  r = subprocess.run([sys.executable, "-m", "microbench.cli.study", "plan", "--machine=testbed",
                      f"--slurm_topology={tmp_path / 'topology.conf'}", "--size_divisor=8", "--samples_per_bin=1",
                      f"--out={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  plan = json.loads((out / "plan.json").read_text())
  machine = mm.Machine.from_json(plan["machine"])
  assert machine.nodes == 6 and len(machine.groups()) == 2
  for name in plan["experiments"]:
    e = json.loads((out / name).read_text())
    for j in e["jobs"]:
      assert j["hosts"] == [f"tb-h{n}" for n in j["nodes"]]
      assert mm.satisfies(machine, j["nodes"], j["placement_class"])
  r = subprocess.run([sys.executable, "-m", "microbench.cli.study", "plan", "--machine=testbed",
                      "--slurm_topology=auto", f"--out={tmp_path / 'p2'}"], cwd=ROOT,
                     env=dict(os.environ, SLURM_JOB_NODELIST=""), capture_output=True, text=True, timeout=120)
  assert r.returncode != 0 and "SLURM_JOB_NODELIST" in r.stderr and "Traceback" not in r.stderr


def test_report_gives_sigma_per_experiment(tmp_path):
  """sigma.json: beside each key's pooled sigma, one per experiment the key ran in (the artifact's unit)."""
  from test_study_runner import FakeBackend, behave_by_kind, make_plan, run

  from microbench.study import sigma_report
  plan = make_plan(tmp_path, [[("dp", None, [0, 2]), ("dp", None, [1, 3])], [("dp", None, [0, 2])]])
  run(tmp_path, plan, FakeBackend(behave_by_kind(conc={"j1": 50.0}, small_iters=8)), iters=8)
  sigma_report.build(str(tmp_path / "res"), plots=False, say=lambda _: None)
  rows = json.load(open(tmp_path / "res" / "report" / "sigma.json", encoding="utf-8"))
  row = next(r for r in rows if r["placement_class"] == "intra-group")
  per = row["per_experiment"]
  assert set(per) == {"e000", "e001"}
  assert per["e000"]["n_concurrent"] + per["e001"]["n_concurrent"] == row["n_concurrent"]
  for x in per.values():
    assert x["boot_low"] <= x["sigma"] <= x["boot_high"]
  md = open(tmp_path / "res" / "report" / "report.md", encoding="utf-8").read()
  assert "## Sigma per experiment (the artifact's unit)" in md
  section = md.split("## Sigma per experiment")[1].split("\n## ")[0]
  for e in ("all", "e000", "e001"):
    x = row["sigma"] if e == "all" else per[e]
    line = next(ln for ln in section.splitlines() if ln.startswith(f"| dp | vit-h | 2 | intra-group | {e} |"))
    assert f" {x['sigma']:.3f} |" in line and f"[{x['boot_low']:.3f}, {x['boot_high']:.3f}]" in line
