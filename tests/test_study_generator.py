"""The job-mix generator: entropy and its bins, labellings (enumerated and rejection-sampled), patterns,
placement classes and scores on described machines, concrete placements, seeds and the plan folder."""

from __future__ import annotations

import json
import math
import random

import pytest

from microbench.study import generator as gen
from microbench.study import machines as mm
from microbench.study import placement


def test_entropy_and_bins_by_hand():
  assert gen.entropy(["dp", "dp"], [4, 4]) == 0.0
  assert gen.entropy(["dp", "fsdp"], [4, 4]) == pytest.approx(math.log(2))
  # p = (.5, .25, .25): H = 1.0397; m = 3, k = 4: H_max = ln 3 -> 0.946, high
  h = gen.entropy(["a", "a", "b", "c"], [2, 2, 2, 2])
  assert h == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
  assert gen.entropy_bin(h, 3, 4) == ("high", pytest.approx(h / math.log(3)))
  # p = (.75, .25): H / ln 3 = 0.512 -> medium; GPU shares, not job counts, weigh the strategies
  assert gen.entropy_bin(gen.entropy(["a", "a", "a", "b"], [2, 2, 2, 2]), 3, 4)[0] == "medium"
  assert gen.entropy(["a", "b"], [6, 2]) == gen.entropy(["a", "a", "a", "b"], [2, 2, 2, 2])
  # min(k, m): two jobs of three feasible strategies can reach only ln 2
  assert gen.entropy_bin(math.log(2), 3, 2)[0] == "high"
  assert gen.entropy_bin(0.29 * math.log(3), 3, 3)[0] == "low"
  assert gen.entropy_bin(0.31 * math.log(3), 3, 3)[0] == "medium"
  assert gen.entropy_bin(0.0, 1, 5) == ("low", 0.0)  # one strategy: H_max taken as 1, as the study


def test_labellings_enumerated_and_sampled_fill_the_same_bins():
  slots = [2, 2, 2, 2]
  per = [["dp", "fsdp", "dp+pp"]] * 4
  exact = gen.labellings(slots, per, 50, 5000, (0.3, 0.7), random.Random(0))
  sampled = gen.labellings(slots, per, 50, 10, (0.3, 0.7), random.Random(0))  # 81 > 10: rejection sampling
  for labs in (exact, sampled):
    for lab, b in labs:
      assert gen.entropy_bin(gen.entropy(lab, slots), 3, 4)[0] == b
    keys = [tuple(sorted(zip(lab, slots))) for lab, _ in labs]
    assert len(keys) == len(set(keys))  # distinct up to reordering equal jobs
  # 15 multisets of 3 strategies over 4 equal jobs: one strategy (3, low), two (3+1: 6, 2+2: 3; medium),
  # three (2+1+1: 3, high)
  assert sorted(b for _, b in exact) == ["high"] * 3 + ["low"] * 3 + ["medium"] * 9
  assert {b for _, b in sampled} == {"low", "medium", "high"}
  assert gen.labellings([2, 4], [["dp"], []], 4, 5000, (0.3, 0.7), random.Random(0)) == []


def test_patterns_follow_the_study():
  feasible = frozenset({8, 16, 32, 64, 224, 256, 512, 1024})
  assert gen.pattern_a(2040, 10, 8, feasible) == []  # 2040 / k is never a job size
  assert gen.pattern_a(1024, 8, 8, feasible) == [(512, 512), (256,) * 4]
  e = gen.pattern_e(2040, 255, 8, gen.TIERS, 1, feasible, random.Random(1))
  assert e == tuple(sorted(e, reverse=True)) and sum(e) <= 2040 and set(e) <= feasible
  assert gen.pattern_e(2040, 255, 8, gen.TIERS, 1, feasible, random.Random(1)) == e  # seeded
  b = gen.pattern_b(1024, 8, 8, 0.5, feasible)
  assert b and all(p[i] >= p[i + 1] for p in b for i in range(len(p) - 1))
  d = gen.pattern_d(1024, 1024, 3, 8, 1.2, feasible)
  assert d is not None and d[0] > d[-1]


