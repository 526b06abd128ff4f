"""Compiling for GPU clusters without one (`--target`): XLA:GPU's own HLO, checked by the toolkit's checks.

Needs JAX's CUDA PJRT plugin (the `gpu-compile` extra, which .ci/run installs); every test here is skipped
with that reason when it is absent. Nothing runs on a GPU: the programs are compiled for compile-only devices
of a described GPU kind (microbench/aot/specs) and read.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import run_cli
from microbench.meshes.mesh import build_mesh
from microbench.meshes.scopes import plan_scopes
from microbench.meshes.topology import AXES, Topology
from microbench.bench import collectives, hlo_check, program
from microbench.fabric import link_peaks
from microbench.fabric import gpu_kinds
from microbench.aot import gpu_compile
from microbench.train import flops_peaks

needs_plugin = pytest.mark.skipif(not gpu_compile.plugin_available(),
                                  reason="JAX's CUDA PJRT plugin is not installed: pip install -e '.[gpu-compile]'")
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "comm_fingerprints_h100.json")


# ------------------------------------------------------------------------------------------------ kinds as data

def test_every_kind_names_its_sources_and_targets_have_a_compiler_description():
  kinds = gpu_kinds.kinds()
  assert {"a100", "h100", "h200", "b200", "gb200", "b300", "gb300"} <= set(gpu_kinds.targets())
  for kind in kinds.values():
    text = open(kind.source_file, encoding="utf-8").read()
    assert "Source" in text, kind.source_file
    if kind.xla:
      cfg = kind.target_config()
      assert f"core_count: {kind.xla['sm_count']}" in cfg and f'"{kind.device_kind}"' in cfg
  assert gpu_kinds.target("gb200").nodes_per_rack * gpu_kinds.target("gb200").gpus_per_node == 72
  with pytest.raises(gpu_kinds.KindError, match="choose one of a100"):
    gpu_kinds.target("h900")
  with pytest.raises(gpu_kinds.KindError, match="choose one of"):
    gpu_kinds.target("mi250x")  # known for its peak only


def test_link_and_mfu_peaks_come_from_the_kinds_table():
  h200 = gpu_kinds.target("h200")
  assert flops_peaks.table_peak("NVIDIA H200", "bfloat16").tflops == h200.bf16_tflops
  assert flops_peaks.table_peak("NVIDIA H200 NVL", "bfloat16").tflops == gpu_kinds.kinds()["h200-nvl"].bf16_tflops
  got = link_peaks.resolve("NVIDIA GB200")
  assert got["scale_up"].link == "nvlink5" and got["rack_scale"].link == "nvlink5"
  assert link_peaks.resolve("NVIDIA GH200 480GB")["scale_up"].link == "nvlink4"
  assert link_peaks.resolve("NVIDIA H100 PCIe") == {}


def test_without_the_plugin_the_target_says_what_to_install(monkeypatch):
  monkeypatch.setattr(gpu_compile, "plugin_available", lambda: False)
  with pytest.raises(gpu_compile.TargetError, match=r"pip install -e '\.\[gpu-compile\]'"):
    gpu_compile.make_target("h100", 1, 8)


def test_fit_is_against_what_jax_gets_of_the_device(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
  f = gpu_compile.fit(70 * 2**30, 80 * 2**30)
  assert f["fits"] is False and f["fits_whole_device"] is True and f["usable_bytes"] == 60 * 2**30
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  assert gpu_compile.fit(70 * 2**30, 80 * 2**30)["fits"] is True


# ------------------------------------------------------------------------------------------------ the sweep

@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_sweep_compiles_every_collective_and_scope_for_h100_with_every_check_passing(tmp_path):
  out = tmp_path / "run"
  r = run_cli(["--target=h100", "--topology=nodes:2,gpus:8", "--dtype=bfloat16", "--min_bytes=1M",
               "--max_bytes=1M", f"--outdir={out}"], timeout=300)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  assert r.stderr.strip() == "", r.stderr[-1000:]  # no CUDA-stub chatter, no traceback
  recs = [json.loads(line) for line in open(out / "results.jsonl")]
  assert {(x["collective"], x["scope"]) for x in recs} == {
      (c, s) for c in collectives.NAMES for s in ("scale_up", "scale_out", "global")}
  for x in recs:
    assert x["status"] == "compiled" and x["target"] == "h100", x
    assert all(op.endswith("-start") for op in x["op_emitted"]), x["op_emitted"]  # async on GPU
    assert x["wire_dtype"] == "bfloat16"
    assert x["trip_count"] == x["iters"] // 2 and x["loop_reps"] == x["iters"]  # every repetition in the loop
    assert x["fits"] is True and 0 < x["memory_bytes"] < 16 * 2**20
  meta = json.load(open(out / "meta.json"))
  assert meta["target"]["kind"] == "h100" and meta["target"]["devices"] == 16
  assert "compiled for NVIDIA H100" in r.stdout


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_a_point_too_large_for_the_device_is_reported_as_such(tmp_path):
  out = tmp_path / "run"
  r = run_cli(["--target=a100", "--topology=nodes:1,gpus:8", "--collectives=all_reduce", "--scopes=scale_up",
               "--min_bytes=1M", "--max_bytes=32G", "--step_factor=32768", f"--outdir={out}"], timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  recs = {x["bytes"]: x for x in map(json.loads, open(out / "results.jsonl"))}
  assert recs[2**20]["fits"] is True and recs[32 * 2**30]["fits"] is False
  assert "DOES NOT FIT" in r.stdout


def test_bad_target_is_one_line():
  r = run_cli(["--target=h900", "--topology=nodes:1,gpus:8"])
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      f"microbench: error: unknown --target='h900': choose one of {', '.join(gpu_kinds.targets())}"]


# ------------------------------------------------------------------------------------- mutations on GPU HLO

@pytest.fixture(scope="module")
def gpu_mesh():
  if not gpu_compile.plugin_available():
    pytest.skip("JAX's CUDA PJRT plugin is not installed: pip install -e '.[gpu-compile]'")
  target = gpu_compile.make_target("h100", 2, 8)
  topology = Topology(1, 2, 8)
  return topology, build_mesh(topology, list(target.devices))


def _compile(mesh, f, *specs) -> str:
  fn = jax.shard_map(f, mesh=mesh, in_specs=tuple(jax.P(AXES) for _ in specs), out_specs=jax.P(AXES),
                     check_vma=False)
  return jax.jit(fn, donate_argnums=0).lower(*specs).compile().as_text()


def _spec(mesh, count, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct((mesh.size * count,), dtype, sharding=jax.NamedSharding(mesh, jax.P(AXES)))


def _expect(topology, scope="scale_up", dtype="bfloat16", count=4096, reps=10):
  plan = next(p for p in plan_scopes(topology, [scope]) if p.name == scope)
  return hlo_check.Expectation(op="all-reduce", groups=plan.groups, ordered=False, dtype=dtype, elements=count,
                               executions=reps, in_loop=True, outside_max=2, copy_limit=count, widen_ok=False)


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_the_real_timed_program_passes_on_gpu_hlo(gpu_mesh):
  topology, mesh = gpu_mesh
  plan = plan_scopes(topology, ["scale_up"])[0]
  prog = program.build_timed(collectives.get("all_reduce"), mesh, plan, 4096, "bfloat16", 10)
  assert prog.verified.executions == 10 and prog.verified.in_loop == 10 and prog.verified.trip_counts == (5, 5)


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_a_loop_without_known_trip_count_fails_on_gpu_hlo(gpu_mesh):
  topology, mesh = gpu_mesh

  def f(x):  # the bound comes from the data: XLA can't know the trip count
    n = (x[0] * 0).astype(jnp.int32) + 5
    return jax.lax.fori_loop(0, n, lambda i, c: jax.lax.psum(c, "gpu"), x)
  text = _compile(mesh, f, _spec(mesh, 4096))
  with pytest.raises(hlo_check.HloMismatch, match="no known trip count"):
    hlo_check.verify(text, _expect(topology, reps=5))


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_a_message_sized_copy_in_the_loop_body_fails_on_gpu_hlo(gpu_mesh):
  topology, mesh = gpu_mesh

  def f(x):  # the carry keeps the old buffer beside the new one: XLA:GPU copies it every trip
    def body(i, c):
      a, b = c
      return jax.lax.psum(a, "gpu") + b[0], a
    return jax.lax.fori_loop(0, 5, body, (x, x))[0]
  text = _compile(mesh, f, _spec(mesh, 4096))
  with pytest.raises(hlo_check.HloMismatch, match="writes 4096 elements besides the collective"):
    hlo_check.verify(text, _expect(topology, reps=5))


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_a_widened_wire_dtype_fails_on_gpu_hlo(gpu_mesh):
  """bf16 asked, the psum run in f32: passed on CPU (XLA widens there), must fail on a GPU target."""
  topology, mesh = gpu_mesh

  def f(x):
    return jax.lax.fori_loop(0, 5, lambda i, c: jax.lax.psum(c.astype(jnp.float32), "gpu").astype(c.dtype), x)
  text = _compile(mesh, f, _spec(mesh, 4096))
  with pytest.raises(hlo_check.HloMismatch, match="runs on f32 data"):
    hlo_check.verify(text, _expect(topology, reps=5))


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_a_wrong_group_fails_on_gpu_hlo(gpu_mesh):
  topology, mesh = gpu_mesh

  def f(x):
    return jax.lax.fori_loop(0, 5, lambda i, c: jax.lax.psum(c, ("rack", "node")), x)
  text = _compile(mesh, f, _spec(mesh, 4096))
  with pytest.raises(hlo_check.HloMismatch, match="expected all-reduce over groups"):
    hlo_check.verify(text, _expect(topology, scope="scale_up", reps=5))
  hlo_check.verify(text, _expect(topology, scope="scale_out", reps=5))  # the right groups pass


# --------------------------------------------------------------------------------------- training steps

def _train(**kw):
  from microbench import train  # pylint: disable=g-import-not-at-top
  cfg = train.TrainConfig(compile_only=True, write=False, verbose=False, dtype="bfloat16", **kw)
  return train.run(cfg).summary


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_train_target_reports_gpu_memory_fit_and_fsdp_reduce_scatter():
  small = _train(model="gpt2", size="tiny", parallelism="fsdp:8", batch=8, target="h100", topology="nodes:1,gpus:8")
  assert small["fits"] is True and small["usable_bytes"] == int(gpu_kinds.target("h100").memory_bytes * 0.75)
  assert small["comm"]["reduce-scatter"]["dtypes"] == {"bf16": small["comm"]["reduce-scatter"]["bytes"]}
  big = _train(model="llama3", size="70b", seq_len=4096, parallelism="fsdp:8", batch=8, target="h100",
               topology="nodes:1,gpus:8")
  assert big["memory_per_device_bytes"] > 100 * small["memory_per_device_bytes"]
  assert big["fits"] is False and big["margin_bytes"] < 0
  assert big["attention"] == "cudnn" and big["attention_compiled"].get("__cudnn$fmhaSoftmax", 0) >= 1
  # FSDP's gradients leave as reduce-scatters of the whole bf16 model once per step.
  assert big["comm"]["reduce-scatter"]["bytes"] == pytest.approx(2 * big["params"], rel=0.01)


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_study_schedule_derived_from_gpu_hlo():
  """--target: the derived FSDP proxy from XLA:GPU's HLO reduce-scatters in bf16 (on CPU the gradient is an
  all-reduce in f32)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from support import ROOT, clean_env  # pylint: disable=g-import-not-at-top
  def schedule(proxy_from: str) -> dict:
    r = subprocess.run([sys.executable, "-c", "from microbench.cli.study import run; run()", "schedule",
                        f"--proxy_from={proxy_from}", "--gpus=8", "--target=h100"], capture_output=True, text=True,
                       timeout=300, env=clean_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)
  out = schedule("gpt2-tiny,fsdp")
  assert out["proxy"]["meta"]["platform"] == "gpu"
  derived = out["comparison"]["derived"]["bytes_rank0"]
  assert derived.get("reduce_scatter", 0) > 0 and derived.get("all_gather", 0) > 0
  # XLA:GPU prints the pipeline's `lax.cond` transfers as true_computation=op, false_computation=skip (XLA:CPU:
  # branch_computations={skip, op}); reading the skip branch lost every stage transfer.
  piped = schedule("gpt2-tiny,dp+pp")
  assert piped["comparison"]["derived"]["bytes_rank0"].get("permute", 0) > 0
  assert any(lp.get("pipeline_ticks") for lp in piped["proxy"]["meta"]["hlo_notes"]["loops"])


