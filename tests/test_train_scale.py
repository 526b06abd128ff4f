"""Training at real scale, checked on 8 CPU devices through the compiled programs: ZeRO-3 memory and per-layer
bfloat16 gathers, remat savings, compile size flat in depth, compile-only on the Llama-3 70B shape,
gradient clipping, the attention choice and the MFU peak table. Each check has a planted bug that fails it.
"""

from __future__ import annotations

import json
import os
import types

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from _trainers import FAST, compiled_step, flat, make_trainer, memory, partitioned_hlo  # noqa: E402
from microbench.meshes import parallelism as par  # noqa: E402
from microbench import train  # noqa: E402
from microbench.train import comm_fingerprint, config, flops_peaks  # noqa: E402
from microbench.models import get_model, layers  # noqa: E402
from microbench.models.layers import REMAT_POLICIES, Execution  # noqa: E402
from microbench.models.optimizer import AdamWConfig, sgd  # noqa: E402

# ---------------------------------------------------------------------------------------------------------
# ZeRO-3 FSDP


def _fsdp_over_dp_temp(rules: par.LogicalRules = par.RULES) -> float:
  """DP's temporary memory per device over FSDP's, GPT-2 1.3B at 8 layers (weights dominate), float32."""
  kw = dict(size="1.3b", layers=8, seq_len=32, execution=Execution(remat="full"))
  dp = memory(make_trainer("gpt2", "dp:8", **kw))
  fsdp = memory(make_trainer("gpt2", "fsdp:8", rules=rules, **kw))
  return dp["temp"] / fsdp["temp"]


@pytest.mark.slow
def test_fsdp_shards_the_working_memory():
  assert _fsdp_over_dp_temp() >= 2.0  # measured 3.9x (docs/measured-figures.md)
  # Planted: FSDP that shards no weight dimension (every weight whole on every device, as DP).
  unsharded = tuple((n, None if n in ("embed", "conv_out") else a) for n, a in par.RULES)
  assert _fsdp_over_dp_temp(unsharded) < 1.2


def _layer_gathers(dtype, remat: str = "dots_with_no_batch_dims_saveable") -> tuple[dict, dict, int]:
  """(forward loop's, backward loop's per-iteration collectives after SPMD partitioning, bytes of one block's
  FSDP-sharded weights in `dtype`) for GPT-2 tiny at 3 layers under fsdp:8."""
  t = make_trainer("gpt2", "fsdp:8", layers=3, dtype=dtype, execution=Execution(remat=remat))
  loops = comm_fingerprint.comm_report(partitioned_hlo(t), 8)["loops"]
  assert len(loops) == 2, loops  # the forward scan and the backward scan over the layers
  variables = jax.tree.leaves(t.abstract_params["blocks"], is_leaf=lambda x: hasattr(x, "get_metadata"))
  size = jnp.dtype(dtype).itemsize
  sharded = sum(int(np.prod(v.shape[1:])) * size for v in variables  # one layer of each stacked weight
                if "embed" in v.get_metadata()["out_sharding"])
  return loops[0]["ops"], loops[1]["ops"], sharded


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["dots_with_no_batch_dims_saveable", "none"])
def test_fsdp_gathers_each_layer_in_bfloat16_in_forward_and_backward(remat):
  fwd, bwd, layer_bytes = _layer_gathers(jnp.bfloat16, remat)
  assert fwd["all-gather"]["dtypes"] == {"bf16": layer_bytes}  # the whole layer, once, in bfloat16
  # Gathered again in the backward pass (every weight matrix; a bias's gradient needs no weight), even with
  # --remat=none: the full weights are never kept from forward to backward.
  assert set(bwd["all-gather"]["dtypes"]) == {"bf16"} and bwd["all-gather"]["bytes"] >= 0.99 * layer_bytes
  assert set(bwd["all-reduce"]["dtypes"]) >= {"bf16"}  # weight gradients reduced in the compute dtype


