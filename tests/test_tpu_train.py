"""Training steps compiled for TPU slices without a TPU (`microbench-train --target=v5p --topology=...`): XLA:TPU's
own program, its memory against the chip's HBM, the communication fingerprint read from XLA:TPU's forms (FSDP
weight gathers as all-reduces of zero-padded buffers, reduce-scatters as all-reduce-scatter fusions, collectives
across slices as Megascale host transfers), and the MFU peak of TPU device kinds.

Needs libtpu (the `tpu-compile` extra, jax[tpu]); the tests that compile are skipped with that reason without it.
Each check has a planted bug that fails it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock file

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from support import ROOT, clean_env  # noqa: E402
from microbench import train  # noqa: E402
from microbench.fabric import tpu_kinds  # noqa: E402
from microbench.aot import gpu_compile, tpu_compile  # noqa: E402
from microbench.train import comm_fingerprint, flops_peaks, loop  # noqa: E402
from microbench.train.config import DTYPES  # noqa: E402
from microbench.models.optimizer import adamw  # noqa: E402
from microbench.models.train_step import Trainer  # noqa: E402

NO_LIBTPU = "libtpu is not installed: pip install -e '.[tpu-compile]'"
needs_libtpu = pytest.mark.skipif(not tpu_compile.libtpu_available(), reason=NO_LIBTPU)


def _cfg(target: str, topology: str, parallelism: str, batch: int, **kw) -> train.TrainConfig:
  return train.TrainConfig(**{"model": "llama3", "size": "tiny", "dtype": "bfloat16", "parallelism": parallelism,
                              "batch": batch, "target": target, "topology": topology, "compile_only": True,
                              "write": False, "verbose": False, **kw})


def _compiled(target: str, topology: str, parallelism: str, batch: int) -> tuple[str, Trainer]:
  """XLA:TPU's program text for llama3-tiny's step on the target's chips, and its trainer."""
  p = train.plan(_cfg(target, topology, parallelism, batch))
  t = Trainer(p.spec, p.mesh, DTYPES["bfloat16"], adamw(), batch, execution=p.execution())
  return t.compile_step(None).as_text(), t


def _layer_bytes(t: Trainer) -> int:
  """Bytes of one layer of the FSDP-sharded block weights in bfloat16: what FSDP gathers per layer."""
  variables = jax.tree.leaves(t.abstract_params["blocks"], is_leaf=lambda x: hasattr(x, "get_metadata"))
  return sum(int(np.prod(v.shape[1:])) * 2 for v in variables if "embed" in v.get_metadata()["out_sharding"])


@pytest.fixture(scope="module")
def v5p_4():
  if not tpu_compile.libtpu_available():
    pytest.skip(NO_LIBTPU)
  return _compiled("v5p", "2x2x1", "fsdp:4", 4)


@pytest.fixture(scope="module")
def v5p_64():
  if not tpu_compile.libtpu_available():
    pytest.skip(NO_LIBTPU)
  return _compiled("v5p", "4x4x4", "fsdp:64", 64)


@pytest.fixture(scope="module")
def two_slices():
  if not tpu_compile.libtpu_available():
    pytest.skip(NO_LIBTPU)
  return _compiled("v5p", "2x2x1,slices:2", "dp:2,fsdp:4", 8)


# ------------------------------------------------------------------------------------- the compile and its fit