# ----------------------------------------------------------------------------- golden fingerprints, GPU HLO

GPU_PRESET_DEVICES = "nodes:2,gpus:8"  # 16 H100s: every preset's degrees at its smallest real size


def _gpu_preset_fingerprint(name: str) -> dict:
  """The step `microbench-train --preset=name --target=h100 --topology=nodes:2,gpus:8` compiles (the study's
  model at full depth; depth is fitted to memory only on real devices)."""
  from microbench import train  # pylint: disable=g-import-not-at-top
  from microbench.study import presets  # pylint: disable=g-import-not-at-top
  fields, _ = presets.resolve(name, 16, "gpu", None, {})
  s = train.run(train.TrainConfig(**fields, target="h100", topology=GPU_PRESET_DEVICES, compile_only=True,
                                  write=False, verbose=False)).summary
  return {"ops": s["comm"], "loops": [{"trip_count": lp["trip_count"], "ops": lp["ops"]} for lp in s["comm_loops"]],
          "attention_compiled": s["attention_compiled"]}


@pytest.fixture(scope="module")
def gpu_golden(update_golden):
  from microbench.study import presets  # pylint: disable=g-import-not-at-top
  if update_golden or not os.path.exists(GOLDEN):
    current = {f"preset {n}": _gpu_preset_fingerprint(n) for n in presets.PRESETS}
    with open(GOLDEN, "w") as f:
      json.dump({"jax": jax.__version__, "devices": f"h100 {GPU_PRESET_DEVICES}", "fingerprints": current}, f,
                indent=1, sort_keys=True)
      f.write("\n")
    if not update_golden:
      pytest.fail(f"{GOLDEN} was missing and has been written; check it in (rerun to compare)")
  with open(GOLDEN) as f:
    return json.load(f)


