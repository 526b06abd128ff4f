"""A training run's figures and outputs; the CLI end to end; bad input gets one clear line. (Equivalence of
the strategies: test_equivalence.py; scale features: test_train_scale.py; golden fingerprints:
test_golden_comm.py.)"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from microbench import train  # noqa: E402
from microbench.train import comm_fingerprint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = {"xla_backend_optimization_level": 0}  # partitioning unchanged; LLVM codegen skipped: faster compiles


@functools.cache
def _run(model: str, parallelism: str, dtype: str = "float32") -> train.Result:
  n = int(np.prod([int(x.split(":")[1]) for x in parallelism.split(",")]))
  cfg = train.TrainConfig(model=model, size="tiny", parallelism=parallelism, batch=8, seq_len=32, steps=3,
                          warmup_steps=1, dtype=dtype, write=False, verbose=False, compiler_options=FAST)
  assert jax.device_count() >= n, "needs 8 CPU devices (JAX_NUM_CPU_DEVICES=8)"
  return train.run(cfg, train.plan(cfg, jax.devices()[:n]))


@pytest.mark.slow
def test_bfloat16_compute_matches_within_bf16_tolerance():
  ref = _run("gpt2", "dp:1")
  bf16 = _run("gpt2", "dp:2,fsdp:2,tp:2", "bfloat16")
  np.testing.assert_allclose(bf16.losses, ref.losses, rtol=2e-2)
  params = bf16.state[0]
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("float32")}  # parameters stay float32


@pytest.mark.slow
def test_summary_figures_are_consistent():
  s = _run("gpt2", "dp:2,fsdp:2,tp:2").summary
  assert s["tokens_per_step"] == 8 * 32
  assert s["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / s["median_step_time_s"])
  assert s["tokens_per_s_per_device"] == pytest.approx(s["tokens_per_s"] / 8)
  assert s["tflops_per_device"] == pytest.approx(s["flops_per_step"] / s["median_step_time_s"] / 8 / 1e12)
  assert s["mfu"] == pytest.approx(s["tflops_per_device"] / s["peak_tflops_per_device"])
  # Headline MFU counts causal attention half; the full-attention figure sits beside it.
  assert s["flops_per_step"] < s["flops_per_step_full_attention"]
  assert s["mfu_full_attention"] == pytest.approx(s["mfu"] * s["flops_per_step_full_attention"] / s["flops_per_step"])
  assert "causal attention counted half" in s["flops_formula"]
  assert "CPU matmul peak of this machine" in s["peak_source"] and len(s["peak_calibration"]["tflops_runs"]) >= 3
  assert s["attention"] == "xla" and "NVIDIA GPU" in s["attention_note"]  # which ran, and why
  assert s["remat"] == "dots_with_no_batch_dims_saveable" and s["scan_layers"]
  assert s["final_grad_norm"] > 0
  assert s["memory_per_device_bytes"] > 0 and s["compile_time_s"] > 0


def test_hlo_comm_parses_every_form():
  hlo = "\n".join([
      "  %ar = f32[1024]{0} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add",
      "  %ag = (f32[8,64]{1,0}, bf16[16]{0}) all-gather(%a, %b), replica_groups={{0,1},{2,3}}, dimensions={0}",
      "  %rs = f32[32]{0} reduce-scatter(%q), replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([8]) "
      "{'axis_1'}, dimensions={0}, to_apply=%add",
      "  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%x), replica_groups={{0,1,2,3}}, dimensions={0}",
      "  %agd = f32[16]{0} all-gather-done(%ags)",
      "  ROOT %cp = f32[10]{0} collective-permute(%z), source_target_pairs={{0,1},{1,0}}",
  ])
  fp = comm_fingerprint.comm_fingerprint(hlo, 8)
  assert fp["all-reduce"] == {"count": 1, "bytes": 4096, "dtypes": {"f32": 4096}}
  assert fp["all-gather"] == {"count": 2, "bytes": 8 * 64 * 4 + 16 * 2 + 16 * 4,
                              "dtypes": {"bf16": 32, "f32": 8 * 64 * 4 + 16 * 4}}
  assert fp["reduce-scatter"]["bytes"] == 32 * 4 * 4  # input = output x group of 4
  assert fp["collective-permute"]["count"] == 1 and fp["collective-permute"]["bytes"] == 40


# ---------------------------------------------------------------------------------------------------------
# The command, end to end (subprocesses: the CLI sets up its own devices).


def _cli(args: list[str], devices: int = 8, timeout: float = 240) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env.update(JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "microbench.cli.train", *args], capture_output=True, text=True,
                        timeout=timeout, env=env, cwd=ROOT)


def test_cli_end_to_end(tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  out = tmp_path / "run"
  proc = _cli(["--model=llama3", "--size=tiny", "--parallelism=dp:2,fsdp:2,tp:2", "--batch=8", "--seq_len=32",
               "--steps=4", "--warmup_steps=1", "--profile_steps=1", f"--outdir={out}"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  for text in ("tensor  2 inside a node (scale-up)", "data    2 across 2 nodes (scale-out)", "MFU",
               "tokens/s", "comm / step / device", "all-gather", "grad norm", "attention xla (auto:",
               "in a loop", "x2 per step"):
    assert text in proc.stdout, text

  records = [json.loads(line) for line in (out / train.METRICS_FILE).read_text().splitlines()]
  config, steps, summary = records[0], [r for r in records if r["kind"] == "step"], records[-1]
  assert config["kind"] == "config" and config["mesh"] == "data=2 fsdp=2 tensor=2"
  assert config["placement_map"]["tensor"].endswith("inside a node (scale-up)")
  assert [s["step"] for s in steps] == [0, 1, 2, 3, 4] and steps[-1]["profiled"]
  assert all(np.isfinite(s["loss"]) and s["step_time_s"] > 0 for s in steps)
  assert summary["kind"] == "summary" and summary["timed_steps"] == 3
  for key in ("median_step_time_s", "tokens_per_s", "tokens_per_s_per_device", "flops_per_step",
              "flops_formula", "tflops_per_device", "mfu", "mfu_full_attention", "peak_source",
              "memory_per_device_bytes", "compile_time_s", "comm", "comm_loops", "attention", "remat"):
    assert key in summary, key
  assert summary["comm"]["all-gather"]["bytes"] > 0 and summary["comm"]["all-reduce"]["bytes"] > 0
  # recorded in the results store beside the run folder, with the summary's figures
  assert "# results store: run" in proc.stdout
  from microbench.store import connect, queries  # pylint: disable=g-import-not-at-top
  store = connect.open_store(connect.resolve(str(tmp_path / connect.FILENAME)))
  with store.read() as conn:
    (run,) = queries.machine_runs(conn, kind="train")
    figures = queries.figures(conn, run["run_id"])
  assert figures["train/tokens_per_s"] == pytest.approx(summary["tokens_per_s"])
  assert figures.get("train/mfu") == (None if summary["mfu"] is None else pytest.approx(summary["mfu"]))

  acc = EventAccumulator(str(out), size_guidance={"scalars": 0, "tensors": 0})
  acc.Reload()
  scalars = acc.Tags()["scalars"]
  for tag in ("train/loss", "train/step_time_s", "train/tokens_per_s", "train/mfu", "summary/mfu"):
    assert tag in scalars, tag
  assert [e.step for e in acc.Scalars("train/loss")] == [0, 1, 2, 3, 4]
  # The warm-up step's time is under its own tag, so it does not set the scale of the timed steps' chart.
  assert [e.step for e in acc.Scalars("train/warmup_step_time_s")] == [0]
  assert [e.step for e in acc.Scalars("train/step_time_s")] == [1, 2, 3, 4]
  assert [e.step for e in acc.Scalars("train/tokens_per_s")] == [1, 2, 3, 4]
  assert acc.Scalars("train/loss")[0].value == pytest.approx(steps[0]["loss"])
  assert "config/text_summary" in acc.Tags()["tensors"] or "config" in acc.Tags()["tensors"]
  assert [e.step for e in acc.Scalars("summary/mfu")] == [0]  # one fixed step for every run
  assert acc.Scalars("summary/comm_bytes/all-gather")[0].value == summary["comm"]["all-gather"]["bytes"]
  from tensorboard.plugins.hparams import metadata as hp_metadata
  start = hp_metadata.parse_session_start_info_plugin_data(
      acc.SummaryMetadata(hp_metadata.SESSION_START_INFO_TAG).plugin_data.content)
  assert start.hparams["parallelism"].string_value == "dp:2,fsdp:2,tp:2"
  assert start.hparams["devices"].number_value == 8 and start.hparams["model"].string_value == "llama3"
  traces = list((out / "plugins" / "profile").rglob("*.xplane.pb"))
  assert traces, "no profiler trace in the run folder"


def test_cli_compile_only(tmp_path):
  out = tmp_path / "c"
  proc = _cli(["--model=gpt2", "--size=tiny", "--layers=3", "--parallelism=fsdp:4,tp:2", "--batch=8",
               "--seq_len=32", "--dtype=bfloat16", "--compile_only", f"--outdir={out}"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "compiled (not run)" in proc.stdout and "  step    0" not in proc.stdout
  records = [json.loads(line) for line in (out / train.METRICS_FILE).read_text().splitlines()]
  assert [r["kind"] for r in records] == ["config", "compile"]
  c = records[-1]
  assert c["memory_per_device_bytes"] > 0 and c["flops_per_step"] > 0 and c["comm"]["all-gather"]["count"] > 0
  assert [lp["trip_count"] for lp in c["comm_loops"]] == [3, 3]


@pytest.mark.slow
@pytest.mark.parametrize("args,devices,line", [
    (["--parallelism=dp:3"], 8, "--parallelism=dp:3 uses dp:3 = 3 devices but 8 are available"),
    (["--size=tiny", "--parallelism=tp:8"], 8, "tp:8 does not divide gpt2-tiny's attention heads (4)"),
    (["--model=gpt3"], 8, "unknown model 'gpt3'; choose one of gpt2, llama3, vit, resnet"),
    (["--model=llama3", "--size=3b"], 8, "unknown size '3b' for llama3; choose one of tiny, small, 8b, 70b"),
    (["--size=tiny", "--parallelism=dp:2,fsdp:2,tp:2", "--batch=6"], 8,
     "--batch=6 is not divisible by dp x fsdp = 4"),
    (["--model=llama3", "--size=tiny", "--parallelism=dp:2,tp:4"], 8,
     "tp:4 does not divide llama3-tiny's kv heads (2)"),
    (["--model=resnet", "--size=tiny", "--parallelism=dp:4,tp:2"], 8, "resnet names no dimension that tp splits"),
    (["--size=tiny", "--attention=cudnn"], 8, "--attention=cudnn: cuDNN attention needs an NVIDIA GPU"),
    (["--size=tiny", "--parallelism=dp:8", "--batch=8", "--grad_accum=2"], 8,
     "--batch=8 is not divisible by dp x fsdp x grad_accum = 16"),
    (["--remat=most"], 8, "--remat=most: choose one of none, full, dots_saveable"),
    (["--attention=flash"], 8, "--attention=flash: choose one of auto, xla, cudnn"),
    (["--clip_norm=-1"], 8, "--clip_norm=-1.0 must be >= 0"),
    (["--preset=study-tp"], 8, "unknown --preset='study-tp'; choose one of study-dp, study-fsdp, study-dp-pp,"
                               " study-dp-pp-tp, study-dp-pp-ep"),
])
def test_bad_input_one_clear_line(args, devices, line):
  proc = _cli([*args, "--steps=2", "--warmup_steps=1", "--outdir=/nonexistent/never-written"], devices)
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last == f"microbench-train: error: {line}" or last.startswith(f"microbench-train: error: {line}"), \
      proc.stderr[-2000:]
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