def check_fit(s: dict, kind: str) -> None:
  """A TPU target's fit: XLA:TPU's per-chip memory against all of the kind's HBM."""
  memory = tpu_kinds.target(kind).memory_bytes
  m = s["memory"]
  assert s["memory_per_device_bytes"] == m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"] - m["alias_bytes"]
  assert s["memory_per_device_bytes"] > 0
  assert s["device_memory_bytes"] == memory and s["mem_fraction"] == gpu_compile.TPU_MEM_FRACTION == 1.0
  assert s["usable_bytes"] == memory and s["margin_bytes"] == memory - s["memory_per_device_bytes"]
  assert s["fits"] is True and s["fits_whole_device"] is True


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_v6e_fsdp_step_compiles_with_memory_fit_peak_and_fingerprint():
  s = train.run(_cfg("v6e", "2x2", "fsdp:4", 4)).summary
  assert s["kind"] == "compile" and s["devices"] == 4 and s["device_kind"] == "TPU v6 lite"
  check_fit(s, "v6e")
  assert s["peak_tflops_per_device"] == tpu_kinds.target("v6e").bf16_tflops
  assert s["step_time_at_full_mfu_s"] == pytest.approx(s["flops_per_step"] / (4 * s["peak_tflops_per_device"] * 1e12))
  assert s["placement"] == {"fsdp": "4 among one host's chips (ICI)"}
  assert s["comm"]["all-gather"]["count"] > 0 and s["comm_dcn"] == {}
  text = loop.format_table(s)
  assert "fits                  yes" in text and "(100% of" in text and "step at 100% MFU" in text


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_planted_gpu_share_of_memory_fails_the_fit_check(monkeypatch):
  # Planted: a TPU target's fit against the GPU allocator's default 75% of the device.
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.setattr(loop, "target_memory", lambda name: (tpu_kinds.target(name).memory_bytes, None))
  s = train.run(_cfg("v6e", "2x2", "fsdp:4", 4)).summary
  with pytest.raises(AssertionError):
    check_fit(s, "v6e")