def _preset_names():
  from microbench.study import presets  # pylint: disable=g-import-not-at-top
  return list(presets.PRESETS)


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
@pytest.mark.parametrize("name", _preset_names())
def test_gpu_preset_fingerprint_matches_golden(gpu_golden, name):
  want = gpu_golden["fingerprints"][f"preset {name}"]
  got = json.loads(json.dumps(_gpu_preset_fingerprint(name)))
  assert got == want, (
      f"--preset={name} --target=h100: the GPU step's collectives changed (jax {jax.__version__}, golden made"
      f" with {gpu_golden['jax']}).\\n got  {json.dumps(got, sort_keys=True)}\\n want {json.dumps(want, sort_keys=True)}"
      "\\nIf intended, regenerate: python -m pytest tests/test_gpu_compile.py --update-golden")


# -------------------------------------------------------- the forms XLA:GPU emits (text from real compiles)

GPU_FORMS = """HloModule jit_f, is_scheduled=true, num_partitions=16

%body (p: (s32[], bf16[524288])) -> (s32[], bf16[524288]) {
  %rs = ((bf16[524288]{0}), bf16[65536]{0}) reduce-scatter-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}, use_global_device_ids=true, dimensions={0}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":true}}
  %rsd = bf16[65536]{0} reduce-scatter-done(%rs)
  %a2a = ((bf16[524288]{0}), bf16[524288]{0}) all-to-all-start(%x), channel_id=2, replica_groups={}, dimensions={0}
  %cb = ((bf16[1024]{0}), bf16[1024]{0}) collective-broadcast-start(%x), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}
  %ag = ((bf16[64]{0}, f32[32]{0}), (bf16[512]{0}, f32[256]{0})) all-gather-start(%x, %y), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}, dimensions={0}
  ROOT %t = (s32[], bf16[524288]{0}) tuple(%i, %x)
}

ENTRY %main (a: bf16[524288]) -> bf16[524288] {
  %w = (s32[], bf16[524288]{0}) while(%t0), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"10"}}
}
"""


