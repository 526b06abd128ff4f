"""Compute-communication overlap (`--overlap`): OSU's percentage, the three arms end to end on 8 CPU devices with
every result checked, and the schedule check on XLA:GPU's compiled programs (deviceless, `--target`), each
check shown to catch the bug it is for: a matrix that missed repetitions, a both arm whose collective is wrong,
a matmul serialised after the collective.
"""

from __future__ import annotations

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import run_cli
from microbench.meshes.mesh import build_mesh, ordered_devices
from microbench.meshes.scopes import plan_scopes
from microbench.meshes.topology import AXES, Topology
from microbench.bench import collectives, hlo_check, overlap, program, sweep
from microbench.hlo import parse
from microbench.hlo import async_windows
from microbench.aot import gpu_compile

TOPOLOGY = Topology(racks=1, nodes=2, gpus=4)
needs_plugin = pytest.mark.skipif(not gpu_compile.plugin_available(),
                                  reason="JAX's CUDA PJRT plugin is not installed: pip install -e '.[gpu-compile]'")


@pytest.fixture(scope="module")
def mesh():
  return build_mesh(TOPOLOGY, ordered_devices())


def _plan(name="scale_up"):
  return next(p for p in plan_scopes(TOPOLOGY, [name]) if p.name == name)


# ------------------------------------------------------------------------------------------- OSU's formula

@pytest.mark.parametrize("t_overall, want", [
    (10.0, 100.0),   # the collective cost nothing beside the compute
    (20.0, 0.0),     # fully serialised: compute + comm
    (15.0, 50.0),    # half of it hidden
    (25.0, 0.0),     # slower than serial: floored at 0, as OSU does
    (9.0, 110.0),    # faster than the compute alone (noise): OSU does not cap it, nor do we
])
def test_osu_overlap_formula_on_constructed_times(t_overall, want):
  assert overlap.osu_overlap_pct(t_overall, t_compute=10.0, t_comm=10.0) == pytest.approx(want)


def test_osu_formula_is_relative_to_the_communication_not_the_compute():
  # comm 4, compute 10, both 12: 2 of the 4 units of communication showed, half of it hidden
  assert overlap.osu_overlap_pct(12.0, 10.0, 4.0) == pytest.approx(50.0)
  assert overlap.osu_overlap_pct(12.0, 10.0, 0.0) == 0.0  # nothing to hide


def test_the_matmul_is_sized_to_the_collectives_time():
  rate = 1e12  # FLOP/s
  d = overlap.size_dim(2e-3, rate, "gpu")  # 2 ms at 1 TFLOP/s: 2 D^3 = 2e9, D = 1000 -> 1024 (x128)
  assert d == 1024 and 2 * d ** 3 / rate == pytest.approx(2e-3, rel=0.25)
  assert overlap.size_dim(1e-9, rate, "gpu") == 128 and overlap.size_dim(1e-9, rate, "cpu") == 8  # the floor
  assert overlap.size_dim(1e3, rate, "cpu") == overlap.MAX_DIM["cpu"]  # the memory cap


@pytest.mark.parametrize("text, want", [(None, None), ("", None), ("auto", "auto"), ("AUTO", "auto"), ("512", 512)])
def test_overlap_spec(text, want):
  assert overlap.parse_spec(text) == want


@pytest.mark.parametrize("text", ["0", "-4", "big", "1e3", "99999"])
def test_a_bad_overlap_spec_says_what_is_allowed(text):
  with pytest.raises(ValueError, match="use auto .* or the matmul dimension N"):
    overlap.parse_spec(text)


@pytest.mark.parametrize("args, message", [
    (["--overlap=wide"], "--overlap=wide: use auto"),
    (["--overlap=auto", "--iters=1"], "--overlap times its three arms by difference: not in latency mode"),
])
def test_bad_overlap_flags_are_one_line(args, message):
  r = run_cli(args)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr[-800:]


# ----------------------------------------------------------------------------------------- the compute check