def test_hbm_refusals_are_read_in_both_of_xla_tpus_wordings():
  one = loop.hbm_refusal("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory"
                         " required for HLO temporaries (38.74G) exceeds available HBM (15.75G).")
  assert one["required_bytes"] == int(38.74 * 2**30) and one["available_bytes"] == int(15.75 * 2**30)
  assert one["message"].startswith("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
  two = loop.hbm_refusal("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of"
                         " memory in memory space hbm. Used 215.17G of 31.25G hbm. Exceeded hbm capacity by 183.92G.")
  assert two["required_bytes"] == int(215.17 * 2**30) and two["available_bytes"] == int(31.25 * 2**30)
  assert loop.hbm_refusal("INTERNAL: something else (38.74G) exceeds available HBM (15.75G)") is None
  assert loop.hbm_refusal("RESOURCE_EXHAUSTED: out of host memory") is None


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_a_step_too_large_for_hbm_is_a_no_with_xla_tpus_figures():
  s = train.run(_cfg("v5e", "2x2", "fsdp:4", 4, size="8b", seq_len=2048)).summary
  assert s["fits"] is False and s["fits_whole_device"] is False and s["comm"] == {}
  assert "RESOURCE_EXHAUSTED" in s["compile_refused"]
  assert s["xla_available_bytes"] <= tpu_kinds.target("v5e").memory_bytes
  assert s["memory_per_device_bytes"] > s["xla_available_bytes"]
  assert "at least" in loop.format_table(s)


# ------------------------------------------------------------------------------ the fingerprint of XLA:TPU's forms

def check_layer_gathers(report: dict, layer_bytes: int) -> None:
  """The forward scan gathers one whole layer of FSDP-sharded weights per iteration, in bfloat16."""
  forward = [lp["ops"] for lp in report["loops"] if set(lp["ops"]) == {"all-gather"}]
  assert len(forward) == 1, report["loops"]
  assert forward[0]["all-gather"]["dtypes"] == {"bf16": layer_bytes}, (forward[0], layer_bytes)


def test_the_forms_as_compiled_are_read_in_handwritten_hlo():
  hlo = "\n".join([
      "%add (a: bf16[], b: bf16[]) -> bf16[] {", "  ROOT %s = bf16[] add(%a, %b)", "}",
      "%ars (p: bf16[8,4]) -> bf16[2,4] {",
      "  %ar = bf16[8,4]{1,0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add",
      "  %i = u32[] partition-id()",
      "  ROOT %ds = bf16[2,4]{1,0} dynamic-slice(%ar, %i, %i), dynamic_slice_sizes={2,4}", "}",
      "ENTRY %main (w: bf16[2,4], g: bf16[8,4]) -> bf16[8,4] {",
      "  %z = bf16[] constant(0)", "  %zeros = bf16[8,4]{1,0} broadcast(%z), dimensions={}",
      "  %i = u32[] partition-id()",
      "  %pad = bf16[8,4]{1,0} dynamic-update-slice(%zeros, %w, %i, %i)",
      "  %gather = bf16[8,4]{1,0} all-reduce(%pad), replica_groups={{0,1,2,3}}, to_apply=%add",
      "  %grad = bf16[8,4]{1,0} all-reduce(%g), replica_groups={{0,1,2,3}}, to_apply=%add",
      "  %rs = bf16[2,4]{1,0} fusion(%g), kind=kCustom, calls=%ars",
      '  %s = (bf16[4,128]{1,0}, u32[], token[]) send(%g, %t), channel_id=1, is_host_transfer=true,'
      ' frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
      '_xla_host_transfer_rendezvous="ar.1_0",_xla_megascale_transfer_type="ALL_REDUCE"}',
      '  %r = (bf16[4,128]{1,0}, u32[], token[]) recv(%t), channel_id=2, is_host_transfer=true,'
      ' frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
      '_xla_host_transfer_rendezvous="ar.1_0",_xla_megascale_transfer_type="ALL_REDUCE"}',
      '  %s2 = (bf16[4]{0}, u32[], token[]) send(%w, %t), channel_id=3, is_host_transfer=true,'
      ' frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
      '_xla_host_transfer_rendezvous="ag.1_0",_xla_megascale_transfer_type="ALL_GATHER"}',
      '  %r2 = (bf16[8]{0}, u32[], token[]) recv(%t), channel_id=4, is_host_transfer=true,'
      ' frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
      '_xla_host_transfer_rendezvous="ag.1_0",_xla_megascale_transfer_type="ALL_GATHER"}',
      "  ROOT %out = bf16[8,4]{1,0} add(%gather, %grad)", "}",
  ])
  r = comm_fingerprint.comm_report(hlo, 4)
  assert r["ops"] == {
      "all-reduce": {"count": 2, "bytes": 64 + 1024, "dtypes": {"bf16": 64 + 1024}},  # the gradient; the DCN one
      "all-gather": {"count": 2, "bytes": 64 + 16, "dtypes": {"bf16": 80}},  # the padded buffer; the DCN recv
      "reduce-scatter": {"count": 1, "bytes": 64, "dtypes": {"bf16": 64}}}  # the fusion's input
  assert r["dcn"] == {"all-reduce": {"count": 1, "bytes": 1024, "dtypes": {"bf16": 1024}},
                      "all-gather": {"count": 1, "bytes": 16, "dtypes": {"bf16": 16}}}
  assert r["forms"] == {"all-reduce": {comm_fingerprint.DCN: 1},
                        "all-gather": {comm_fingerprint.DCN: 1, comm_fingerprint.ZERO_PADDED: 1},
                        "reduce-scatter": {comm_fingerprint.SCATTER_FUSION: 1}}
  # Only zeros make a gather: the same all-reduce of a buffer padded with ones is a reduction.
  ones = comm_fingerprint.comm_report(hlo.replace("constant(0)", "constant(1)"), 4)
  assert ones["ops"]["all-reduce"]["count"] == 3 and ones["ops"]["all-gather"]["count"] == 1


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_weight_gathers_compiled_as_all_gathers_are_counted_per_layer(v5p_4):
  hlo, t = v5p_4
  report = comm_fingerprint.comm_report(hlo, 4)
  check_layer_gathers(report, _layer_bytes(t))
  # The gradients leave as XLA:TPU's all-reduce-scatter fusions, counted as reduce-scatters of their input.
  assert report["forms"].get("reduce-scatter", {}).get(comm_fingerprint.SCATTER_FUSION, 0) > 0
  assert "all-gather" not in report["forms"]


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_weight_gathers_compiled_as_zero_padded_all_reduces_are_counted_as_gathers(v5p_64):
  hlo, t = v5p_64
  report = comm_fingerprint.comm_report(hlo, 64)
  assert report["forms"]["all-gather"][comm_fingerprint.ZERO_PADDED] > 0  # XLA:TPU's form at 64 chips
  assert not re.search(r"\sall-gather(-start)?\(", hlo)  # no native all-gather in the program
  check_layer_gathers(report, _layer_bytes(t))


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_planted_reader_blind_to_zero_padded_gathers_fails(v5p_64, monkeypatch):
  hlo, t = v5p_64
  monkeypatch.setattr(comm_fingerprint._Module, "zero_padded", lambda self, name, comp: False)
  with pytest.raises(AssertionError):
    check_layer_gathers(comm_fingerprint.comm_report(hlo, 64), _layer_bytes(t))


def check_dcn(report: dict, hlo: str, gradient_bytes: int) -> None:
  """Each collective across slices counts once (a send/recv pair is one transfer) as its collective, and
  the data-parallel gradient reduction over DCN carries at least every chip's gradient shard."""
  rendezvous = set(re.findall(r'_xla_host_transfer_rendezvous="([^"]+)"', hlo))
  assert sum(v["count"] for v in report["dcn"].values()) == len(rendezvous) > 0
  assert report["dcn"]["all-reduce"]["dtypes"]["bf16"] >= gradient_bytes
  assert report["ops"]["all-reduce"]["count"] >= report["dcn"]["all-reduce"]["count"]


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_collectives_across_slices_are_counted_as_dcn_collectives(two_slices):
  hlo, t = two_slices
  params = jax.tree.leaves(t.abstract_params, is_leaf=lambda x: hasattr(x, "get_metadata"))
  shard_bytes = sum(int(np.prod(v.shape)) * 2 for v in params if "embed" in v.get_metadata()["out_sharding"]) // 4
  report = comm_fingerprint.comm_report(hlo, 8)
  check_dcn(report, hlo, shard_bytes)
  assert set(report["forms"]["all-reduce"]) == {comm_fingerprint.DCN}
  assert train.format_table({**_table_fields(), "comm": report["ops"], "comm_dcn": report["dcn"],
                             "comm_forms": report["forms"]}).count("over DCN") == 1


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize("planted", ["ignore Megascale transfers", "count the recv too"])
def test_planted_dcn_readers_fail(two_slices, monkeypatch, planted):
  hlo, t = two_slices
  params = jax.tree.leaves(t.abstract_params, is_leaf=lambda x: hasattr(x, "get_metadata"))
  shard_bytes = sum(int(np.prod(v.shape)) * 2 for v in params if "embed" in v.get_metadata()["out_sharding"]) // 4
  real = comm_fingerprint._megascale
  if planted == "ignore Megascale transfers":
    monkeypatch.setattr(comm_fingerprint, "_megascale", lambda line, module: None)
  else:  # both halves of every pair
    def both(line, module):
      got = real(line, module)
      if got == [] and " recv(" in line:
        return real(line.replace(" recv(", " send("), module)
      return got
    monkeypatch.setattr(comm_fingerprint, "_megascale", both)
  with pytest.raises((AssertionError, KeyError)):
    check_dcn(comm_fingerprint.comm_report(hlo, 8), hlo, shard_bytes)


def _table_fields() -> dict:
  """A compile summary's fields format_table needs (the comm rows are what the caller checks)."""
  return {"kind": "compile", "item": "tokens", "model": "llama3", "size": "tiny", "layers": 2, "params": 1e5,
          "parallelism": "dp:2,fsdp:4", "mesh": "data=2 fsdp=4", "placement": {}, "batch": 8, "seq_len": 128,
          "dtype": "bfloat16", "scan_layers": True, "remat": "full", "attention": "xla", "attention_note": "",
          "flops_per_step": 1.0, "flops_formula": "", "memory": dict.fromkeys(
              ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes"), 0), "memory_per_device_bytes": 0,
          "compile_time_s": 1.0, "comm_loops": []}


# ------------------------------------------------------------------------------------------------------ MFU peaks

def check_tpu_peaks() -> None:
  """Every TPU device kind JAX reports finds its own kind's bf16 peak, whatever the dtype; others none."""
  for device_kind, kind in (("TPU v5", "v5p"), ("TPU v5p", "v5p"), ("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e")):
    for dtype in ("bfloat16", "float32"):  # float32 matmuls run as bf16 passes on a TPU
      peak = flops_peaks.table_peak(device_kind, dtype)
      assert peak is not None and peak.tflops == tpu_kinds.target(kind).bf16_tflops, (device_kind, dtype)
      assert tpu_kinds.target(kind).title in peak.source
  assert flops_peaks.table_peak("TPU v7x", "bfloat16") is None and flops_peaks.table_peak("TPU", "bfloat16") is None


def test_tpu_device_kinds_find_their_bf16_peak_exactly():
  check_tpu_peaks()
  device = type("Device", (), {"platform": "tpu", "device_kind": "TPU v6 lite"})()
  assert flops_peaks.device_peak(device, "bfloat16", 4).tflops == tpu_kinds.target("v6e").bf16_tflops
  unknown = flops_peaks.device_peak(type("Device", (), {"platform": "tpu", "device_kind": "TPU v9"})(), "bfloat16", 4)
  assert unknown.tflops is None and "unknown device kind" in unknown.source


def test_planted_normalised_device_kind_fails_the_peak_check(monkeypatch):
  # Planted: device kinds "normalised" by dropping " lite", which gives a v5e the v5p's peak.
  monkeypatch.setattr(tpu_kinds, "lookup", lambda dk: tpu_kinds.by_device_kind().get(dk.replace(" lite", "").strip()))
  with pytest.raises(AssertionError):
    check_tpu_peaks()


# ------------------------------------------------------------------------------------------------- bad requests

def _cli(args: list[str], code: str = "") -> subprocess.CompletedProcess:
  prog = f"{code}\nfrom microbench.cli import train\ntrain.run()"
  return subprocess.run([sys.executable, "-c", prog, *args], capture_output=True, text=True, timeout=180,
                        env=clean_env(ALLOW_MULTIPLE_LIBTPU_LOAD="1"), cwd=ROOT)


@pytest.mark.parametrize("args,line", [
    (["--target=v5p", "--topology=4x4"], "--topology='4x4': a TPU v5p slice has 3 torus dimensions (e.g. 4x4x4), not 2"),
    (["--target=v6e", "--topology=nodes:2,gpus:8"], "--topology='nodes:2,gpus:8' is not a TPU v6e (Trillium) slice"),
    (["--target=v9", "--topology=2x2"], "unknown TPU --target='v9': choose one of"),
])
def test_bad_tpu_requests_are_one_line(args, line):
  r = _cli([*args, "--model=llama3", "--size=tiny"])
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"microbench-train: error: {line}"), r.stderr[-2000:]


def test_without_libtpu_a_tpu_target_names_the_extra():
  patch = "from microbench.aot import tpu_compile as t\nt.libtpu_available = lambda: False"
  r = _cli(["--target=v5p", "--topology=2x2x1", "--model=llama3", "--size=tiny"], patch)
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      "microbench-train: error: a TPU --target compiles with XLA:TPU, which needs libtpu: pip install -e '.[tpu-compile]'"
      " (jax[tpu], about 700 MB; no TPU needed)"], r.stderr[-2000:]