def test_gpu_async_forms_count_their_outputs_and_empty_groups_mean_every_device():
  from microbench.hlo import parse  # pylint: disable=g-import-not-at-top
  found = {c.op: c for c in parse.find_collectives(GPU_FORMS)}
  assert found["reduce-scatter"].elements == 65536 and found["reduce-scatter"].sync is True
  assert found["reduce-scatter"].emitted == "reduce-scatter-start"
  assert found["all-to-all"].elements == 524288 and found["all-to-all"].groups == (tuple(range(16)),)
  assert found["collective-broadcast"].elements == 1024
  assert found["all-gather"].elements == 768 and found["all-gather"].element_types == ("bf16", "f32")
  assert parse.execution_counts(GPU_FORMS)["body"] == 10


DECOMPOSED = """HloModule jit_f, num_partitions=4

ENTRY %main (a: f32[64]) -> f32[64] {
  %cp0 = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%a), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3}}
  %d0 = f32[64]{0} collective-permute-done(%cp0)
  %cp1 = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%a), channel_id=2, source_target_pairs={{3,0}}
  %d1 = f32[64]{0} collective-permute-done(%cp1)
  ROOT %s = f32[64]{0} select(%p, %d0, %d1)
}
"""


def test_a_cycle_decomposed_permute_counts_as_one_operation():
  exp = hlo_check.Expectation(op="collective-permute", groups=np.array([[0, 1, 2, 3]]), ordered=False,
                              dtype="float32", elements=64, executions=1)
  assert hlo_check.verify(DECOMPOSED, exp).executions == 1
  broken = DECOMPOSED.replace("{{3,0}}", "{{3,1}}")  # the back edge to the wrong rank
  with pytest.raises(hlo_check.HloMismatch):
    hlo_check.verify(broken, exp)