def test_the_compute_check_catches_a_matrix_that_missed_repetitions(mesh):
  dim, reps = 24, 6
  arm = overlap.build_compute(mesh, dim, "float32", reps)
  m, _ = arm.fn(*overlap.compute_inputs(mesh, dim, "float32"))
  assert overlap.check_compute(mesh, m, dim, reps) == 0
  assert overlap.check_compute(mesh, m, dim, reps + 2) == mesh.size  # two matmuls missing: every device
  m0, _ = overlap.compute_inputs(mesh, dim, "float32")
  assert overlap.check_compute(mesh, m0, dim, reps) == mesh.size  # no matmul ran at all
  assert overlap.check_compute(mesh, m0, dim, 0) == 0


def test_the_compute_arm_must_run_every_matmul(mesh):
  """dot_executions reads how often the compiled program multiplies: a loop that skips every second matmul
  shows half of them."""
  arm = overlap.build_compute(mesh, 16, "float32", 10)
  assert overlap.dot_executions(arm.hlo_text) == 10

  def skipping(m, w):  # five trips of one matmul: half the repetitions
    return jax.lax.fori_loop(0, 5, lambda _, c: (overlap.matmul(c[0], c[1]), c[1]), (m, w))
  fn = jax.shard_map(skipping, mesh=mesh, in_specs=(jax.P(AXES),) * 2, out_specs=(jax.P(AXES),) * 2,
                     check_vma=False)
  spec = jax.ShapeDtypeStruct((mesh.size * 16, 16), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P(AXES)))
  assert overlap.dot_executions(jax.jit(fn).lower(spec, spec).compile().as_text()) == 5


class _AddsOne(collectives.AllGather):
  """An all-gather whose timed step adds 1 to its output: right in the check program, wrong in every timed
  repetition."""
  name = "all_gather_adds_one"

  def step(self, carry, axes, n, platform):
    slots, y = super().step(carry, axes, n, platform)
    return (*slots[:-1], slots[-1] + 1), y + 1


def _both_arm_wrong(mesh, coll) -> int:
  plan, count, dim, reps = _plan(), 256, 16, 6
  point = program.build_check(coll, mesh, plan, count, "float32")
  assert program.check(point) == 0
  arm = overlap.build_both(coll, mesh, plan, count, "float32", dim, reps)
  carry = (*program.initial_carry(point), *overlap.compute_inputs(mesh, dim, "float32"))
  carry = arm.checked.fn(*carry)  # every repetition's output digested, as the warm-up call runs it
  wrong, _ = program.check_timed(point, carry[:-2], reps, (0, reps))
  assert overlap.check_compute(mesh, carry[-2], dim, reps) == 0
  return wrong


def test_the_both_arms_collective_is_checked(mesh):
  assert _both_arm_wrong(mesh, collectives.get("all_gather")) == 0
  assert _both_arm_wrong(mesh, _AddsOne()) == mesh.size  # every rank's timed output wrong


class _Reversing(collectives.AllGather):
  """An all-gather whose timed step reverses its output: a message-sized write besides the collective."""
  name = "all_gather_reversing"

  def step(self, carry, axes, n, platform):
    slots, y = super().step(carry, axes, n, platform)
    return (*slots[:-1], jnp.flip(slots[-1])), y


def test_a_both_arm_that_writes_the_message_besides_the_collective_fails_its_hlo_check(mesh):
  """The both arm may write no more besides the collective and the matmul than the collective's own timed
  program: an arm that adds a message-sized write does."""
  plan, count, dim = _plan(), 4096, 16
  comm = program.build_timed(collectives.get("all_gather"), mesh, plan, count, "float32", 6)
  overlap.build_both(collectives.get("all_gather"), mesh, plan, count, "float32", dim, 6, comm)
  with pytest.raises(hlo_check.HloMismatch, match="writes .* elements more than the collective's own timed program"):
    overlap.build_both(_Reversing(), mesh, plan, count, "float32", dim, 6, comm)


# ------------------------------------------------------------------------------------------ end to end on CPU

