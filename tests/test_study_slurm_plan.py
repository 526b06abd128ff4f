"""The study's sbatch script plans inside its allocation: on a real SLURM over the emulated
cluster (microbench.cluster.slurm_testbed, as tests/test_slurm.py), with no plan given, the script reads the
allocation's hosts and `scontrol show topology`, plans on them, and every job instance runs on the hosts its
plan names, whose rack map gives the class recorded. Skips where SLURM or network namespaces are missing."""

from __future__ import annotations

import json
import os

import pytest

from support import clean_env
from test_slurm import REPO, records, slurm  # noqa: F401  (slurm: the module's SLURM fixture)

from microbench.study import machines as mm

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.usefixtures("needs_slurm")
def test_sbatch_plans_inside_the_allocation(slurm, tmp_path):  # noqa: F811
  plan, res = str(tmp_path / "plan"), str(tmp_path / "res")
  env = dict(clean_env(), STUDY_PLAN_FLAGS="--machine=testbed --patterns=A --strategies=dp --size_divisor=8 "
                                           "--samples_per_bin=1 --max_experiments=1")
  job, state, code = slurm.sbatch(["--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=1", "--time=10",
                                   f"--output={tmp_path}/study.out", "scripts/slurm_study.sbatch", plan, res,
                                   "--bytes_scale=0.0015", "--iters=4", "--grace=60", "--small_job_threshold=1"],
                                  cwd=REPO, env=env, timeout=300)
  log = open(tmp_path / "study.out", encoding="utf-8").read()
  assert (state, code) == ("COMPLETED", "0:0"), (job, state, log[-3000:])
  p = json.load(open(os.path.join(plan, "plan.json"), encoding="utf-8"))
  machine = mm.Machine.from_json(p["machine"])
  topo = mm.read_slurm_topology(slurm.run(["scontrol", "show", "topology"]).stdout)
  assert machine.nodes == 4 and sorted(h for h, _, _ in machine.layout) == sorted(topo)
  for host, _, l1 in machine.layout:  # the machine's switches are SLURM's racks
    assert all((machine.layout[i][2] == l1) == (topo[h][1] == topo[host][1])
               for i, (h, _, _) in enumerate(machine.layout))
  units = records(os.path.join(res, "units.jsonl"))
  assert units and all(u["status"] == "done" for u in units)
  for u in units:
    for j in u["jobs"]:
      assert j["hosts"] == [machine.layout[n][0] for n in j["nodes"]]
      assert mm.satisfies(machine, j["nodes"], j["placement_class"])
      racks = {topo[h][1] for h in j["hosts"]}
      assert (len(racks) == 1) == (j["placement_class"] == "intra-l1")
      assert j["instances"]