CALL_START = """HloModule jit_f, num_partitions=2

%wrapped (p: f32[8]) -> f32[8] {
  ROOT %ar = f32[8]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, to_apply=%add
}

%comp (q: f32[8]) -> f32[8] {
  ROOT %x = f32[8]{0} negate(%q)
}, execution_thread="host"

ENTRY %main (a: f32[8]) -> f32[8] {
  %cs = ((f32[8]{0}), f32[8]{0}, s32[]) call-start(%a), async_execution_thread="thread", to_apply=%wrapped
  ROOT %cd = f32[8]{0} call-done(%cs)
}
"""


def test_a_collective_inside_an_async_call_is_counted_once():
  exp = hlo_check.Expectation(op="all-reduce", groups=np.array([[0, 1]]), ordered=False, dtype="float32",
                              elements=8, executions=1)
  assert hlo_check.verify(CALL_START, exp).executions == 1


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_a_reversing_feedback_fails_on_gpu_hlo_in_bfloat16(gpu_mesh):
  """On GPUs the check is strict in every dtype: a bf16 timed step that reverses the buffer fails."""
  topology, mesh = gpu_mesh

  class Reversing(collectives.AllReduce):
    name = "all_reduce with a reversing feedback"

    def step(self, carry, axes, n, platform):
      (x,) = carry  # the GPU all-reduce chains (in place)
      y = jnp.flip(self.op(x, axes, n, platform))
      return (y,), y
  with pytest.raises(hlo_check.HloMismatch, match="writes 4096 elements besides the collective"):
    program.build_timed(Reversing(), mesh, plan_scopes(topology, ["scale_up"])[0], 4096, "bfloat16", 10)


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
@pytest.mark.parametrize("count", [4096, 1 << 20])
def test_on_gpus_an_all_reduce_must_chain_undigested(gpu_mesh, count):
  """XLA:GPU's all-reduce is in place: held inputs make it copy the message every repetition (the HLO check fails
  it), so the GPU all-reduce chains. Its checked twin, never timed, digests every repetition: whatever that costs
  is reported (it may copy), never timed. The other collectives' timed programs write a few elements."""
  topology, mesh = gpu_mesh
  plan = plan_scopes(topology, ["scale_up"])[0]

  class Held(collectives.AllReduce):
    def feedback_on(self, platform):
      return "hold"

  with pytest.raises(hlo_check.HloMismatch, match=r"copy\("):
    program.build_timed(Held(), mesh, plan, count, "float32", 10, twin=False)
  real = program.build_timed(collectives.get("all_reduce"), mesh, plan, count, "float32", 10)
  assert real.verified.body_writes < 16 and real.checked.verified.executions == 10
  for name in ("all_gather", "reduce_scatter", "all_to_all", "ppermute", "broadcast"):
    long = program.build_timed(collectives.get(name), mesh, plan, count, "float32", 10)
    assert long.verified.body_writes < 16 and program.DIGEST_SCOPE not in long.hlo_text, name
    assert program.DIGEST_SCOPE in long.checked.hlo_text and long.checked.verified.executions == 10