# ------------------------------------------------------------------------- golden fingerprints, XLA:TPU's HLO

TPU_GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "comm_fingerprints_v5p.json")
TPU_PRESET_SLICE = ("v5p", "2x2x4")  # 16 chips, 4 hosts: every preset's degrees at the study's smallest size


def tpu_preset_fields(name: str) -> dict:
  """The preset's strategy on 16 v5p chips (its model's full width, degrees, microbatches and schedule) at a
  depth of one scan of two layers per stage, 256 tokens and the smallest batch its degrees take: the study's
  full shapes do not fit 16 chips' HBM, and XLA:TPU refuses to compile what does not fit. The tokens set the
  activations' sizes; the loops, forms and collectives are those of 1024 tokens but one: the pipelines' input
  gradient (f32 [M, mb, S, d] over the stages) is small enough at 256 for XLA:TPU's combiner to merge it into
  the loss's all-reduce. 1024 took ~80 more of CI's CPU-seconds over the five (XLA:TPU's compile)."""
  from microbench.meshes import parallelism as par  # pylint: disable=g-import-not-at-top
  from microbench.study import presets  # pylint: disable=g-import-not-at-top
  fields, _ = presets.resolve(name, 16, "tpu", None, {})
  p = par.parse_parallelism(fields["parallelism"])
  fields.update(layers=2 * p.degree("pp"), batch=p.batch_shards * fields.get("microbatches", 1))
  if fields.get("seq_len"):
    fields["seq_len"] = 256
  return fields


