"""GPT-2 training throughput on this machine's CPU: microbench-train (JAX/Flax) against a straightforward
PyTorch implementation (scripts/torch_gpt2.py) of the same shape, batch, sequence, AdamW and dtype.

Each implementation runs in its own process (so neither steals the other's threads), alternating, for
`--repeats` rounds; the figure per implementation is the median over rounds of each run's median step
time after warm-up. Needs the `bench` extra (torch).

  python scripts/bench_train.py --layers=2 --batch=4 --seq_len=256 --steps=6 --warmup_steps=2 --repeats=3
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_string("size", "124m", "GPT-2 size.")
flags.DEFINE_integer("layers", 2, "Layers (reduced depth, the same for both implementations).")
flags.DEFINE_integer("batch", 4, "Global batch.")
flags.DEFINE_integer("seq_len", 256, "Tokens per example.")
flags.DEFINE_integer("steps", 6, "Steps per run, warm-up included.")
flags.DEFINE_integer("warmup_steps", 2, "Steps left out of each run's median.")
flags.DEFINE_integer("repeats", 3, "Alternating rounds of both implementations.")
flags.DEFINE_integer("threads", os.cpu_count() or 1, "CPU threads for PyTorch (XLA uses every core of the"
                     " machine; keep this equal to the core count).")
flags.DEFINE_string("out", None, "Also write the result as JSON here.")


def _env(threads: int) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
  env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
             OMP_NUM_THREADS=str(threads))
  return env


def run_jax(args, outdir: str) -> dict:
  cmd = [sys.executable, "-m", "microbench.cli.train", "--model=gpt2", f"--size={args.size}",
         f"--layers={args.layers}", "--parallelism=dp:1", f"--batch={args.batch}", f"--seq_len={args.seq_len}",
         f"--steps={args.steps}", f"--warmup_steps={args.warmup_steps}", "--dtype=float32", f"--outdir={outdir}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(args.threads), cwd=ROOT, check=False)
  if proc.returncode:
    raise SystemExit(f"microbench-train failed:\n{proc.stderr[-3000:]}")
  with open(os.path.join(outdir, "metrics.jsonl")) as f:
    summary = [json.loads(line) for line in f][-1]
  return {"impl": "jax", "median_step_time_s": summary["median_step_time_s"], "params": summary["params"],
          "tokens_per_s": summary["tokens_per_s"], "mfu": summary["mfu"], "peak_source": summary["peak_source"]}


def run_torch(args) -> dict:
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "torch_gpt2.py"), f"--size={args.size}",
         f"--layers={args.layers}", f"--batch={args.batch}", f"--seq_len={args.seq_len}", f"--steps={args.steps}",
         f"--warmup_steps={args.warmup_steps}", f"--threads={args.threads}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(args.threads), cwd=ROOT, check=False)
  if proc.returncode:
    raise SystemExit(f"torch_gpt2.py failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
  del argv
  args = flags.FLAGS
  tokens = args.batch * args.seq_len
  runs = {"jax": [], "pytorch": []}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.repeats):
      j = run_jax(args, os.path.join(tmp, f"jax{r}"))
      t = run_torch(args)
      runs["jax"].append(j["median_step_time_s"])
      runs["pytorch"].append(t["median_step_time_s"])
      print(f"round {r}: jax {tokens / j['median_step_time_s']:.1f} tokens/s,"
            f" pytorch {tokens / t['median_step_time_s']:.1f} tokens/s", flush=True)
  med = {k: statistics.median(v) for k, v in runs.items()}
  result = {
      "model": f"gpt2-{args.size}", "layers": args.layers, "batch": args.batch, "seq_len": args.seq_len,
      "dtype": "float32", "threads": args.threads, "repeats": args.repeats, "steps": args.steps,
      "warmup_steps": args.warmup_steps, "jax_params": j["params"], "torch_params": t["params"],
      "torch_version": t["torch_version"], "jax_step_times_s": runs["jax"], "torch_step_times_s": runs["pytorch"],
      "jax_tokens_per_s": tokens / med["jax"], "torch_tokens_per_s": tokens / med["pytorch"],
      "jax_over_torch": med["pytorch"] / med["jax"], "jax_mfu": j["mfu"], "peak_source": j["peak_source"],
  }
  print(f"gpt2-{args.size} x{args.layers} layers, batch {args.batch}, seq {args.seq_len}, float32,"
        f" {args.threads} threads:")
  print(f"  jax/flax  {result['jax_tokens_per_s']:9.1f} tokens/s")
  print(f"  pytorch   {result['torch_tokens_per_s']:9.1f} tokens/s")
  print(f"  ratio     {result['jax_over_torch']:.2f}x (target >= 1.0x)")
  print(json.dumps(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