def test_planted_gather_before_cast_moves_float32(monkeypatch):
  # Planted: the weight gathered first and cast after (what sharding propagation does unless told otherwise).
  def gather_then_cast(v, dtype):
    names = v.get_metadata()["out_sharding"]
    value = v[...]
    return par.constrain_for_use(value, names[len(names) - value.ndim:]).astype(dtype)
  monkeypatch.setattr(layers, "weight", gather_then_cast)
  fwd, _, layer_bytes = _layer_gathers(jnp.bfloat16)
  assert fwd["all-gather"]["dtypes"] != {"bf16": layer_bytes}
  assert fwd["all-gather"]["dtypes"].get("f32", 0) > 0


# ---------------------------------------------------------------------------------------------------------
# Depth and memory


@pytest.mark.slow
def test_remat_policies_trade_memory_in_order():
  temp = {r: memory(make_trainer("gpt2", "dp:1", layers=4, batch=64, seq_len=128,
                                 execution=Execution(remat=r)))["temp"] for r in REMAT_POLICIES}
  # Measured (MiB): none 477, dots_saveable 234, dots_with_no_batch_dims 166, save_qkv_attention 152, full 120.
  assert temp["none"] > temp["dots_saveable"] > temp["dots_with_no_batch_dims_saveable"] > temp["full"]
  assert temp["dots_with_no_batch_dims_saveable"] > temp["save_qkv_attention"] > temp["full"]
  assert temp["none"] > 3 * temp["full"]


def _program_lines(depth: int, scan: bool) -> int:
  t = make_trainer("gpt2", "fsdp:2,tp:2", layers=depth, execution=Execution(scan=scan))
  return len(compiled_step(t).as_text().splitlines())


@pytest.mark.slow
def test_program_size_is_flat_in_depth():
  """Compile time follows program size; with scanned layers the program does not grow with depth
  (scripts/bench_compile.py measures the compile time itself: GPT-2 124M, 2 vs 24 layers)."""
  two, eight = _program_lines(2, True), _program_lines(8, True)
  assert eight <= 1.05 * two, (two, eight)
  # The contrast that proves the measure: unrolled, the program grows with every layer.
  assert _program_lines(5, False) > 1.5 * _program_lines(2, False)  # measured 1.75x


@pytest.mark.slow
def test_comm_fingerprint_counts_loop_iterations():
  scanned = comm_fingerprint.comm_report(compiled_step(make_trainer("gpt2", "fsdp:8", layers=3)).as_text(), 8)
  unrolled = comm_fingerprint.comm_fingerprint(
      compiled_step(make_trainer("gpt2", "fsdp:8", layers=3, execution=Execution(scan=False))).as_text(), 8)
  assert [lp["trip_count"] for lp in scanned["loops"]] == [3, 3]
  # XLA may combine collectives differently when unrolled, but the bytes gathered per step are the same.
  assert scanned["ops"]["all-gather"]["bytes"] == unrolled["all-gather"]["bytes"]
  # Counting each loop body once (as before) would miss two of the three layers' gathers.
  body_once = sum(lp["ops"]["all-gather"]["bytes"] for lp in scanned["loops"])
  assert scanned["ops"]["all-gather"]["bytes"] - 2 * body_once < unrolled["all-gather"]["bytes"]


