"""TPU pods without a TPU (`--target=v5p|v5e|v6e`): kinds as data, slices and their scopes, XLA:TPU's forms in
the HLO check (loops without an annotated trip count, all-gather and reduce-scatter written as all-reduces,
on-chip staging, Megascale DCN transfers across slices), the algorithm XLA:TPU chose.

Tests that compile need libtpu (the `tpu-compile` extra, which .ci/run installs) and skip with that reason when
it is absent; the rest read fake device lists and HLO text.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types

import numpy as np
import pytest

from support import run_cli
from microbench.meshes import tpu_slice
from microbench.meshes.scopes import plan_scopes
from microbench.bench import collectives, hlo_check, program
from microbench.fabric import tpu_kinds
from microbench.hlo import parse
from microbench.aot import tpu_compile

needs_libtpu = pytest.mark.skipif(not tpu_compile.libtpu_available(),
                                  reason="libtpu is not installed: pip install -e '.[tpu-compile]'")


# ------------------------------------------------------------------------------------------------ kinds as data

def test_every_tpu_kind_names_a_source_for_every_figure():
  kinds = tpu_kinds.kinds()
  assert set(tpu_kinds.targets()) == {"v5e", "v5p", "v6e"}
  for kind in kinds.values():
    assert set(kind.sources) == set(kind.figures()), kind.name
    assert all(kind.source(f).strip() for f in kind.figures())
    assert kind.memory_source.startswith(tpu_kinds.MEMORY_PROVENANCE)
  # the per-chip ICI figures the datasheets give, from ports x directions x one port's rate
  assert kinds["v5p"].ici_ports * 2 * kinds["v5p"].ici_link_gbytes == 1200  # GB/s bidirectional per chip
  assert kinds["v5e"].ici_ports * 2 * kinds["v5e"].ici_link_gbytes == 400
  assert kinds["v6e"].ici_ports * 2 * kinds["v6e"].ici_link_gbytes == 800
  assert kinds["v5p"].dcn_gbytes_per_host == 50 * 4 / 8  # 50 Gb/s per chip, 4 chips a host


def test_a_spec_without_a_source_is_refused():
  d = {"peak_cite": "x", "sources": [{"figures": ["torus_dims", "ici_ports", "ici_link_gbytes", "wraparound_from",
                                                  "chips_per_host", "host_shape"], "cite": "somewhere"}]}
  with pytest.raises(ValueError, match="without: hbm_gbytes_s"):
    tpu_kinds._sources("spec.toml", d, "reported: x")  # pylint: disable=protected-access
  d["sources"].append({"figures": ["hbm_gbytes_s", "torus_dims"], "cite": "again"})
  with pytest.raises(ValueError, match="cited twice"):
    tpu_kinds._sources("spec.toml", d, "reported: x")  # pylint: disable=protected-access


def test_unknown_and_non_target_kinds_are_one_line_each():
  with pytest.raises(tpu_kinds.KindError, match="choose one of v5e, v5p, v6e"):
    tpu_kinds.target("v9x")
  with pytest.raises(tpu_kinds.KindError, match="TensorCores as devices"):
    tpu_kinds.target("v4")
  assert tpu_kinds.is_tpu_name("v5p") and tpu_kinds.is_tpu_name("V7X") and not tpu_kinds.is_tpu_name("h100")


@pytest.mark.parametrize("text,kind,want", [
    ("4x4x4", "v5p", ((4, 4, 4), 1)), ("4x4x8,slices:2", "v5p", ((4, 4, 8), 2)), ("16x16", "v6e", ((16, 16, 1), 1)),
    (" 2 x 2 , slices = 4 ", "v5e", ((2, 2, 1), 4))])
def test_slice_shapes_parse(text, kind, want):
  shape = tpu_compile.parse_slice(text, tpu_kinds.target(kind))
  assert (shape.dims, shape.slices) == want


@pytest.mark.parametrize("text,kind,match", [
    ("4x4", "v5p", "3 torus dimensions"), ("4x4x4", "v6e", "2 torus dimensions"), ("nodes:2,gpus:8", "v5p", "e.g. 4x4x4"),
    ("4x0x4", "v5p", "at least 1"), ("4x4,slices:0", "v5e", "at least 1")])
def test_bad_slices_are_one_line(text, kind, match):
  with pytest.raises(tpu_compile.TargetError, match=match) as e:
    tpu_compile.parse_slice(text, tpu_kinds.target(kind))
  assert "\n" not in str(e.value)


def test_without_libtpu_the_target_says_what_to_install(monkeypatch):
  monkeypatch.setattr(tpu_compile, "libtpu_available", lambda: False)
  with pytest.raises(tpu_compile.TargetError, match=r"pip install -e '.\[tpu-compile\]'"):
    tpu_compile.make_target("v5p", None)


# ------------------------------------------------------------------------------ slices and scopes from devices

def _fake_devices(dims, host=(2, 2, 1), slices=1, shuffle=0):
  """Devices as a TPU VM lists them: torus coords, host (process) and slice, ids in libtpu's order."""
  out = []
  hx, hy, hz = host
  per_slice_hosts = (dims[0] // hx) * (dims[1] // hy) * (dims[2] // hz)
  for s in range(slices):
    for z in range(dims[2]):
      for y in range(dims[1]):
        for x in range(dims[0]):
          h = ((z // hz) * (dims[1] // hy) + y // hy) * (dims[0] // hx) + x // hx
          out.append(types.SimpleNamespace(id=len(out), coords=[x, y, z], slice_index=s,
                                           process_index=s * per_slice_hosts + h, platform="tpu"))
  if shuffle:
    np.random.default_rng(shuffle).shuffle(out)
  return out


def _coords_of(ordered, groups):
  return [[tuple(ordered[int(p)].coords)[:3] + (tpu_compile.slice_of(ordered[int(p)]),) for p in g]
          for g in groups]


def _assert_scopes_follow_the_torus(top, ordered):
  """Each ici_<d> group is one ring along d in coordinate order; host groups are one host's chips; dcn groups
  are the same chip of every slice; slice groups are one whole slice."""
  plans = {p.name: p for p in plan_scopes(top, tpu_slice.SCOPES)}
  for d, axis in enumerate("xyz"):
    p = plans[f"ici_{axis}"]
    if p.skip_reason:
      continue
    for g in _coords_of(ordered, p.groups):
      others = {tuple(c[i] for i in range(4) if i != d) for c in g}
      assert len(others) == 1 and [c[d] for c in g] == list(range(top.dims[d])), (axis, g)
  for g in plans["host"].groups:
    assert len({ordered[int(p)].process_index for p in g}) == 1
    assert len(g) == np.prod(top.host)
  if not plans["dcn"].skip_reason:
    for g in _coords_of(ordered, plans["dcn"].groups):
      assert len({c[:3] for c in g}) == 1 and [c[3] for c in g] == list(range(top.slices))
  for g in _coords_of(ordered, plans["slice"].groups):
    assert len({c[3] for c in g}) == 1 and len(g) == np.prod(top.dims)


@pytest.mark.parametrize("dims,host,slices", [((4, 4, 4), (2, 2, 1), 1), ((4, 8, 1), (2, 2, 1), 2),
                                              ((16, 16, 1), (2, 2, 1), 1), ((2, 2, 1), (2, 2, 1), 3)])
def test_scopes_follow_the_torus_whatever_order_the_devices_come_in(dims, host, slices):
  devices = _fake_devices(dims, host, slices, shuffle=7)
  top, ordered = tpu_slice.slices_from_devices(devices)
  assert (top.dims, top.host, top.slices) == (dims, host, slices)
  assert top.total_nodes == len({d.process_index for d in devices})
  _assert_scopes_follow_the_torus(top, ordered)


def test_the_scope_check_catches_a_mapping_by_device_id():
  """Mutation: devices laid out by id instead of by coordinates put chips of different rings in one group."""
  devices = _fake_devices((4, 4, 1), shuffle=0)
  for d, i in zip(devices, np.random.default_rng(3).permutation(len(devices))):
    d.id = int(i)  # ids no longer follow the torus
  top, ordered = tpu_slice.slices_from_devices(devices)
  _assert_scopes_follow_the_torus(top, ordered)
  by_id = sorted(devices, key=lambda d: d.id)
  with pytest.raises(AssertionError):
    _assert_scopes_follow_the_torus(top, by_id)


@pytest.mark.parametrize("mutate,match", [
    (lambda ds: ds.pop(), "do not fill"),
    (lambda ds: setattr(ds[1], "coords", list(ds[0].coords)), "same chip"),
    (lambda ds: setattr(ds[0], "process_index", ds[-1].process_index), "not an aligned block|tile"),
    (lambda ds: setattr(ds[0], "coords", []), "no torus coordinates")])
def test_devices_that_are_not_whole_slices_are_refused_in_one_line(mutate, match):
  devices = _fake_devices((4, 4, 1))
  mutate(devices)
  with pytest.raises(tpu_slice.SliceError, match=match):
    tpu_slice.slices_from_devices(devices)


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize("kind,text", [("v5p", "4x4x4"), ("v5e", "4x4,slices:2"), ("v6e", "16x16"),
                                       ("v5p", "2x4x4,slices:2")])
def test_scopes_on_libtpus_own_device_lists(kind, text):
  target = tpu_compile.make_target(kind, tpu_compile.parse_slice(text, tpu_kinds.target(kind)))
  top, ordered = tpu_slice.slices_from_devices(target.devices)
  assert top.dims == target.shape.dims and top.slices == target.shape.slices
  assert top.host == tuple(tpu_kinds.target(kind).host_shape)  # libtpu's hosts are the kind's VMs
  assert target.hosts == top.total_nodes
  _assert_scopes_follow_the_torus(top, ordered)


# ---------------------------------------------------------------------------------------- XLA:TPU's HLO forms

_TPU_LOOP = """HloModule m, entry_computation_layout={(f32[64]{0})->f32[64]{0}}, num_partitions=4
%body (p: (s32[], f32[64], s32[])) -> (s32[], f32[64], s32[]) {
  %one = s32[]{:T(128)} constant(1)
  %p = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %next = s32[]{:T(128)} add(%i, %one)
  %x = f32[64]{0:T(1024)} get-tuple-element(%p), index=1
  %k = s32[]{:T(128)} get-tuple-element(%p), index=2
  %ar = f32[64]{0:T(1024)} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) tuple(%next, %ar, %k)
}
%cond (q: (s32[], f32[64], s32[])) -> pred[] {
  %limit = s32[]{:T(128)} constant(LIMIT)
  %q = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) parameter(0)
  %j = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt = pred[]{:T(512)} compare(%j, %limit), direction=LT
}
ENTRY %main (a: f32[64]) -> f32[64] {
  %zero = s32[]{:T(128)} constant(START)
  %one.1 = s32[]{:T(128)} constant(1)
  %a = f32[64]{0:T(1024)} parameter(0)
  %z = s32[]{:T(128)} copy(%zero)
  %init = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) tuple(%z, %a, %one.1)
  %w = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64]{0:T(1024)} get-tuple-element(%w), index=1
}
"""


def _loop(start=0, limit=10):
  return _TPU_LOOP.replace("START", str(start)).replace("LIMIT", str(limit))


def test_a_tpu_loops_trip_count_is_read_from_the_loop_itself():
  """XLA:TPU's optimised HLO has no known_trip_count: the count comes from `i < N`, i's start and step."""
  for start, limit, want in ((0, 10, 10), (2, 10, 8), (0, 7, 7)):
    loops = parse.while_loops(_loop(start, limit))
    assert [l.trip_count for l in loops] == [want]
    assert parse.execution_counts(_loop(start, limit))["body"] == want
  # mutations: a body that does not step the counter, or a condition that is not `i < constant`
  assert parse.while_loops(_loop().replace("add(%i, %one)", "multiply(%i, %one)"))[0].trip_count is None
  assert parse.while_loops(_loop().replace("direction=LT", "direction=NE"))[0].trip_count is None
  exp = hlo_check.Expectation(op="all-reduce", groups=np.array([[0, 1, 2, 3]]), ordered=False, dtype="float32",
                              elements=64, executions=10, in_loop=True)
  assert hlo_check.verify(_loop(), exp).in_loop == 10
  with pytest.raises(hlo_check.HloMismatch, match="runs 9 times per call, expected 10"):
    hlo_check.verify(_loop(1, 10), exp)


def test_algorithm_configs_are_read_with_their_braces():
  line = ('%ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, backend_config={"flag_configs":[],'
          '"collective_algorithm_config":{"emitter":"RotatedPincerShortEmitter","strategy":"StrategyND","debug":'
          '"\\nStrategyND{colors:3 cores:{4 4 4},{4 4 4} num_dims:3 active_dims:101 dim_sizes:4,1,4}"},'
          '"used_scoped_memory_configs":[]}')
  assert parse.algorithm_config(line) == {"emitter": "RotatedPincerShortEmitter", "strategy": "StrategyND",
                                          "dim_sizes": [4, 1, 4], "active_dims": "101", "colors": 3}
  no_debug = ('%ag = f32[8]{0} all-gather(%x), backend_config={"collective_algorithm_config":'
              '{"emitter":"1DAllGatherOnMajorDim"},"used_scoped_memory_configs":[]}')
  assert parse.algorithm_config(no_debug) == {"emitter": "1DAllGatherOnMajorDim"}
  assert parse.algorithm_config("%ar = f32[8]{0} all-reduce(%x), backend_config={}") is None


# -------------------------------------------------------------------------------------- compiled for a slice

def _compile_point(kind, text, coll_name, scope, count=65536, reps=None):
  """A point's check program (or its timed program of `reps`) compiled for the slice, and its expectation."""
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
  top, _, mesh, _ = machine.resolve_target(kind, machine.parse_target_topology(kind, text), None)
  plan = next(p for p in plan_scopes(top, tpu_slice.SCOPES) if p.name == scope)
  coll = collectives.get(coll_name)
  if reps:
    return program.build_timed(coll, mesh, plan, count, "float32", reps), plan, coll
  return program.build_check(coll, mesh, plan, count, "float32").check_prog, plan, coll


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_an_all_gather_over_a_slice_is_checked_in_xla_tpus_all_reduce_form():
  prog, plan, coll = _compile_point("v5p", "4x4x4", "all_gather", "slice")
  assert prog.verified.written_as == "all-gather as all-reduce"
  assert prog.verified.facts()["algorithm"]["strategy"] == "StrategyND"
  assert prog.verified.facts()["algorithm"]["dim_sizes"] == [4, 4, 4]
  # mutation: the same program checked against other groups (a scope XLA did not compile) fails
  exp = program.expectation(coll, plan, 65536, "float32", "tpu", 1, timed=False)
  wrong = dataclasses.replace(exp, groups=exp.groups.reshape(2, -1))
  with pytest.raises(hlo_check.HloMismatch, match="expected all-reduce over groups"):
    hlo_check.verify(prog.hlo_text, wrong)


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_a_timed_tpu_loop_is_counted_and_its_staging_reported():
  prog, _, _ = _compile_point("v5p", "4x4x4", "all_reduce", "ici_x", reps=10)
  v = prog.verified
  assert v.executions == 10 and v.in_loop >= 8 and v.trip_counts
  assert v.facts()["algorithm"]["emitter"]  # the algorithm XLA:TPU chose for a ring along x
  assert "staging_copies" in v.facts()


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize("coll_name,transfer", [("all_reduce", "ALL_REDUCE"), ("all_gather", "ALL_GATHER"),
                                                ("all_to_all", "ALL_TO_ALL"), ("ppermute", "ONE_TO_ONE")])
def test_across_slices_the_collective_is_a_megascale_transfer(coll_name, transfer):
  prog, plan, coll = _compile_point("v5e", "2x2,slices:2", coll_name, "dcn")
  v = prog.verified
  assert v.dcn["types"] == [transfer] and v.dcn["ici_collectives_per_call"] == 0
  assert v.emitted == (f"megascale-{transfer.lower().replace('_', '-')}",)
  exp = program.expectation(coll, plan, 65536, "float32", "tpu", 1, timed=False)
  # mutations: another collective's transfer, one transfer too many, an ICI collective beside it
  other = "all-to-all" if coll.hlo_op != "all-to-all" else "all-reduce"
  with pytest.raises(hlo_check.HloMismatch, match="must be one DCN"):
    hlo_check.verify(prog.hlo_text, dataclasses.replace(exp, op=other, rewrites=()))
  with pytest.raises(hlo_check.HloMismatch, match="DCN transfers run 1 times per call, expected 2"):
    hlo_check.verify(prog.hlo_text, dataclasses.replace(exp, executions=2))
  extra = prog.hlo_text.replace("\nENTRY", "\n%stray (x: f32[8]) -> f32[8] {\n  ROOT %s = f32[8]{0} all-reduce(%x),"
                           " replica_groups={{0,1}}, to_apply=%add\n}\nENTRY", 1)
  with pytest.raises(hlo_check.HloMismatch, match="must be one DCN"):
    hlo_check.verify(extra, exp)


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_an_ici_scope_of_a_multislice_target_is_checked_on_slice_local_ids():
  prog, plan, _ = _compile_point("v5e", "2x2,slices:2", "all_reduce", "ici_x")
  assert plan.slice_devices == 4 and prog.verified.match.groups in (((0, 1), (2, 3)), ((2, 3), (0, 1)))


def test_a_tpu_target_refuses_gpu_only_modes_in_one_line():
  r = run_cli(["--target=v5p", "--command_buffer=yes"])
  assert r.returncode == 2 and "XLA:TPU" in r.stderr and "Traceback" not in r.stderr
  r = run_cli(["--target=v5p", "--topology=4x4"])
  assert r.returncode == 2 and "3 torus dimensions" in r.stderr and "Traceback" not in r.stderr
  r = run_cli(["--target=v5p", "--scopes=scale_up"])
  assert r.returncode == 2 and "ici_x" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------- busbw's peak on a torus

def _extents(dims, host=(2, 2, 1), slices=1):
  return {"slice": slices, **{f"{a}_host": d // h for a, d, h in zip("xyz", dims, host)},
          **{f"{a}_chip": h for a, h in zip("xyz", host)}}


def test_each_tpu_scope_gets_the_bound_its_links_allow():
  from microbench.bench import tpu_peaks  # pylint: disable=g-import-not-at-top
  cube = _extents((4, 4, 4))
  v5p = tpu_kinds.target("v5p")
  ring = 2 * v5p.ici_link_gbytes  # a wrapped side of 4: both directions of the ring
  assert tpu_peaks.scope_peak("all_reduce", "ici_x", cube, "TPU v5") == pytest.approx(ring)
  assert tpu_peaks.scope_peak("all_reduce", "slice", cube, "TPU v5") == pytest.approx(3 * ring)  # every port
  # a 2x4x4 slice is not a cube: its sides of 4 do not wrap, a line gives half a ring
  assert tpu_peaks.scope_peak("all_reduce", "ici_y", _extents((2, 4, 4)), "TPU v5") == pytest.approx(ring / 2)
  # across slices the host's DCN is shared by its 4 chips: a v5e chip's share is 25 Gb/s
  two = _extents((2, 2, 1), slices=2)
  assert tpu_peaks.scope_peak("all_reduce", "dcn", two, "TPU v5 lite") == pytest.approx(25 / 8)
  assert tpu_peaks.scope_peak("all_reduce", "dcn", _extents((2, 2, 1)), "TPU v5 lite") is None  # one slice
  assert tpu_peaks.scope_peak("all_reduce", "ici_x", cube, "NVIDIA H100 80GB HBM3") is None


def test_on_chip_staging_is_counted_and_an_hbm_write_per_repetition_still_fails():
  """XLA:TPU's VMEM staging (layout memory space S(1)) is reported; the same write into HBM on every
  repetition is the extra work the check exists to catch (mutation: the staging rule must not excuse it)."""
  exp = hlo_check.Expectation(op="all-reduce", groups=np.array([[0, 1, 2, 3]]), ordered=False, dtype="float32",
                              elements=64, executions=10, in_loop=True, copy_limit=64, onchip_staging=True)
  write = "  %w2 = f32[64]{0:T(1024)LAYOUT} negate(%ar)\n  ROOT %t = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) tuple(%next, %w2, %k)"
  body = _loop().replace("  ROOT %t = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) tuple(%next, %ar, %k)",
                         write)
  staged = hlo_check.verify(body.replace("LAYOUT", "S(1)"), exp)
  assert staged.staged == 10 and staged.facts()["staging_copies"] == 10
  with pytest.raises(hlo_check.HloMismatch, match="loop body writes 64 elements"):
    hlo_check.verify(body.replace("LAYOUT", ""), exp)
  with pytest.raises(hlo_check.HloMismatch, match="loop body writes 64 elements"):  # off TPUs: no staging
    hlo_check.verify(body.replace("LAYOUT", "S(1)"), dataclasses.replace(exp, onchip_staging=False))


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.long
@pytest.mark.parametrize("target,topology,scopes,sizes", [
    ("v5p", "4x4x4", {"host", "ici_x", "ici_y", "ici_z", "slice"}, ["--min_bytes=4K", "--step_factor=16"]),
    ("v5e", "2x2,slices:2", {"host", "ici_x", "ici_y", "dcn", "global"}, ["--min_bytes=4K", "--step_factor=16"])])
def test_every_collective_and_scope_compiles_for_a_tpu_slice_with_every_check_passing(tmp_path, target, topology,
                                                                                      scopes, sizes):
  """For two v5e slices joined over DCN and for a v5p cube, every collective and scope of the default sweep at
  half its sizes (4K to 16M by 16x: the default range's ends and two between; the whole default sweep is
  scripts/check_matrix.py's and measured-figures' 480 and 720 points) compiles with every point's HLO checked;
  and XLA's own dump of every optimised module read the same way (each loop's trip count found, each Megascale
  transfer of a known collective), so the checks stand on what XLA:TPU wrote, not on one printing of it."""
  import glob  # pylint: disable=g-import-not-at-top
  out, dump = tmp_path / "run", tmp_path / "dump"
  r = run_cli([f"--target={target}", f"--topology={topology}", *sizes, f"--outdir={out}"], timeout=1200,
              XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  recs = [json.loads(l) for l in open(out / "results.jsonl", encoding="utf-8")]
  assert all(rec["status"] == "compiled" for rec in recs)
  assert {(rec["collective"], rec["scope"]) for rec in recs} == {
      (c, s) for c in collectives.NAMES for s in scopes}
  assert all(rec.get("algorithm") for rec in recs if rec["collective"] == "all_reduce" and rec["scope"] != "dcn"
             and rec["scope"] != "global")
  assert all(rec["dcn"]["types"] for rec in recs if rec["scope"] in ("dcn", "global"))
  meta = json.loads(open(out / "meta.json", encoding="utf-8").read())
  assert meta["target"]["slices"] == (2 if "slices:2" in topology else 1) and meta["target"]["platform"] == "tpu"
  assert os.path.basename(meta["target"]["spec_file"]) == f"{target}.toml"
  modules = glob.glob(str(dump / "*after_optimizations.txt"))
  assert len(modules) >= len(recs)
  loops = transfers = 0
  for path in modules:
    text = open(path, encoding="utf-8").read()
    for loop in parse.while_loops(text):
      assert loop.trip_count is not None, (path, loop.line[:200])
      loops += 1
    for t in parse.megascale_transfers(text):
      assert t.op, (path, t.line[:200])
      transfers += 1
  assert loops >= len(recs) and (transfers > 0) == (target == "v5e")


# ------------------------------------------------------------------------------ the study's schedule from TPU HLO

@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_study_schedule_derived_from_tpu_hlo():
  """`microbench-study schedule --target=v5e`: the proxy's collectives as XLA:TPU compiles them (the FSDP
  gradient's reduce-scatter is an all-reduce there), its loops counted though XLA:TPU drops their trip-count
  annotation, the compute timed on the chip's own roofline; a pipeline's stage transfers found."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from support import ROOT, clean_env  # pylint: disable=g-import-not-at-top

  def schedule(proxy_from: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from microbench.cli.study import run; run()", "schedule",
                           f"--proxy_from={proxy_from}", "--gpus=8", "--target=v5e", *extra], capture_output=True,
                          text=True, timeout=300, env=clean_env(), cwd=ROOT)
  r = schedule("gpt2-tiny,fsdp")
  assert r.returncode == 0, r.stderr[-2000:]
  out = json.loads(r.stdout)
  assert out["proxy"]["meta"]["platform"] == "tpu" and out["proxy"]["meta"]["gpu"] == "V5E"
  derived = out["comparison"]["derived"]["bytes_rank0"]
  assert derived.get("all_gather", 0) > 0 and derived.get("all_reduce", 0) > 0
  assert out["proxy"]["meta"]["hlo_notes"]["unknown_trip_counts"] == 0
  piped = schedule("gpt2-tiny,dp+pp")
  assert piped.returncode == 0, piped.stderr[-2000:]
  assert json.loads(piped.stdout)["comparison"]["derived"]["bytes_rank0"].get("permute", 0) > 0
  r = schedule("gpt2-tiny,fsdp", "--gpus=6")
  assert r.returncode == 2 and "multiple of 4" in r.stderr and "Traceback" not in r.stderr


def test_a_counter_copied_before_its_step_is_still_read():
  """XLA:TPU copies a scan's counter into another memory space before adding 1 (a training step's backward
  loop): the count is still read through the copy."""
  copied = _loop().replace("%next = s32[]{:T(128)} add(%i, %one)",
                           "%ic = s32[]{:T(128)S(6)} copy(%i)\n  %next = s32[]{:T(128)} add(%ic, %one)")
  assert [l.trip_count for l in parse.while_loops(copied)] == [10]


def test_on_a_tpu_vm_the_machine_is_read_from_the_chips(monkeypatch):
  """At run time on TPUs the slices come from the devices themselves (coords, slice, host), and a GPU
  --topology is refused in one line."""
  from microbench.cluster import distributed, machine  # pylint: disable=g-import-not-at-top
  devices = _fake_devices((4, 4, 1), slices=2, shuffle=5)
  monkeypatch.setattr(machine, "ordered_devices", lambda: list(devices))
  monkeypatch.setattr(distributed, "process_hosts", lambda: [f"h{i}" for i in range(8)])
  monkeypatch.setattr(tpu_slice, "build_mesh", lambda top, ordered: ("mesh", top, ordered))
  top, (_, _, ordered), note = machine.resolve(None, None)
  assert (top.dims, top.slices) == ((4, 4, 1), 2) and "coordinates" in note
  _assert_scopes_follow_the_torus(top, ordered)
  with pytest.raises(machine.TopologyError, match="read from the chips"):
    machine.resolve(machine.parse_topology("nodes:2,gpus:8"), None)


def test_a_copy_out_of_on_chip_memory_is_staging_and_an_hbm_copy_is_not():
  """A copy of the op's result out of VMEM is staging; in HBM, a copy that re-tiles it is the op's form (counted,
  stated), and one that keeps its layout is a copy of the message on every repetition: it fails."""
  exp = hlo_check.Expectation(op="all-reduce", groups=np.array([[0, 1, 2, 3]]), ordered=False, dtype="float32",
                              elements=64, executions=10, in_loop=True, copy_limit=64, onchip_staging=True)
  body = _loop().replace(
      "  ROOT %t = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) tuple(%next, %ar, %k)",
      "  %src = f32[64]{0:T(1024)SRC} bitcast(%ar)\n  %back = f32[64]{0:DST} copy(%src)\n"
      "  ROOT %t = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) tuple(%next, %back, %k)")
  assert hlo_check.verify(body.replace("SRC", "S(1)").replace("DST", "T(8,128)"), exp).staged == 10
  assert hlo_check.verify(body.replace("SRC", "").replace("DST", "T(8,128)"), exp).form_writes == 640
  with pytest.raises(hlo_check.HloMismatch, match="loop body writes 64 elements"):
    hlo_check.verify(body.replace("SRC", "").replace("DST", "T(1024)"), exp)


def test_only_a_reduce_of_the_collectives_own_result_is_its_form():
  """XLA:TPU's small all-gather reduces the expanded result (its own form, counted); a reduce of anything else
  in the loop body is extra work and fails (mutation: the rule must not excuse every reduce)."""
  exp = hlo_check.Expectation(op="all-reduce", groups=np.array([[0, 1, 2, 3]]), ordered=False, dtype="float32",
                              elements=64, executions=10, in_loop=True, copy_limit=64, onchip_staging=True)
  def body(src):
    return _loop().replace(
        "  ROOT %t = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) tuple(%next, %ar, %k)",
        f"  %zero = f32[]{{:T(128)}} constant(0)\n  %red = f32[64]{{0:T(1024)}} reduce({src}, %zero), dimensions={{}},"
        " to_apply=%add\n  ROOT %t = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) tuple(%next, %red, %k)")
  assert hlo_check.verify(body("%ar"), exp).form_writes == 640  # the op's re-tiling: counted and stated
  with pytest.raises(hlo_check.HloMismatch, match="loop body writes 64 elements"):
    hlo_check.verify(body("%x"), exp)


# ------------------------------------------------------------------ the check's rules, bounded (each with its bug)

_BODY_ROOT = "  ROOT %t = (s32[]{:T(128)}, f32[64]{0:T(1024)}, s32[]{:T(128)}) tuple(%next, %ar, %k)"


def _with_body(lines: str, result: str = "%out") -> str:
  """The TPU loop with `lines` inserted after the all-reduce and `result` carried instead of it."""
  return _loop().replace(_BODY_ROOT, lines + _BODY_ROOT.replace("%ar,", f"{result},"))


_EXP = hlo_check.Expectation(op="all-reduce", groups=np.array([[0, 1, 2, 3]]), ordered=False, dtype="float32",
                             elements=64, executions=10, in_loop=True, copy_limit=64, onchip_staging=True)


def test_an_unfused_in_place_update_writes_its_update_and_a_message_sized_one_still_fails():
  """XLA:TPU leaves bfloat16's one-element feedback as a dynamic-update-slice of its own (in place after copy
  insertion): it writes one element. A message-sized update is the write the check exists to catch."""
  one = ("  %z0 = s32[]{:T(128)} constant(0)\n  %e = f32[1]{0:T(128)} slice(%ar), slice={[0:1]}\n"
         "  %out = f32[64]{0:T(1024)} dynamic-update-slice(%x, %e, %z0)\n")
  assert hlo_check.verify(_with_body(one), _EXP).body_writes == 2  # the slice and the update: an element each
  whole = ("  %z0 = s32[]{:T(128)} constant(0)\n  %e = f32[64]{0:T(1024)} negate(%ar)\n"
           "  %out = f32[64]{0:T(1024)} dynamic-update-slice(%x, %e, %z0)\n")
  with pytest.raises(hlo_check.HloMismatch, match="loop body writes 64 elements"):
    hlo_check.verify(_with_body(whole), _EXP)


def test_a_retiling_is_a_layout_change_of_the_ops_own_buffers_and_nothing_else():
  """A reduce over a unit dimension of the collective's result (XLA:TPU re-tiling [n, 1, c] to [n, c]) is the op's
  form, counted; the same reduce over a dimension that is not of size 1, a same-layout copy of the result, or a
  re-tiling of something that is not the collective's buffer, is extra work and fails."""
  tile = ("  %b = f32[4,1,16]{2,1,0:T(2,128)} bitcast(%ar)\n  %zr = f32[]{:T(128)} constant(0)\n"
          "  %r = f32[4,16]{1,0:T(4,128)} reduce(%b, %zr), dimensions={1}, to_apply=%add\n"
          "  %out = f32[64]{0:T(1024)} bitcast(%r)\n")
  v = hlo_check.verify(_with_body(tile), _EXP)
  assert v.form_writes == 64 * 10 and v.facts()["form_writes"] == 640
  not_unit = tile.replace("f32[4,1,16]", "f32[4,2,8]").replace("f32[4,16]{1,0", "f32[4,8]{1,0").replace(
      "f32[64]{0:T(1024)} bitcast(%r)", "f32[64]{0:T(1024)} broadcast(%r), dimensions={0,1}")
  with pytest.raises(hlo_check.HloMismatch, match="loop body writes"):
    hlo_check.verify(_with_body(not_unit), _EXP)
  same_layout_copy = "  %out = f32[64]{0:T(1024)} copy(%ar)\n"
  with pytest.raises(hlo_check.HloMismatch, match="loop body writes 64 elements"):
    hlo_check.verify(_with_body(same_layout_copy), _EXP)
  of_the_input = "  %out = f32[64]{0:T(8,128)} copy(%x)\n"
  with pytest.raises(hlo_check.HloMismatch, match="loop body writes 64 elements"):
    hlo_check.verify(_with_body(of_the_input), _EXP)


def test_a_split_ops_merge_joins_only_the_ops_own_parts():
  """XLA:TPU joins a ring split between ICI and DCN with a select of the two parts' results: counted. A select
  of the collective's result with the carried input is extra work and fails."""
  merge = ("  %ar2 = f32[64]{0:T(1024)} all-reduce(%x), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add\n"
           "  %pr = pred[]{:T(512)} constant(true)\n  %out = f32[64]{0:T(1024)} select(%pr, %ar, %ar2)\n")
  exp = dataclasses.replace(_EXP, executions=20)
  assert hlo_check.verify(_with_body(merge), exp).form_writes == 64 * 10
  with pytest.raises(hlo_check.HloMismatch, match="loop body writes 64 elements"):
    hlo_check.verify(_with_body(merge.replace("%ar, %ar2", "%ar, %x")), exp)


def test_packed_words_only_when_the_reducer_unpacks_the_asked_type():
  """An fp8 all-reduce XLA:TPU runs on u32 words, four elements each, its reducer unpacking them: the same bytes.
  A reducer in another type, or more words than the message's bytes padded to its rows, fails."""
  text = """HloModule m, num_partitions=4
%red (a: u32[], b: u32[]) -> u32[] {
  %a = u32[] parameter(0)
  %b = u32[] parameter(1)
  %ca = f8e5m2[] bitcast-convert(%a)
  ROOT %s = u32[] add(%a, %b)
}
ENTRY %main (x: u32[4,1,128]) -> u32[4,1,128] {
  %x = u32[4,1,128]{2,1,0:T(1,128)} parameter(0)
  ROOT %ar = u32[WORDS,1,128]{2,1,0:T(1,128)} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%red
}
"""
  exp = hlo_check.Expectation(op="all-reduce", groups=np.array([[0, 1, 2, 3]]), ordered=False,
                              dtype="float8_e5m2", elements=2048, executions=1, onchip_staging=True)
  v = hlo_check.verify(text.replace("WORDS", "4"), exp)
  assert v.packed_in == "u32" and v.wire_dtype == "float8_e5m2"
  with pytest.raises(hlo_check.HloMismatch, match="runs on u32 data"):
    hlo_check.verify(text.replace("WORDS", "4").replace("f8e5m2[]", "f32[]"), exp)
  with pytest.raises(hlo_check.HloMismatch, match="runs on u32 data"):
    hlo_check.verify(text.replace("WORDS", "64"), exp)
  with pytest.raises(hlo_check.HloMismatch, match="runs on u32 data"):  # off TPUs nothing is packed
    hlo_check.verify(text.replace("WORDS", "4"), dataclasses.replace(exp, onchip_staging=False))


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize("coll_name", ["all_reduce", "all_gather"])
def test_bfloat16_over_every_ici_scope_passes_the_check(coll_name):
  """The points that failed (18 of 60 on a v5p cube, bfloat16): XLA:TPU's unfused one-element update was counted
  as its whole buffer."""
  for scope in ("host", "ici_x", "ici_y", "ici_z", "slice"):
    for count in (1 << 20, 1 << 23):
      top, _, mesh, _ = _target("v5p", "4x4x4")
      plan = next(p for p in plan_scopes(top, tpu_slice.SCOPES) if p.name == scope)
      prog = program.build_timed(collectives.get(coll_name), mesh, plan, count, "bfloat16", 20, twin=False)
      assert prog.verified.executions == 20 and prog.verified.in_loop == 20


def _target(kind, text):
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
  return machine.resolve_target(kind, machine.parse_target_topology(kind, text), None)


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_a_16_mib_bfloat16_all_to_all_states_what_its_retiling_costs():
  """XLA:TPU re-tiles the flat bfloat16 buffer around the all-to-all in HBM on every repetition: the re-tiling is
  the op's form, counted and stated in the record (3.5 message-sized writes per operation), not excused without
  a bound, and anything else that writes the message still fails."""
  top, _, mesh, _ = _target("v5p", "4x4x4")
  plan = next(p for p in plan_scopes(top, tpu_slice.SCOPES) if p.name == "ici_x")
  coll = collectives.get("all_to_all")
  prog = program.build_timed(coll, mesh, plan, 1 << 23, "bfloat16", 20, twin=False)
  shape = program.form(coll, 1 << 23, plan.group_size, prog)
  assert shape["hbm_passes_per_op"] == pytest.approx(3.5)
  from microbench.output import table  # pylint: disable=g-import-not-at-top
  assert "3.5 message-sized memory writes per op" in table.form_text(shape)


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_dcn_loop_bodies_are_write_checked_as_ici_ones():
  """Across slices the loop body is checked like any other: a message-sized write besides the transfers fails
  (mutation: an extra negate of the carried buffer in the loop body)."""
  top, _, mesh, _ = _target("v5e", "2x2,slices:2")
  plan = next(p for p in plan_scopes(top, tpu_slice.SCOPES) if p.name == "dcn")
  coll = collectives.get("all_reduce")
  prog = program.build_timed(coll, mesh, plan, 65536, "float32", 10, twin=False)
  assert prog.verified.body_writes is not None and prog.verified.dcn["ici_collectives_per_call"] == 0
  exp = program.expectation(coll, plan, 65536, "float32", "tpu", 10, timed=True)
  body = next(c for c in parse.while_loops(prog.hlo_text))
  comps = parse.computations(prog.hlo_text)
  lines = comps[body.body].lines
  root = next(l for l in lines if l.strip().startswith("ROOT"))
  carried = next(l for l in lines if "f32[65536]" in l and "get-tuple-element" in l)
  name = carried.split("=")[0].strip().lstrip("%")
  extra = f"  %extra = f32[65536]{{0:T(1024)}} negate(%{name})\n"
  broken = prog.hlo_text.replace(root, extra + root.replace(f"%{name}", "%extra", 1), 1)
  with pytest.raises(hlo_check.HloMismatch, match="loop body writes 65536 elements"):
    hlo_check.verify(broken, exp)


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_ici_collectives_per_call_counts_executions():
  top, _, mesh, _ = _target("v5e", "2x2,slices:2")
  plan = next(p for p in plan_scopes(top, tpu_slice.SCOPES) if p.name == "global")
  prog = program.build_timed(collectives.get("all_reduce"), mesh, plan, 1 << 20, "float32", 10, twin=False)
  per_call = prog.verified.dcn["ici_collectives_per_call"]
  ici = len(parse.find_collectives(prog.hlo_text))
  assert per_call >= 10 and per_call > ici  # executions per call, not instructions in the program


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_a_scope_the_slice_lacks_measures_nothing_and_exits_2(tmp_path):
  r = run_cli(["--target=v5e", "--topology=4x4", "--scopes=ici_z", f"--outdir={tmp_path}/run"], timeout=300)
  assert r.returncode == 2 and "nothing to measure or check" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
