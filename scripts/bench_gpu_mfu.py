"""Training MFU on one accelerator (not a test): the issue-4 GPU target, prepared for a device session.

Target: >= 45% MFU for GPT-2 1.3B or Llama-3-8B at reduced depth, bf16 compute, on one H200. Each
configuration runs `microbench-train` in its own process (a failure, e.g. out of memory, costs only that
line) and the table of MFU, step time and memory is printed and written as JSON.

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_bool("smoke", False, "Tiny shapes, float32: checks the script on CPU.")
flags.DEFINE_integer("steps", 12, "Steps per configuration, warm-up included.")
flags.DEFINE_integer("warmup_steps", 4, "Steps left out of the median.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS

# (model, size, layers, global batch, sequence length): reduced depth, real widths.
GPU_CONFIGS = (
    ("gpt2", "1.3b", 8, 16, 1024),
    ("gpt2", "1.3b", 8, 32, 1024),
    ("llama3", "8b", 4, 4, 4096),
    ("llama3", "8b", 4, 8, 4096),
)
SMOKE_CONFIGS = (("gpt2", "tiny", 2, 4, 64), ("llama3", "tiny", 2, 4, 64))


def run_one(model: str, size: str, layers: int, batch: int, seq: int, dtype: str, outdir: str) -> dict:
  cmd = [sys.executable, "-m", "microbench.cli.train", f"--model={model}", f"--size={size}",
         f"--layers={layers}", f"--batch={batch}", f"--seq_len={seq}", f"--dtype={dtype}",
         f"--steps={FLAGS.steps}", f"--warmup_steps={FLAGS.warmup_steps}", "--parallelism=dp:1",
         f"--outdir={outdir}"]
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  if FLAGS.smoke:
    env["JAX_NUM_CPU_DEVICES"] = "1"
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
  row = {"model": model, "size": size, "layers": layers, "batch": batch, "seq_len": seq, "dtype": dtype}
  if proc.returncode:
    return {**row, "status": "failed", "reason": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
  with open(os.path.join(outdir, "metrics.jsonl")) as f:
    summary = [json.loads(line) for line in f][-1]
  keep = ("median_step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_source", "compile_time_s",
          "memory_per_device_bytes", "device_kind")
  return {**row, "status": "ok", **{k: summary.get(k) for k in keep}}


def main(argv: list[str]) -> None:
  del argv
  configs, dtype = (SMOKE_CONFIGS, "float32") if FLAGS.smoke else (GPU_CONFIGS, "bfloat16")
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for i, c in enumerate(configs):
      row = run_one(*c, dtype=dtype, outdir=os.path.join(tmp, str(i)))
      rows.append(row)
      if row["status"] == "ok":
        print(f"{row['model']}-{row['size']} x{row['layers']} b{row['batch']} s{row['seq_len']} {dtype}:"
              f" step {1e3 * row['median_step_time_s']:.1f} ms, {row['tokens_per_s']:.0f} tokens/s,"
              f" {row['tflops_per_device']:.1f} TFLOP/s, MFU {100 * row['mfu']:.1f}% ({row['peak_source']}),"
              f" {row['memory_per_device_bytes'] / 2**30:.1f} GiB", flush=True)
      else:
        print(f"{c}: {row['status']}: {row['reason']}", flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
