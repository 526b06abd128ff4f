"""Every collective over every scope, checked against NumPy and against its compiled HLO (8 CPU devices)."""

import jax
import numpy as np
import pytest

from meshes.mesh import build_mesh, ordered_devices
from meshes.scopes import SCOPES, plan_scopes
from meshes.topology import Topology
from microbench.bench import collectives, hlo_check, program, sweep
from microbench.bench.sizes import round_count

TOPOLOGY = Topology(racks=2, nodes=2, gpus=2)  # every scope distinct: groups of 2, 4, 4 and 8


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() == 8, "tests/conftest.py sets JAX_NUM_CPU_DEVICES=8"
  return build_mesh(TOPOLOGY, ordered_devices())


PLANS = {p.name: p for p in plan_scopes(TOPOLOGY, SCOPES)}


def _program(mesh, name, scope, dtype, nbytes=96 * 4):
  coll = collectives.get(name)
  plan = PLANS[scope]
  itemsize = np.dtype(program.DTYPES[dtype]).itemsize
  count = round_count(nbytes, itemsize, coll.count_multiple(plan.group_size))
  return program.build(coll, mesh, plan, count, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", collectives.NAMES)
def test_collective_matches_numpy_and_hlo(mesh, name, scope, dtype):
  prog = _program(mesh, name, scope, dtype)
  assert prog.hlo_match.op == collectives.get(name).hlo_expect("cpu")
  assert program.check(prog) == 0
  times = program.time_runs(prog, iters=3, warmup=1, samples=2, barrier=lambda: None)
  assert times.shape == (2,) and (times > 0).all()


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("dtype", ["int32", "float16"])
def test_other_dtypes(mesh, name, dtype):
  assert program.check(_program(mesh, name, "rack_scale", dtype)) == 0


def test_group_size_not_power_of_two():
  mesh3 = build_mesh(Topology(1, 2, 3), ordered_devices()[:6])
  plan = plan_scopes(Topology(1, 2, 3), ["scale_up"])[0]
  coll = collectives.get("reduce_scatter")
  count = round_count(1000, 4, coll.count_multiple(3))
  assert count % 3 == 0
  assert program.check(program.build(coll, mesh3, plan, count, "float32")) == 0


class _WrongReduce(collectives.AllReduce):
  """A deliberately wrong expectation: the check must count the mismatches."""

  def expected(self, group, rank, in_count, start, stop):
    return super().expected(group, rank, in_count, start, stop) + (np.arange(start, stop) % 5 == 0)


def test_check_counts_wrong_elements(mesh):
  plan = PLANS["scale_up"]
  prog = program.build(_WrongReduce(), mesh, plan, 100, "float32")
  # 20 of every 100 elements differ, on all 8 devices.
  assert program.check(prog) == 8 * 20


def test_check_streams_through_buffers_longer_than_its_chunk(mesh, monkeypatch):
  monkeypatch.setattr(program, "CHECK_CHUNK", 7)
  for name in ("all_gather", "all_to_all", "reduce_scatter"):
    coll = collectives.get(name)
    prog = program.build(coll, mesh, PLANS["rack_scale"], 4 * 25, "float32")
    assert program.check(prog) == 0, name
  prog = program.build(_WrongReduce(), mesh, PLANS["scale_up"], 100, "float32")
  assert program.check(prog) == 8 * 20


def test_hlo_check_catches_a_collective_over_the_wrong_groups(mesh):
  class Misrouted(collectives.AllReduce):
    def op(self, x, axes, n):
      return jax.lax.psum(x, "gpu")  # always scale-up, whatever the scope asks

  with pytest.raises(hlo_check.HloMismatch):
    program.build(Misrouted(), mesh, PLANS["scale_out"], 64, "float32")


def test_run_point_records_a_runtime_failure_as_skipped(mesh, monkeypatch):
  cfg = sweep.SweepConfig(("all_reduce",), ("scale_up",), ("float32",), 1024, 1024, 2, 2, 0, 2, True)

  def boom(*a, **k):
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while trying to allocate")

  monkeypatch.setattr(program, "time_runs", boom)
  rec = sweep.run_point(cfg, mesh, PLANS["scale_up"], collectives.get("all_reduce"), "float32", 1024, lambda: None)
  assert rec["status"] == "skipped" and "RESOURCE_EXHAUSTED" in rec["reason"]


def test_run_point_record(mesh):
  cfg = sweep.SweepConfig(("all_gather",), ("scale_out",), ("float32",), 1000, 1000, 2, 4, 1, 3, True)
  rec = sweep.run_point(cfg, mesh, PLANS["scale_out"], collectives.get("all_gather"), "float32", 1000, lambda: None)
  assert rec["status"] == "ok" and rec["wrong"] == 0
  assert rec["count"] % 4 == 0 and rec["bytes"] == rec["count"] * 4 <= 1000
  assert rec["time_us_min"] <= rec["time_us"] <= rec["time_us_p99"]
  assert rec["algbw_gbps"] == pytest.approx(rec["bytes"] / (rec["time_us"] * 1e-6) / 1e9)
  assert rec["busbw_gbps"] == pytest.approx(rec["algbw_gbps"] * 3 / 4)
