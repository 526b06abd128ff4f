"""In place and out of place (nccl-tests' two column groups), and the broadcast's root (nccl-tests' -r).

In place, a point's programs take their input's buffer for their output (donated, `input_output_alias` in the
compiled HLO) and every operation of the timed loop writes the buffer it read; where XLA runs the op itself
out of place, the copy back into that buffer is counted per operation (`inplace_copies_per_op`), read from the
compiled program. Each check is shown to catch the bug it is for: a program that did not alias, a broadcast
from the wrong root, an in-place collective wrong in some timed repetitions.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from support import run_cli
from microbench.meshes.mesh import build_mesh, ordered_devices
from microbench.meshes.scopes import SCOPES, plan_scopes
from microbench.meshes.topology import Topology
from microbench.bench import collectives, hlo_check, program, sweep
from microbench.aot import gpu_compile

TOPOLOGY = Topology(racks=2, nodes=2, gpus=2)  # scale_up: groups of 2, rack_scale: 4, global: 8
PLANS = {p.name: p for p in plan_scopes(TOPOLOGY, SCOPES)}


@pytest.fixture(scope="module")
def mesh():
  return build_mesh(TOPOLOGY, ordered_devices())


def _config(**kw) -> sweep.SweepConfig:
  base = dict(collectives=(), scopes=(), dtypes=("float32",), min_bytes=1, max_bytes=1, step_factor=2.0, iters=10,
              warmup=1, samples=3, check=True)
  return sweep.SweepConfig(**{**base, **kw})


def test_variants_are_named_by_suffix_and_refused_where_xla_has_no_form():
  coll = collectives.get("all_reduce_max_inplace")
  assert coll.inplace and coll.redop == "max" and not collectives.get("all_reduce_max").inplace
  assert collectives.with_root("broadcast", 3).name == "broadcast_root3" and collectives.get("broadcast").root == 0
  assert collectives.with_inplace("broadcast_root3").root == 3
  assert collectives.with_root("all_reduce", 3).name == "all_reduce"  # no root: itself
  gather, scatter = collectives.with_inplace("all_gather"), collectives.with_inplace("reduce_scatter_max")
  assert (gather.in_count(64, 4), gather.out_count(64, 4)) == (64, 64)  # one buffer of S: nccl-tests' layout
  assert (scatter.in_count(64, 4), scatter.out_count(64, 4), scatter.op_elements(64, 4)) == (64, 64, 16)
  assert scatter.redop == "max" and "all_gather_inplace" not in collectives.REGISTRY  # variants kept apart
  assert collectives.get("broadcast_root3").refuses_group(4) is None
  assert "not a rank of groups of 2" in collectives.get("broadcast_root3").refuses_group(2)
  with pytest.raises(KeyError):
    collectives.get("all_reduce_inplace_inplace")


@pytest.mark.parametrize("name,dtype", [("all_reduce_max_inplace", "float32"), ("all_reduce_inplace", "int32"),
                                        ("all_to_all_inplace", "float32"), ("broadcast_root3_inplace", "bfloat16"),
                                        ("ppermute_inplace", "int32"), ("broadcast_root3", "float32"),
                                        ("all_gather_inplace", "bfloat16"), ("reduce_scatter_min_inplace", "int32"),
                                        ("reduce_scatter_avg_inplace", "float32")])
def test_in_place_and_rooted_points_are_checked_and_say_what_xla_copied(mesh, name, dtype):
  coll = collectives.get(name)
  rec = sweep.run_point(_config(dtypes=(dtype,)), mesh, PLANS["global"], coll, dtype, 4096, lambda: None)
  assert rec["status"] == "ok" and rec["wrong"] == 0, rec
  assert rec.get("root") == coll.root
  if coll.inplace:
    assert rec["inplace"] and rec["impl"].endswith(", in place")
    assert rec["inplace_copies_per_op"] in (0.0, 1.0)  # the op in its buffer, or one copy back (XLA:CPU's choice)
  if name in ("all_reduce_inplace", "reduce_scatter_avg_inplace"):  # chained, a sum grows: no known buffer holds it
    assert rec["timed_wrong"] == 0 and "compared with the check program run on its own outputs" in rec["timed_check"]
    assert "replayed from the known inputs" in rec["timed_check"]
  else:
    assert rec["timed_wrong"] == 0 and "compared (digests)" in rec["timed_check"], rec["timed_check"]


def test_latency_mode_in_place_chains_the_donated_buffer(mesh):
  rec = sweep.run_point(_config(iters=1, samples=4), mesh, PLANS["rack_scale"], collectives.get("ppermute_inplace"),
                        "float32", 4096, lambda: None)
  assert rec["status"] == "ok" and rec["wrong"] == 0 and len(rec["samples_us"]) == 4, rec


def test_an_in_place_program_that_did_not_alias_fails_the_hlo_check(mesh, monkeypatch):
  """The mutation: the same program compiled without donation has no input_output_alias."""
  compile_ = program._compile  # pylint: disable=protected-access
  monkeypatch.setattr(program, "_compile", lambda fn, specs, donate, **kw: compile_(fn, specs, False, **kw))
  with pytest.raises(hlo_check.HloMismatch, match="does not take its input's buffer"):
    program.build_check(collectives.get("all_to_all_inplace"), mesh, PLANS["global"], 64, "float32")
  with pytest.raises(hlo_check.HloMismatch, match="does not take its input's buffer"):
    program.build_timed(collectives.get("broadcast_root3_inplace"), mesh, PLANS["global"], 64, "float32", 6)


class RootIgnored(collectives.Broadcast):
  """A broadcast asked from rank 3 that broadcasts from rank 0."""
  name, root = "broadcast_root3 from rank 0", 3

  def op(self, x, axes, n, platform):
    return lax.psum(jnp.where(lax.axis_index(axes) == 0, x, jnp.zeros_like(x)), axes)


def test_a_broadcast_from_the_wrong_root_is_caught(mesh):
  point = program.build_check(RootIgnored(), mesh, PLANS["global"], 64, "float32")
  assert program.check(point) == 8 * 64  # rank 0's input where rank 3's belongs: every element differs
  assert {w["rank"] for w in point.wrong_at} == set(range(8))


class InPlaceAllToAllOneWrong(collectives.AllToAll):
  """An in-place all-to-all right as one operation, one element wrong in every timed repetition."""
  name, inplace = "all_to_all_inplace one element wrong", True

  def step(self, carry, axes, n, platform):
    y = self.op(carry[0], axes, n, platform).at[-1].add(1)
    return (y,), y


class GatherFromSliceZero(collectives.InPlaceAllGather):
  """An in-place all-gather sending the first slice of its buffer, not its own (a wrong offset)."""
  name, inplace = "all_gather_inplace from slice 0", True

  def op(self, x, axes, n, platform):
    return lax.all_gather(x[:x.shape[0] // n], axes, tiled=True)


class ScatterIntoSliceZero(collectives.InPlaceReduceScatter):
  """An in-place reduce-scatter writing its block over the next rank's slice of the buffer, not its own."""
  name, inplace = "reduce_scatter_inplace into the next slice", True

  def op(self, x, axes, n, platform):
    y = collectives.reduce_ops.reduce_scatter(x, axes, n, "sum")
    return lax.dynamic_update_slice(x, y, ((lax.axis_index(axes) + 1) % n * y.shape[0],))