# ------------------------------------------------------------------------------ operators and fp8 on XLA:GPU

@pytest.mark.slow
@pytest.mark.gpu_compile
@pytest.mark.parametrize("base", ["all_reduce", "reduce_scatter"])
def test_every_reduction_operator_compiles_to_its_nccl_reduction(gpu_mesh, base):
  """max, min, prod and avg compile for H100 to the async collective with that reduction computation, in the
  asked dtype, every repetition in the loop; avg is the sum times dtype(1/n) (the rounding
  collectives.Reduction.finish expects on GPUs)."""
  topology, mesh = gpu_mesh
  plan = plan_scopes(topology, ["scale_out"])[0]
  root = {"max": "maximum", "min": "minimum", "prod": "multiply", "avg": "add", "sum": "add"}
  for op in ("sum", "max", "min", "prod", "avg"):
    coll = collectives.with_op(base, op)
    point = program.build_check(coll, mesh, plan, 4096, "bfloat16")
    long = program.build_timed(coll, mesh, plan, 4096, "bfloat16", 10)
    assert point.wire_dtype == "bfloat16" and long.verified.in_loop == 10, op
    text = point.check_prog.hlo_text
    start = next(line for line in text.splitlines() if f"{coll.hlo_op}-start(" in line)
    reducer = start.split("to_apply=%")[1].split(",")[0].split()[0]
    body = text.split(f"%{reducer} ")[1].split("\n}")[0]
    assert f" {root[op]}(" in body, (op, body)
    if op == "avg":
      consts = [line for line in text.splitlines() if "bf16[] constant(" in line]
      recip = float(program.as_dtype(np.float32(1) / np.float32(plan.group_size), "bfloat16"))
      assert any(float(c.split("constant(")[1].split(")")[0]) == recip for c in consts), consts


@pytest.mark.slow
@pytest.mark.gpu_compile
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_data_collectives_run_in_fp8_on_gpus(gpu_mesh, dtype):
  """all_gather, all_to_all, ppermute and broadcast keep fp8 on the wire (XLA:CPU widens it to float16)."""
  topology, mesh = gpu_mesh
  plan = plan_scopes(topology, ["global"])[0]
  for name in ("all_gather", "all_to_all", "ppermute", "broadcast"):
    coll = collectives.get(name)
    point = program.build_check(coll, mesh, plan, 4096, dtype)
    long = program.build_timed(coll, mesh, plan, 4096, dtype, 10)
    assert point.wire_dtype == dtype and long.verified.in_loop == 10, name
  assert collectives.get("all_reduce").refuses(dtype) and collectives.get("reduce_scatter_max").refuses(dtype)