def _tpu_preset_fingerprint(name: str) -> dict:
  kind, shape = TPU_PRESET_SLICE
  s = train.run(train.TrainConfig(**tpu_preset_fields(name), target=kind, topology=shape, compile_only=True,
                                  write=False, verbose=False)).summary
  assert not s.get("compile_refused"), s["compile_refused"]
  return {"ops": s["comm"], "dcn": s["comm_dcn"], "forms": s["comm_forms"],
          "loops": [{"trip_count": lp["trip_count"], "ops": lp["ops"]} for lp in s["comm_loops"]]}


def _preset_names() -> list[str]:
  from microbench.study import presets  # pylint: disable=g-import-not-at-top
  return list(presets.PRESETS)


@pytest.fixture(scope="module")
def tpu_golden(update_golden):
  import json  # pylint: disable=g-import-not-at-top
  if not tpu_compile.libtpu_available():
    pytest.skip(NO_LIBTPU)
  if update_golden or not os.path.exists(TPU_GOLDEN):
    current = {f"preset {n}": _tpu_preset_fingerprint(n) for n in _preset_names()}
    with open(TPU_GOLDEN, "w") as f:
      json.dump({"jax": jax.__version__, "libtpu": _libtpu_version(), "devices": " ".join(TPU_PRESET_SLICE),
                 "fingerprints": current}, f, indent=1, sort_keys=True)
      f.write("\n")
    if not update_golden:
      pytest.fail(f"{TPU_GOLDEN} was missing and has been written; check it in (rerun to compare)")
  with open(TPU_GOLDEN) as f:
    return json.load(f)