def test_machine_levels_and_presets():
  leo = mm.parse("leonardo")
  assert (leo.q1, leo.q2, leo.q3, leo.total_gpus) == (4, 40, 720, 2040)
  lumi = mm.parse("lumi")  # JobPlacer's LUMI.toml switches and cabinets; the artifact's q2/q3 for the classes
  assert (lumi.q1, lumi.q2, lumi.q3, lumi.class_q2, lumi.class_q3) == (8, 64, 1024, 128, 15744)
  tb = mm.parse("testbed:racks=4,hosts_per_rack=2,groups=2")
  assert (tb.nodes, tb.q1, tb.q2, tb.q3, len(tb.groups())) == (8, 1, 2, 4, 2)
  assert tb.l1_of(5) == 2 and tb.group_of(5) == 1
  for bad, msg in (("summit", "unknown machine"), ("leonardo:nodes=x", "integer"), ("leonardo:racks=2", "testbed"),
                   ("custom:nodes=4", "needs"), ("leonardo:gpu=V100", "unknown GPU"),
                   ("leonardo:queue=fair", "testbed"), ("testbed:queue=wfq", "fifo, fair")):
    with pytest.raises(mm.MachineError, match=msg):
      mm.parse(bad)
  assert mm.parse("testbed").queue == "fifo" and mm.parse("testbed:queue=fair").queue == "fair"


def test_node_map_describes_a_real_allocation(tmp_path):
  path = tmp_path / "nodes.txt"
  path.write_text("# host group l1\nlrdn0001 0 0\nlrdn0002 0 0\nlrdn0100 0 3\nlrdn2000 1 40\n")
  m = mm.parse("leonardo", str(path))
  assert m.nodes == 4 and m.hostname(2) == "lrdn0100"
  assert mm.classify(m, [0, 1]) == "intra-l1" and mm.classify(m, [0, 2]) == "intra-group"
  assert mm.classify(m, [0, 3]) == "inter-group"
  path.write_text("lrdn0001 0\n")
  with pytest.raises(mm.MachineError, match="hostname group l1"):
    mm.parse("leonardo", str(path))


def test_placement_classes_scores_and_rules():
  assert mm.CLASSES == {"intra-l1": 1.0, "intra-group-same-l1-4": 1.2, "intra-group-same-l1-2": 1.5,
                        "intra-group": 2.0, "inter-group-same-l1-4": 2.25, "inter-group-same-l1-2": 2.5,
                        "inter-group": 3.0}
  leo = mm.parse("leonardo")
  assert mm.feasible_classes(leo, "dp", 8) == ["intra-l1", "intra-group", "inter-group"]
  assert mm.feasible_classes(leo, "fsdp", 8) == ["intra-l1"]  # same-l1-2 needs more than 2 q1 = 8 GPUs
  assert mm.feasible_classes(leo, "fsdp", 16) == ["intra-l1", "intra-group-same-l1-2", "inter-group-same-l1-2"]
  assert "intra-l1" not in mm.feasible_classes(leo, "dp+pp", 64)  # intra-l1 is capped at q2 = 40 GPUs
  assert mm.feasible_classes(leo, "dp+pp+tp", 224) == ["intra-group-same-l1-4", "inter-group-same-l1-4",
                                                       "inter-group"]
  # 512 GPUs in chunks of 4 nodes need 32 L1 switches: more than a group's 18, so only across groups
  assert mm.feasible_classes(leo, "dp+pp+tp", 512) == ["inter-group-same-l1-4", "inter-group"]
  # 1024 GPUs: above q3 = 720, and 64 switches of 4 free nodes are more than 510 nodes have
  assert mm.feasible_classes(leo, "dp+pp+tp", 1024) == ["inter-group"]
  one_group = mm.parse("testbed")
  assert mm.feasible_classes(one_group, "dp", 2) == ["intra-l1", "intra-group"]  # no second group
  assert gen.placement_bin(1.66, (1.67, 2.33)) == "low" and gen.placement_bin(2.33, (1.67, 2.33)) == "high"


def test_placements_land_in_their_class_without_sharing_nodes():
  leo = mm.parse("leonardo:nodes=400")
  jobs = [(224, "intra-group-same-l1-4"), (64, "inter-group-same-l1-2"), (32, "intra-l1"), (16, "inter-group"),
          (16, "intra-group"), (16, "intra-group-same-l1-2"),
          (512, "inter-group-same-l1-4")]
  for seed in range(5):
    nodes = placement.place(leo, jobs, seed)
    assert nodes is not None
    flat = [n for ns in nodes for n in ns]
    assert len(flat) == len(set(flat))
    for (gpus, cls), ns in zip(jobs, nodes):
      assert len(ns) == gpus // 4 and mm.classify(leo, ns) == cls, (cls, ns)
  assert placement.place(leo, jobs, 0) == placement.place(leo, jobs, 0)
  assert placement.place(leo, [(4000, "inter-group")], 0) is None