def test_loop_multiplicity_in_handwritten_hlo():
  hlo = "\n".join([
      "%inner (p: f32[4]) -> f32[4] {",
      "  %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add",
      "}",
      "%outer (p: f32[4]) -> f32[4] {",
      '  %w = f32[4]{0} while(%p), condition=%c1, body=%inner, backend_config={"known_trip_count":{"n":"5"}}',
      "  %ag = f32[8]{0} all-gather(%p), replica_groups={{0,1}}, dimensions={0}",
      "}",
      "%nocount (p: f32[4]) -> f32[4] {",
      "  %cp = f32[4]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}",
      "}",
      "ENTRY %main (p: f32[4]) -> f32[4] {",
      '  %w1 = f32[4]{0} while(%p), condition=%c0, body=%outer, backend_config={"known_trip_count":{"n":"3"}}',
      "  %w2 = f32[4]{0} while(%p), condition=%c2, body=%nocount",
      "  ROOT %ar2 = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add",
      "}",
  ])
  r = comm_fingerprint.comm_report(hlo, 2)
  assert r["ops"]["all-reduce"] == {"count": 16, "bytes": 16 * 16, "dtypes": {"f32": 256}}  # 3 x 5 + 1
  assert r["ops"]["all-gather"]["count"] == 3 and r["ops"]["collective-permute"]["count"] == 1
  loops = {lp["body"]: lp for lp in r["loops"]}
  assert loops["inner"]["trip_count"] == 5 and loops["inner"]["times"] == 3
  assert loops["inner"]["ops"]["all-reduce"]["count"] == 1  # per iteration
  assert loops["nocount"]["trip_count"] is None  # unknown: counted once, and said so


def test_compile_only_on_the_llama3_70b_shape():
  """All 80 layers of Llama-3 70B compile on 8 CPU devices without creating a parameter."""
  cfg = train.TrainConfig(model="llama3", size="70b", parallelism="fsdp:8", batch=8, seq_len=2048,
                          dtype="bfloat16", compile_only=True, write=False, verbose=False, compiler_options=FAST)
  r = train.run(cfg, train.plan(cfg, jax.devices()[:8]))
  s = r.summary
  assert s["kind"] == "compile" and r.state is None and r.losses == []
  assert s["layers"] == 80 and s["params"] == 70_553_706_496
  # Parameters and both Adam moments, float32, split 8 ways.
  assert s["memory"]["argument_bytes"] == pytest.approx(12 * s["params"] / 8, rel=0.01)
  assert s["flops_per_step"] == get_model("llama3", "70b", seq_len=2048).step_flops(8)
  assert [lp["trip_count"] for lp in s["comm_loops"]] == [80, 80]
  per_layer = 3 * 8192 * 28672 + 2 * 8192 * 8192 + 2 * 8192 * 1024  # MLP + Q,O + K,V weights of one layer
  gathered = s["comm_loops"][0]["ops"]["all-gather"]["bytes"]
  assert gathered == pytest.approx(4 * per_layer, rel=0.01)  # one layer per iteration (CPU widens bf16 to f32)
  assert s["comm"]["all-gather"]["count"] >= 80 * 7


# ---------------------------------------------------------------------------------------------------------
# Clipping


@pytest.mark.slow
def test_clipping_scales_the_update_to_the_clip_norm():
  t = make_trainer("gpt2", "dp:1", tx=sgd(1.0, clip_norm=0.0))
  params, rest, _ = t.init_state()
  batch = t.batch_fn()(0)
  with t.context():
    _, grads = t.grads_fn().lower(params, rest, batch).compile(FAST)(params, rest, batch)
  g = flat(grads)
  norm = float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in g.values())))
  p0 = flat(params)

  def step_with(clip_norm: float) -> tuple[dict, float]:
    tc = make_trainer("gpt2", "dp:1", tx=sgd(1.0, clip_norm=clip_norm))
    ps, opt = jax.tree.map(jnp.copy, params), tc.tx.init(params)  # the step donates its inputs
    with tc.context():
      step = tc.step_fn().lower(ps, rest, opt, batch).compile(FAST)
    new, _, _, metrics = step(ps, rest, opt, batch)
    return flat(new), float(metrics["grad_norm"])

  clipped, logged = step_with(0.1 * norm)
  assert logged == pytest.approx(norm, rel=1e-5)  # the logged norm is before clipping
  for k in p0:
    np.testing.assert_allclose(clipped[k], p0[k] - 0.1 * g[k], rtol=1e-5, atol=1e-7)
  # Planted: clipping off. The same check must fail.
  unclipped, _ = step_with(0.0)
  with pytest.raises(AssertionError):
    for k in p0:
      np.testing.assert_allclose(unclipped[k], p0[k] - 0.1 * g[k], rtol=1e-5, atol=1e-7)
  assert AdamWConfig().clip_norm == 1.0 and train.TrainConfig().clip_norm == 1.0