def _libtpu_version() -> str | None:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version("libtpu")
  except metadata.PackageNotFoundError:
    return None


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.long
@pytest.mark.parametrize("name", _preset_names())
def test_tpu_preset_fingerprint_matches_golden(tpu_golden, name):
  import json  # pylint: disable=g-import-not-at-top
  want = tpu_golden["fingerprints"][f"preset {name}"]
  got = json.loads(json.dumps(_tpu_preset_fingerprint(name)))
  assert got == want, (
      f"--preset={name} --target=v5p --topology=2x2x4: XLA:TPU's step's collectives changed (jax {jax.__version__},"
      f" libtpu {_libtpu_version()}; golden made with jax {tpu_golden['jax']}, libtpu {tpu_golden['libtpu']}).\n"
      f" got  {json.dumps(got, sort_keys=True)}\n want {json.dumps(want, sort_keys=True)}\n"
      "If intended, regenerate: python -m pytest tests/test_tpu_train.py -m '' -k golden --update-golden")


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_tpu_golden_file_covers_every_preset_and_is_not_blind(tpu_golden):
  assert sorted(tpu_golden["fingerprints"]) == sorted(f"preset {n}" for n in _preset_names())
  fps = [json_key(fp) for fp in tpu_golden["fingerprints"].values()]
  assert len(set(fps)) == len(fps)  # five strategies, five different fingerprints


def json_key(fp: dict) -> str:
  import json  # pylint: disable=g-import-not-at-top
  return json.dumps(fp, sort_keys=True)