@pytest.mark.parametrize("mutant", [GatherFromSliceZero, ScatterIntoSliceZero], ids=lambda m: m.name)
def test_an_in_place_gather_or_scatter_at_the_wrong_offset_is_caught(mesh, mutant):
  """The slice a rank sends from, and the slice its block lands in, are checked: so is the rest of the
  reduce-scatter's buffer, which must be the rank's input unchanged."""
  point = program.build_check(mutant(), mesh, PLANS["rack_scale"], 64, "int32")
  assert program.check(point) > 0
  ranks = {w["rank"] for w in point.wrong_at}
  assert ranks == {0, 1, 2, 3}, point.wrong_at  # every rank receives the wrong slices, or misplaces its block


def test_an_in_place_collective_wrong_in_timed_repetitions_is_caught(mesh):
  coll, plan = InPlaceAllToAllOneWrong(), PLANS["rack_scale"]
  point = program.build_check(coll, mesh, plan, 32, "float32")
  assert program.check(point) == 0
  short, long = (program.build_timed(coll, mesh, plan, 32, "float32", k) for k in (2, 6))
  _, _, carry = program.time_pairs(short, long, program.initial_carry(point), 1, 2, lambda: None)
  wrong, note = program.check_timed(point, carry, *program.chain_reps(1, 2, 2, 6))
  assert wrong == jax.device_count(), note