# ---------------------------------------------------------------------------------------------------------
# Attention choice


def _gpu(kind: str = "NVIDIA H200", capability: str = "9.0", version: str = "cuda 12080"):
  return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=capability,
                               client=types.SimpleNamespace(platform_version=version))


@pytest.mark.parametrize("model,dtype,device,strategy,want", [
    ("llama3", "bfloat16", _gpu(), "dp:1", "cudnn"),
    ("gpt2", "bfloat16", _gpu("NVIDIA A100-SXM4-80GB", "8.0"), "dp:1", "cudnn"),
    ("llama3", "float32", _gpu(), "dp:1", "xla"),  # cuDNN's flash attention needs 16-bit inputs
    ("llama3", "bfloat16", _gpu(version="rocm 6.2"), "dp:1", "xla"),  # not NVIDIA
    ("llama3", "bfloat16", _gpu(capability="7.0"), "dp:1", "xla"),
    ("llama3", "bfloat16", jax.devices()[0], "dp:1", "xla"),  # CPU
])
def test_auto_attention_takes_cudnn_where_it_applies(model, dtype, device, strategy, want):
  spec = get_model(model, "8b" if model == "llama3" else "1.3b", seq_len=128)
  impl, why = config.choose_attention("auto", spec, dtype, device, par.parse_parallelism(strategy))
  assert impl == want and why.startswith("auto")


def test_cudnn_attention_refused_with_one_line_where_it_cannot_run():
  spec = get_model("llama3", "tiny", seq_len=32)
  with pytest.raises(config.ConfigError, match="needs an NVIDIA GPU") as e:
    config.choose_attention("cudnn", spec, "bfloat16", jax.devices()[0], par.parse_parallelism("dp:1"))
  assert "\n" not in str(e.value)
  # A head dimension cuDNN can't take (Llama tiny: 16 is fine; 260 is not).
  import dataclasses
  wide = dataclasses.replace(spec, config=dataclasses.replace(
      spec.config, block=dataclasses.replace(spec.config.block, d_model=4 * 260, num_heads=4)))
  with pytest.raises(config.ConfigError, match="head dimension"):
    config.choose_attention("cudnn", wide, "bfloat16", _gpu(), par.parse_parallelism("dp:1"))


# ---------------------------------------------------------------------------------------------------------
# MFU peaks


@pytest.mark.parametrize("kind,bf16,tf32", [
    ("NVIDIA H100 80GB HBM3", 989.0, 494.5),  # H100 SXM
    ("NVIDIA H100 PCIe", 756.0, 378.0),
    ("NVIDIA H100 NVL", 835.0, 417.5),
    ("NVIDIA H200", 989.0, 494.5),
    ("NVIDIA H200 NVL", 835.0, 417.5),  # a substring match would give the H200's 989
    ("NVIDIA GB200", 2500.0, 1250.0),
    ("NVIDIA B200", 2250.0, 1100.0),  # ... and the GB200's 2500 here
    ("NVIDIA B300 SXM6 AC", 2250.0, 1125.0),
])
def test_peak_table_matches_the_exact_device_kind(kind, bf16, tf32):
  assert flops_peaks.table_peak(kind, "bfloat16").tflops == bf16
  assert flops_peaks.table_peak(kind, "float32").tflops == tf32
  assert "datasheet" in flops_peaks.table_peak(kind, "bfloat16").source or "specifications" in \
      flops_peaks.table_peak(kind, "bfloat16").source


