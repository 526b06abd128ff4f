"""Training MFU on one accelerator (not a test): the GPU target (>= 45% MFU), ready for a device session.

Target: >= 45% MFU (causal attention counted half, the headline convention) in bfloat16 for GPT-2 1.3B or
Llama-3 8B at reduced depth on one H200 (MaxText reaches about 51% on Llama-3.1 70B). Each configuration runs
`microbench-train` in its own process with a timeout (an out-of-memory or a hang costs only that line), with
XLA's memory fraction set, scanned layers, the default remat policy and `--attention=auto` (cuDNN's fused
attention on NVIDIA GPUs). Refuses to run without a GPU unless `--smoke` (tiny shapes, float32, CPU).

  python scripts/bench_gpu_mfu.py --out=$OUT/mfu.json          # on the GPU machine
  python scripts/bench_gpu_mfu.py --smoke                      # the same path on CPU, tiny shapes
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

from microbench.cluster import launch
from microbench.output import jsonl
from microbench.output.train_log import METRICS_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_bool("smoke", False, "Tiny shapes, float32, on CPU: checks the script without a GPU.")
flags.DEFINE_integer("steps", 12, "Steps per configuration, warm-up included.")
flags.DEFINE_integer("warmup_steps", 4, "Steps left out of the median.")
flags.DEFINE_integer("timeout_s", 240, "Wall-clock limit per configuration (compile included).")
flags.DEFINE_float("mem_fraction", 0.92, "XLA_PYTHON_CLIENT_MEM_FRACTION for each run (JAX's default is 0.75).")
flags.DEFINE_list("only", [], "Run only these configuration names (see --helpfull for the list).")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS

# name -> (model, size, layers, global batch, sequence length, remat). Real widths, reduced depth, sized for one
# H200 (141 GB): GPT-2 1.3B at 24 layers holds 21 GB of float32 parameters + Adam state; Llama-3 8B at 8 layers
# 45 GB, plus its float32 [batch, seq, 128256] logits (8.4 GB at batch 4).
GPU_CONFIGS = {
    "gpt2-1.3b-b16": ("gpt2", "1.3b", 24, 16, 1024, "dots_with_no_batch_dims_saveable"),
    "gpt2-1.3b-b32": ("gpt2", "1.3b", 24, 32, 1024, "dots_with_no_batch_dims_saveable"),
    "gpt2-1.3b-b32-full": ("gpt2", "1.3b", 24, 32, 1024, "full"),
    "llama3-8b-b4": ("llama3", "8b", 8, 4, 4096, "dots_with_no_batch_dims_saveable"),
    "llama3-8b-b4-none": ("llama3", "8b", 8, 4, 4096, "none"),
    "llama3-8b-b8-full": ("llama3", "8b", 8, 8, 4096, "full"),
}
SMOKE_CONFIGS = {
    "gpt2-tiny": ("gpt2", "tiny", 2, 4, 64, "dots_with_no_batch_dims_saveable"),
    "llama3-tiny": ("llama3", "tiny", 2, 4, 64, "full"),
}
KEEP = ("median_step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "mfu_full_attention", "peak_source",
        "compile_time_s", "memory_per_device_bytes", "device_memory_bytes", "device_kind", "attention",
        "attention_note", "flops_formula", "final_loss")


def _env() -> dict[str, str]:
  env = launch.with_repo_on_path(dict(os.environ))
  env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(FLAGS.mem_fraction)
  if FLAGS.smoke:
    env.update(JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu")
  return env


def probe_device() -> tuple[str, str]:
  """(platform, device kind) of the first device, asked in a child process so this one holds no GPU memory."""
  code = "import jax; d = jax.devices()[0]; print(d.platform); print(d.device_kind)"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=False,
                        timeout=120)
  if proc.returncode:
    raise SystemExit(f"bench_gpu_mfu.py: error: JAX could not start: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
  platform, kind = proc.stdout.strip().splitlines()[-2:]
  return platform, kind


def run_one(name: str, model: str, size: str, layers: int, batch: int, seq: int, remat: str, dtype: str,
            outdir: str) -> dict:
  cmd = [sys.executable, "-m", "microbench.cli.train", f"--model={model}", f"--size={size}",
         f"--layers={layers}", f"--batch={batch}", f"--seq_len={seq}", f"--dtype={dtype}", f"--remat={remat}",
         "--attention=auto", f"--steps={FLAGS.steps}", f"--warmup_steps={FLAGS.warmup_steps}",
         "--parallelism=dp:1", f"--outdir={outdir}"]
  row = {"name": name, "model": model, "size": size, "layers": layers, "batch": batch, "seq_len": seq,
         "dtype": dtype, "remat": remat}
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, check=False,
                          timeout=FLAGS.timeout_s)
  except subprocess.TimeoutExpired:
    return {**row, "status": "timeout", "reason": f"no result within {FLAGS.timeout_s} s"}
  if proc.returncode:
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["?"]
    oom = any("RESOURCE_EXHAUSTED" in ln or "out of memory" in ln.lower() for ln in lines)
    return {**row, "status": "out_of_memory" if oom else "failed", "reason": lines[-1][:300]}
  summary = jsonl.read(os.path.join(outdir, METRICS_FILE))[-1]
  return {**row, "status": "ok", **{k: summary.get(k) for k in KEEP}}


def _pct(x: float | None) -> str:
  return "n/a" if x is None else f"{100 * x:.1f}%"


def main(argv: list[str]) -> None:
  del argv
  platform, kind = probe_device()
  if platform != "gpu" and not FLAGS.smoke:
    print(f"bench_gpu_mfu.py: error: no GPU here (JAX's first device is {kind}, platform {platform}); this"
          " benchmark measures MFU on an accelerator. Use --smoke to check the script on CPU.", file=sys.stderr)
    raise SystemExit(2)
  configs, dtype = (SMOKE_CONFIGS, "float32") if FLAGS.smoke else (GPU_CONFIGS, "bfloat16")
  unknown = [n for n in FLAGS.only if n not in configs]
  if unknown:
    raise SystemExit(f"bench_gpu_mfu.py: error: unknown configuration(s) {unknown}; choose from {list(configs)}")
  rows = []
  print(f"{kind} ({platform}), {dtype}, {len(FLAGS.only or configs)} configurations, timeout {FLAGS.timeout_s} s"
        f" each, memory fraction {FLAGS.mem_fraction}", flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    for i, (name, c) in enumerate(configs.items()):
      if FLAGS.only and name not in FLAGS.only:
        continue
      row = run_one(name, *c, dtype=dtype, outdir=os.path.join(tmp, str(i)))
      rows.append(row)
      if row["status"] == "ok":
        print(f"{name}: {row['model']}-{row['size']} x{row['layers']} b{row['batch']} s{row['seq_len']}"
              f" remat {row['remat']} attention {row['attention']}: step {1e3 * row['median_step_time_s']:.1f} ms,"
              f" {row['tokens_per_s']:.0f} tokens/s, {row['tflops_per_device']:.1f} TFLOP/s, MFU {_pct(row['mfu'])}"
              f" (full attention {_pct(row['mfu_full_attention'])}), {row['memory_per_device_bytes'] / 2**30:.1f}"
              f" GiB, compile {row['compile_time_s']:.1f} s", flush=True)
      else:
        print(f"{name}: {row['status']}: {row['reason']}", flush=True)
      if FLAGS.out:  # after every configuration: a later hang or crash loses nothing already measured
        with open(FLAGS.out, "w") as f:
          json.dump({"device_kind": kind, "platform": platform, "dtype": dtype, "rows": rows}, f, indent=1)
  best = max((r for r in rows if r["status"] == "ok" and r.get("mfu") is not None), key=lambda r: r["mfu"],
             default=None)
  if best:
    print(f"best: {best['name']} MFU {_pct(best['mfu'])} (causal attention counted half; target >= 45% on H200)")


if __name__ == "__main__":
  app.run(main)