@pytest.mark.slow
def test_overlap_mode_end_to_end_on_8_cpu_devices(tmp_path):
  out = tmp_path / "run"
  r = run_cli(["--overlap=auto", "--collectives=all_reduce,all_to_all", "--scopes=scale_up", "--min_bytes=64K",
               "--max_bytes=64K", "--samples=3", f"--outdir={out}"])
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  assert "# --overlap: not measurable on cpu: XLA:CPU runs collectives synchronously" in r.stdout
  recs = [json.loads(line) for line in open(out / "results.jsonl")]
  assert {x["collective"] for x in recs} == {"all_reduce", "all_to_all"}
  for x in recs:
    assert x["status"] == "ok" and x["wrong"] == 0 and x["timed_wrong"] == 0, x
    assert x["overlap_timed_wrong"] == 0 and x["overlap_compute_wrong"] == 0
    assert x["overlap_mode"] == "auto" and x["overlap_dim"] % 8 == 0 and x["overlap_rate_tflops"] > 0
    for field in ("t_comm_us", "t_compute_us", "t_overall_us"):
      assert x[field] > 0, field
    assert x["overlap_pct"] == pytest.approx(overlap.osu_overlap_pct(x["t_overall_us"], x["t_compute_us"],
                                                                     x["t_comm_us"]))
    # XLA:CPU: the collective is synchronous, so no window; the record says overlap is not measurable
    assert x["overlap_scheduled"] is False and x["overlap_windows"] == [0, 0] and x["overlap_measurable"] is False
    assert "synchronous" in x["overlap_schedule"] and x["overlap_note"] == overlap.CPU_NOTE
    assert any("(matmul)" in line for line in x["overlap_hlo"])
    assert "the matmuls: m0 rolled by" in x["overlap_timed_check"]
  assert r.stdout.count("#   overlap: comm ") == 2 and "not measurable on cpu (no async collectives)" in r.stdout


def _config(**kw) -> sweep.SweepConfig:
  base = dict(collectives=(), scopes=(), dtypes=("float32",), min_bytes=1, max_bytes=1, step_factor=2.0, iters=6,
              warmup=1, samples=2, check=True, overlap=24)
  return sweep.SweepConfig(**{**base, **kw})


def test_a_wrong_matmul_fails_the_point_through_the_sweep(mesh, monkeypatch):
  """run_point with a compute whose operand is 2P instead of P: the matmul's result is wrong on every device,
  which fails the point as a wrong timed program does (timed_wrong, so the run exits 1)."""
  coll, plan = collectives.get("all_reduce"), _plan()  # the right matmul passes: the end-to-end test
  made = overlap.compute_inputs
  monkeypatch.setattr(overlap, "compute_inputs", lambda *a: (made(*a)[0], 2 * made(*a)[1]))
  bad = sweep.run_point(_config(), mesh, plan, coll, "float32", 4096, lambda: None)
  assert bad["overlap_compute_wrong"] == 2 * mesh.size and bad["timed_wrong"] == 2 * mesh.size  # both arms' matmuls
  assert "WRONG (matmul on 16 device(s)" in overlap.console_lines(bad)[0]


def test_a_given_matmul_dimension_is_used_as_given(mesh):
  plan, coll = _plan("scale_out"), collectives.get("ppermute")
  point = program.build_check(coll, mesh, plan, 512, "bfloat16")
  assert program.check(point) == 0
  short, long = (program.build_timed(coll, mesh, plan, 512, "bfloat16", k) for k in (2, 6))
  rec = overlap.measure(40, point, short, long, 1e-4, 1, 2, lambda: None, lambda v: v[None])
  assert rec["overlap_mode"] == "given" and rec["overlap_dim"] == 40 and "overlap_rate_tflops" not in rec
  assert rec["overlap_compute_dtype"] == "bfloat16" and rec["overlap_flops"] == 2 * 40 ** 3
  assert rec["overlap_compute_wrong"] == 0 and rec["overlap_timed_wrong"] == 0


# ---------------------------------------------------------------------------------- the schedule check (HLO)