def test_unknown_device_kind_gives_no_peak_and_no_mfu():
  for kind in ("NVIDIA H100", "NVIDIA H100 SXM5 94GB", "NVIDIA GeForce RTX 4090", "H200"):
    assert flops_peaks.table_peak(kind, "bfloat16") is None, kind
  p = flops_peaks.device_peak(_gpu("NVIDIA H100 SXM5 94GB"), "bfloat16", 8)
  assert p.tflops is None and "unknown device kind" in p.source


def test_cpu_peak_is_the_median_of_several_calibrations():
  cal = flops_peaks.calibrate_cpu_matmul("float32", n=256, runs=5, reps=2)
  assert len(cal["tflops_runs"]) == 5 and cal["median_tflops"] == np.median(cal["tflops_runs"])
  assert cal["spread"] == pytest.approx((max(cal["tflops_runs"]) - min(cal["tflops_runs"])) / cal["median_tflops"])


def test_cpu_peak_is_measured_once_per_machine_and_reused(tmp_path, monkeypatch):
  """Two runs on one machine use the same peak (its date and spread kept), so their MFU compares like their
  throughput; MICROBENCH_REMEASURE_PEAK measures again; another dtype is another entry."""
  monkeypatch.setenv("MICROBENCH_PEAK_CACHE", str(tmp_path / "peaks.json"))
  monkeypatch.delenv("MICROBENCH_REMEASURE_PEAK", raising=False)
  calls = []
  monkeypatch.setattr(flops_peaks, "calibrate_cpu_matmul", lambda dtype: calls.append(dtype) or {
      "tflops_runs": [1.0 + len(calls), 2.0, 3.0], "median_tflops": 1.0 + len(calls), "spread": 0.5,
      "matmul": "1024^3 " + dtype, "best_of": 3})
  cpu = jax.devices("cpu")[0]
  first, second = (flops_peaks.device_peak(cpu, "float32", 8) for _ in range(2))
  assert calls == ["float32"] and first.tflops == second.tflops == 2.0 / 8
  assert "measured now" in first.source and "reused" in second.source and "spread 50%" in second.source
  assert json.load(open(tmp_path / "peaks.json"))  # kept with its date
  assert flops_peaks.device_peak(cpu, "bfloat16", 8).tflops == 3.0 / 8 and calls == ["float32", "bfloat16"]
  monkeypatch.setenv("MICROBENCH_REMEASURE_PEAK", "1")
  assert flops_peaks.device_peak(cpu, "float32", 8).tflops == 4.0 / 8 and len(calls) == 3


def test_an_implausible_cpu_calibration_is_neither_used_nor_kept(tmp_path, monkeypatch):
  """A calibration that timed something else (815 TFLOP/s on 2 cores was once cached here) gives no MFU rather
  than ~0%, is not written to the cache, and a cached one is measured again."""
  path = tmp_path / "peaks.json"
  monkeypatch.setenv("MICROBENCH_PEAK_CACHE", str(path))
  monkeypatch.delenv("MICROBENCH_REMEASURE_PEAK", raising=False)
  rates = [815.0, 0.05]
  monkeypatch.setattr(flops_peaks, "calibrate_cpu_matmul", lambda dtype: {
      "tflops_runs": [rates[0]], "median_tflops": rates.pop(0), "spread": 0.0, "matmul": "1024^3 " + dtype,
      "best_of": 3})
  cpu = jax.devices("cpu")[0]
  bad = flops_peaks.device_peak(cpu, "float32", 8)
  assert bad.tflops is None and "not kept, no MFU" in bad.source and not path.exists()
  good = flops_peaks.device_peak(cpu, "float32", 8)
  assert good.tflops == pytest.approx(0.05 / 8) and path.exists()
  cache = json.loads(path.read_text())
  key = next(iter(cache))
  cache[key]["median_tflops"] = 815.0  # a bad entry from before the check
  path.write_text(json.dumps(cache))
  rates.append(0.06)
  assert flops_peaks.device_peak(cpu, "float32", 8).tflops == pytest.approx(0.06 / 8)