def test_classify_catches_a_wrong_placement():
  """Mutation for the test above: nodes from two switches are not intra-l1, unchunked ones not same-l1."""
  leo = mm.parse("leonardo")
  assert mm.classify(leo, [0, 10]) != "intra-l1"
  assert mm.classify(leo, [0, 10, 1, 11]) != "intra-group-same-l1-2"
  assert mm.classify(leo, [0, 1, 10, 11]) == "intra-group-same-l1-2"


def test_small_jobs_share_a_node_on_a_dgx():
  dgx = mm.parse("dgx")
  nodes = placement.place(dgx, [(4, "intra-l1"), (2, "intra-l1"), (2, "intra-l1")], 0)
  assert nodes == [[0], [0], [0]]
  assert placement.first_slots(dgx, [4, 2, 2], nodes) == [0, 4, 6]  # each job its own GPUs
  assert placement.place(dgx, [(4, "intra-l1"), (4, "intra-l1"), (2, "intra-l1")], 0) is None


def _settings(seed: int = 42, **kw) -> gen.Settings:
  return gen.Settings(mm.parse("testbed:racks=4,hosts_per_rack=4,groups=2"), size_divisor=4, n_per_bin=1,
                      seed=seed, **kw)


def test_generate_is_seeded_and_covers_bins():
  a, dropped = gen.generate(_settings())
  b, _ = gen.generate(_settings())
  c, _ = gen.generate(_settings(seed=7))
  assert json.dumps(a) == json.dumps(b) and json.dumps(a) != json.dumps(c)
  assert {e["pattern"]["family"] for e in a} == {"A", "E"}
  assert {e["entropy_bin"] for e in a} == {"low", "medium", "high"}
  assert len({e["placement_bin"] for e in a}) >= 2
  for e in a:
    m = _settings().machine
    flat = [n for j in e["jobs"] for n in j["nodes"]]
    assert len(flat) == len(set(flat)) and sum(j["gpus"] for j in e["jobs"]) <= m.total_gpus
    assert e["placement_score"] == pytest.approx(
        sum(mm.CLASSES[c] for c in e["placement_class_vector"]) / len(e["jobs"]), abs=1e-4)
    assert e["formed_score"] == pytest.approx(
        sum(mm.CLASSES[j["placement_class"]] for j in e["jobs"]) / len(e["jobs"]), abs=1e-4)
    assert all(mm.satisfies(m, j["nodes"], j["placement_class"]) for j in e["jobs"] if len(j["nodes"]) > 1)
  # the 3x3 grid is interleaved, so a capped prefix spans as many cells as it can
  capped, _ = gen.generate(_settings(max_experiments=4))
  assert [e["id"] for e in capped] == ["e000", "e001", "e002", "e003"]
  assert len({(e["placement_bin"], e["entropy_bin"]) for e in capped}) == 4
  assert set(dropped) == {"no_labelling", "no_placement_class", "unplaceable"}


def test_settings_are_checked():
  with pytest.raises(gen.PlanError, match="patterns"):
    gen.generate(_settings(patterns=("A", "Z")))
  with pytest.raises(gen.PlanError, match="utilisation"):
    gen.generate(_settings(rho_min=0.9, rho_max=0.5))
  tiny = gen.Settings(mm.parse("testbed:racks=1,hosts_per_rack=2"), size_divisor=1)
  with pytest.raises(gen.PlanError, match="size_divisor"):
    gen.generate(tiny)


def test_manual_mix_and_plan_folder(tmp_path):
  m = mm.parse("testbed:racks=4,hosts_per_rack=2")
  e = gen.manual(m, [("dp", None, [0, 2]), ("fsdp", "llama3-8b", [1, 3, 5, 7])])
  assert [j["placement_class"] for j in e["jobs"]] == ["intra-group", "intra-group"]
  assert e["jobs"][1]["degrees"] == {"data": 1, "stages": 1, "inner": 4}
  with pytest.raises(gen.PlanError, match="already used"):
    gen.manual(m, [("dp", None, [0, 2]), ("dp", None, [2, 4])])
  path = gen.write(str(tmp_path), _settings(), [e], {})
  plan = json.loads(open(path).read())
  assert plan["experiments"] == ["experiments/e000.json"] and plan["machine"]["q2"] == 4
  assert mm.Machine.from_json(plan["machine"]) == _settings().machine