SCHEDULED = """HloModule jit_per_device, is_scheduled=true, num_partitions=8

%gemm_fusion_dot_computation (parameter_0: bf16[512,512], parameter_1: bf16[512,512]) -> bf16[512,512] {
  %parameter_0 = bf16[512,512]{1,0} parameter(0)
  %parameter_1 = bf16[512,512]{1,0} parameter(1)
  ROOT %dot_general.8 = bf16[512,512]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%region_1.0 (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %add = bf16[] add(%a, %b)
}

%body (param: (s32[], bf16[16384], bf16[512,512], bf16[512,512])) -> (s32[], bf16[16384], bf16[512,512], bf16[512,512]) {
  %param = (s32[], bf16[16384]{0}, bf16[512,512]{1,0}, bf16[512,512]{1,0}) parameter(0)
  %x = bf16[16384]{0} get-tuple-element(%param), index=1
  %m = bf16[512,512]{1,0} get-tuple-element(%param), index=2
  %w = bf16[512,512]{1,0} get-tuple-element(%param), index=3
  %i = s32[] get-tuple-element(%param), index=0
  %all-reduce-start = bf16[16384]{0} all-reduce-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_1.0
  %gemm_fusion_dot = bf16[512,512]{1,0} fusion(%m, %w), kind=kCustom, calls=%gemm_fusion_dot_computation
  %all-reduce-done = bf16[16384]{0} all-reduce-done(%all-reduce-start)
  ROOT %t = (s32[], bf16[16384]{0}, bf16[512,512]{1,0}, bf16[512,512]{1,0}) tuple(%i, %all-reduce-done, %gemm_fusion_dot, %w)
}

ENTRY %main (p: (s32[], bf16[16384], bf16[512,512], bf16[512,512])) -> (s32[], bf16[16384], bf16[512,512], bf16[512,512]) {
  %p = (s32[], bf16[16384]{0}, bf16[512,512]{1,0}, bf16[512,512]{1,0}) parameter(0)
  ROOT %while = (s32[], bf16[16384]{0}, bf16[512,512]{1,0}, bf16[512,512]{1,0}) while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
}
"""
_GEMM = "  %gemm_fusion_dot = bf16[512,512]{1,0} fusion(%m, %w), kind=kCustom, calls=%gemm_fusion_dot_computation\n"
_DONE = "  %all-reduce-done = bf16[16384]{0} all-reduce-done(%all-reduce-start)\n"


def test_the_schedule_check_reads_the_matmul_inside_the_window():
  got = overlap.schedule_check(SCHEDULED)
  assert got["overlap_scheduled"] is True and got["overlap_windows"] == [1, 1], got
  assert got["overlap_hlo"] == ["%all-reduce-start = all-reduce-start", "%gemm_fusion_dot = fusion (matmul)",
                                "%all-reduce-done = all-reduce-done"]
  (window,) = async_windows.windows(SCHEDULED)
  assert window.op == "all-reduce" and window.computation == "body"


def test_a_matmul_after_the_done_is_reported_serialised():
  moved = SCHEDULED.replace(_GEMM + _DONE, _DONE + _GEMM)
  assert moved != SCHEDULED
  got = overlap.schedule_check(moved)
  assert got["overlap_scheduled"] is False and got["overlap_windows"] == [0, 1]
  assert "1 of 1 matmuls run outside every collective's start-done window" in got["overlap_schedule"]


def test_an_unscheduled_or_synchronous_module_is_not_overlapped():
  got = overlap.schedule_check(SCHEDULED.replace("is_scheduled=true, ", ""))
  assert got["overlap_scheduled"] is False and "not scheduled" in got["overlap_schedule"]
  sync = (SCHEDULED.replace("all-reduce-start(%x)", "all-reduce(%x)").replace(_DONE, "")
          .replace("tuple(%i, %all-reduce-done,", "tuple(%i, %all-reduce-start,"))
  got = overlap.schedule_check(sync)
  assert got["overlap_scheduled"] is False and "synchronous" in got["overlap_schedule"]


# ------------------------------------------------------------------------ XLA:GPU (deviceless, for a target)

@pytest.fixture(scope="module")
def gpu_mesh():
  if not gpu_compile.plugin_available():
    pytest.skip("JAX's CUDA PJRT plugin is not installed: pip install -e '.[gpu-compile]'")
  target = gpu_compile.make_target("h100", 1, 8)
  return build_mesh(Topology(1, 1, 8), list(target.devices))