@pytest.mark.slow
def test_cli_refuses_what_has_no_meaning_in_one_line_and_skips_small_groups(tmp_path):
  r = run_cli(["--root=-1"])
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
      "microbench: error: --root=-1: the broadcast's source is a group rank, >= 0"), r.stderr
  r = run_cli(["--collectives=broadcast,all_gather", "--inplace=both", "--root=3", "--topology=nodes:2,gpus:4",
               "--scopes=scale_up,scale_out", "--min_bytes=1K", "--max_bytes=1K", f"--outdir={tmp_path}/run"],
              JAX_NUM_CPU_DEVICES="8")
  assert r.returncode == 0, r.stderr
  assert "# broadcast_root3 over scale_out skipped: --root=3 is not a rank of groups of 2" in r.stdout
  recs = [json.loads(line) for line in open(os.path.join(tmp_path, "run", "results.jsonl"))]
  assert {(x["collective"], x["scope"]) for x in recs} == {
      ("broadcast_root3", "scale_up"), ("broadcast_root3_inplace", "scale_up"), ("all_gather", "scale_up"),
      ("all_gather", "scale_out"), ("all_gather_inplace", "scale_up"), ("all_gather_inplace", "scale_out")}
  assert all(x["status"] == "ok" and x["wrong"] == 0 for x in recs)


# ------------------------------------------------------------------------------------------- on a GPU target

@pytest.mark.slow
@pytest.mark.gpu_compile
@pytest.mark.skipif(not gpu_compile.plugin_available(), reason="JAX's CUDA PJRT plugin is not installed")
def test_on_gpus_all_reduce_and_broadcast_run_in_place_and_the_others_copy_back(tmp_path):
  """XLA:GPU's own compiled programs: all-reduce and collective-broadcast write their operand's buffer (no
  copy in place; the out-of-place all-reduce copies its input first), all-to-all and collective-permute run out
  of place (one copy of the message per operation in place); the in-place all-gather and reduce-scatter write
  only their rank's slice besides the collective (S/n per operation). The root leads the
  collective-broadcast's groups; a root XLA did not get fails the HLO check (the mutation)."""
  r = run_cli(["--target=h100", "--topology=nodes:1,gpus:8", "--inplace=both", "--root=3", "--scopes=scale_up",
               "--collectives=all_reduce,all_to_all,broadcast,ppermute,all_gather,reduce_scatter", "--min_bytes=1M",
               "--max_bytes=1M", f"--outdir={tmp_path}/run"])
  assert r.returncode == 0, r.stderr
  recs = {x["collective"]: x for x in map(json.loads, open(os.path.join(tmp_path, "run", "results.jsonl")))}
  copies = {name: x["programs"]["long"].get("inplace_copies") for name, x in recs.items()}
  assert copies == {"all_reduce": None, "all_reduce_inplace": 0, "all_to_all": None, "all_to_all_inplace": 20,
                    "broadcast_root3": None, "broadcast_root3_inplace": 0, "ppermute": None,
                    "ppermute_inplace": 20, "all_gather": None, "all_gather_inplace": 0, "reduce_scatter": None,
                    "reduce_scatter_inplace": 0}, copies
  slice_elements = 262144 // 8
  for name in ("all_gather_inplace", "reduce_scatter_inplace"):
    assert recs[name]["programs"]["long"]["body_writes"] == slice_elements, recs[name]["programs"]["long"]
  assert recs["all_reduce_inplace"]["inplace_copies_per_op"] == 0 and recs["ppermute_inplace"]["inplace_copies_per_op"] == 1
  assert all(x["status"] == "compiled" for x in recs.values())
  assert "replica_groups={{3,0,1,2,4,5,6,7}}" in recs["broadcast_root3"]["hlo"]

  target = gpu_compile.make_target("h100", 1, 8)
  gpu_mesh = build_mesh(Topology(1, 1, 8), list(target.devices))
  plan = next(p for p in plan_scopes(Topology(1, 1, 8), ["scale_up"]) if p.name == "scale_up")

  class RootZero(collectives.Broadcast):
    name, root = "broadcast_root3 compiled from rank 0", 3

    def op(self, x, axes, n, platform):
      return lax.pbroadcast(x, axes, 0)
  with pytest.raises(hlo_check.HloMismatch, match=r"expected collective-broadcast over groups \[\[3, 0, 1, 2"):
    program.build_check(RootZero(), gpu_mesh, plan, 1024, "float32")
