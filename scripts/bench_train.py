"""GPT-2 training throughput on this machine's CPU: microbench-train (JAX/Flax) against a straightforward
PyTorch implementation (scripts/torch_gpt2.py) of the same shape, batch, sequence, optimizer (AdamW after
clipping to norm 1.0) and dtype, run eagerly and under `torch.compile` (TorchInductor).

Each arm runs in its own process (so none steals another's threads), all with the same CPU affinity and
thread count; the arms alternate, in a rotated order each round, for `--repeats` rounds. The figure per arm
is the median over rounds of each run's median step time after warm-up (compiles, XLA's and Inductor's, fall
in the warm-up). Needs the `bench` extra (torch). Use a depth where the blocks, not the LM head, carry most of
the FLOPs: at GPT-2 124M's width the head is 73% of the matmul FLOPs at 2 layers and 31% at 12.

  python scripts/bench_train.py --layers=12 --batch=4 --seq_len=256 --steps=10 --warmup_steps=5 --repeats=3
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

from microbench.cluster import launch
from microbench.output import jsonl
from microbench.output.train_log import METRICS_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

flags.DEFINE_string("size", "124m", "GPT-2 size.")
flags.DEFINE_integer("layers", 12, "Layers (the same for every arm).")
flags.DEFINE_integer("batch", 4, "Global batch.")
flags.DEFINE_integer("seq_len", 256, "Tokens per example.")
flags.DEFINE_integer("steps", 10, "Steps per run, warm-up included.")
flags.DEFINE_integer("warmup_steps", 5, "Steps left out of each run's median: Inductor keeps compiling for a few steps.")
flags.DEFINE_integer("repeats", 3, "Alternating rounds of the arms.")
flags.DEFINE_integer("threads", CORES, "CPU threads for PyTorch; XLA's CPU runtime sizes its pool from the"
                     " same CPU affinity. Default: the CPUs this process may run on.")
flags.DEFINE_list("arms", ["jax", "pytorch", "torch.compile"], "Arms to run.")
flags.DEFINE_string("out", None, "Also write the result as JSON here.")


def _env(threads: int) -> dict[str, str]:
  env = launch.with_repo_on_path({k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")})
  env.update(JAX_PLATFORMS="cpu", OMP_NUM_THREADS=str(threads))
  return env


def run_jax(args, outdir: str) -> dict:
  cmd = [sys.executable, "-m", "microbench.cli.train", "--model=gpt2", f"--size={args.size}",
         f"--layers={args.layers}", "--parallelism=dp:1", f"--batch={args.batch}", f"--seq_len={args.seq_len}",
         f"--steps={args.steps}", f"--warmup_steps={args.warmup_steps}", "--dtype=float32", "--clip_norm=1.0",
         "--remat=none", f"--outdir={outdir}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(args.threads), cwd=ROOT, check=False)
  if proc.returncode:
    raise SystemExit(f"microbench-train failed:\n{proc.stderr[-3000:]}")
  summary = jsonl.read(os.path.join(outdir, METRICS_FILE))[-1]
  return {"impl": "jax", "median_step_time_s": summary["median_step_time_s"], "params": summary["params"],
          "mfu": summary["mfu"], "peak_source": summary["peak_source"], "losses": None}


def run_torch(args, compiled: bool) -> dict:
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "torch_gpt2.py"), f"--size={args.size}",
         f"--layers={args.layers}", f"--batch={args.batch}", f"--seq_len={args.seq_len}", f"--steps={args.steps}",
         f"--warmup_steps={args.warmup_steps}", f"--threads={args.threads}"] + (["--compile"] if compiled else [])
  proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(args.threads), cwd=ROOT, check=False)
  if proc.returncode:
    return {"impl": "torch.compile" if compiled else "pytorch", "error": proc.stderr.strip()[-1500:]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
  del argv
  args = flags.FLAGS
  tokens = args.batch * args.seq_len
  arms = list(args.arms)
  runs: dict[str, list[float]] = {a: [] for a in arms}
  info: dict[str, dict] = {}
  unavailable: dict[str, str] = {}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.repeats):
      order = arms[r % len(arms):] + arms[:r % len(arms)]
      line = []
      for arm in order:
        if arm in unavailable:
          continue
        res = run_jax(args, os.path.join(tmp, f"jax{r}")) if arm == "jax" else run_torch(args, arm == "torch.compile")
        if "error" in res:
          unavailable[arm] = res["error"].splitlines()[-1] if res["error"] else "failed"
          print(f"round {r}: {arm} failed, left out: {unavailable[arm]}", flush=True)
          continue
        runs[arm].append(res["median_step_time_s"])
        info[arm] = res
        line.append(f"{arm} {tokens / res['median_step_time_s']:.1f}")
      print(f"round {r}: " + ", ".join(line) + " tokens/s", flush=True)
  med = {a: statistics.median(v) for a, v in runs.items() if v}
  result = {
      "model": f"gpt2-{args.size}", "layers": args.layers, "batch": args.batch, "seq_len": args.seq_len,
      "dtype": "float32", "threads": args.threads, "cpu_affinity": CORES, "repeats": args.repeats,
      "steps": args.steps, "warmup_steps": args.warmup_steps, "step_times_s": runs,
      "tokens_per_s": {a: tokens / m for a, m in med.items()}, "unavailable": unavailable,
      "params": {a: info[a].get("params") for a in info},
      "torch_version": next((info[a]["torch_version"] for a in info if a != "jax"), None),
  }
  if "jax" in med:
    result["jax_mfu"] = info["jax"]["mfu"]
    result["peak_source"] = info["jax"]["peak_source"]
    for a in med:
      if a != "jax":
        result[f"jax_over_{a}"] = med[a] / med["jax"]
  print(f"gpt2-{args.size} x{args.layers} layers, batch {args.batch}, seq {args.seq_len}, float32,"
        f" {args.threads} threads (affinity {CORES} CPUs):")
  for a, m in med.items():
    print(f"  {a:14s} {tokens / m:9.1f} tokens/s")
  for a in med:
    if a != "jax" and "jax" in med:
      print(f"  jax / {a:8s} {result[f'jax_over_{a}']:.2f}x" + ("  (target >= 1.0x)" if a == "pytorch" else ""))
  for a, why in unavailable.items():
    print(f"  {a}: unavailable here ({why})")
  print(json.dumps(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