def _window_order(lines: list[str]) -> list[str]:
  return ["start" if "-start" in s else "done" if "-done" in s else "matmul" for s in lines]


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
@pytest.mark.parametrize("name", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute"])
def test_on_gpus_the_matmul_runs_between_the_collectives_start_and_done(gpu_mesh, name):
  """The both arm as XLA:GPU compiles it for H100: the latency-hiding scheduler puts each sized matmul between
  a collective's async start and done, inside the timed while loop."""
  plan = plan_scopes(Topology(1, 1, 8), ["scale_up"])[0]
  coll = collectives.get(name)
  long = program.build_timed(coll, gpu_mesh, plan, 1 << 20, "bfloat16", 10)
  facts = overlap.compiled_facts("auto", coll, gpu_mesh, plan, 1 << 20, "bfloat16", long)
  assert facts["overlap_scheduled"] is True, facts
  assert facts["overlap_windows"] == [2, 2] and _window_order(facts["overlap_hlo"]) == ["start", "matmul", "done"] * 2
  both = overlap.build_both(coll, gpu_mesh, plan, 1 << 20, "bfloat16", overlap.TARGET_DIM, 10, long)
  bodies = {lp.body for lp in parse.while_loops(both.hlo_text) if lp.trip_count == 5}
  assert {w.computation for w in async_windows.windows(both.hlo_text)} <= bodies  # inside the timed loop


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_on_gpus_a_matmul_that_needs_the_collectives_output_is_reported_serialised(gpu_mesh):
  """The mutant: the matmul reads the collective's output, so it can only start after the done; the
  schedule check must say so (the same program without the dependence is overlapped)."""
  def program_text(depends: bool) -> str:
    def per_device(x, m, w):
      def step(c):
        x, m, w = c
        y = jax.lax.psum(x, "gpu")
        a = m + y[0].astype(m.dtype) if depends else m
        return y, overlap.matmul(a, w), w
      return program.repeat(step, 10, (x, m, w))
    sh = jax.NamedSharding(gpu_mesh, jax.P(AXES))
    specs = [jax.ShapeDtypeStruct((8 << 20,), jnp.bfloat16, sharding=sh)] + [
        jax.ShapeDtypeStruct((8 * 4096, 4096), jnp.bfloat16, sharding=sh)] * 2
    fn = jax.shard_map(per_device, mesh=gpu_mesh, in_specs=(jax.P(AXES),) * 3, out_specs=(jax.P(AXES),) * 3,
                       check_vma=False)
    return jax.jit(fn, donate_argnums=(0, 1)).lower(*specs).compile().as_text()

  assert overlap.schedule_check(program_text(False))["overlap_scheduled"] is True
  got = overlap.schedule_check(program_text(True))
  assert got["overlap_scheduled"] is False and "serialised with the collective" in got["overlap_schedule"], got


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_target_sweep_records_the_schedule_read_from_xlas_own_dump(tmp_path):
  """`--target --overlap`: the record's schedule is the one in XLA:GPU's dump of the compiled both arm."""
  out, dump = tmp_path / "run", tmp_path / "dump"
  r = run_cli(["--target=h100", "--topology=nodes:1,gpus:8", "--overlap=auto", "--collectives=all_reduce",
               "--scopes=scale_up", "--min_bytes=1M", "--max_bytes=1M", f"--outdir={out}"],
              XLA_FLAGS=f"--xla_dump_to={dump}")
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  (rec,) = [json.loads(line) for line in open(out / "results.jsonl")]
  assert rec["status"] == "compiled" and rec["overlap_scheduled"] is True and rec["overlap_dim"] == overlap.TARGET_DIM
  assert "scheduled inside the collective (2/2 windows)" in r.stdout
  dumped = [open(f).read() for f in glob.glob(os.path.join(dump, "*_gpu_after_optimizations.txt"))]
  both = [t for t in dumped if "all-reduce-start" in t and overlap.dot_executions(t) == rec["iters"]]
  assert len(both) == 1, [t.split("\n", 1)[0] for t in dumped]
  from_dump = overlap.schedule_check(both[0])
  assert from_dump["overlap_scheduled"] is True and from_dump["overlap_hlo"] == rec["overlap_hlo"]
  assert np.all([line in both[0] for line in ("all-reduce-start(", "all-reduce-done(", "__triton_nested_gemm_fusion")])
