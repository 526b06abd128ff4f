"""Run folders for the results store's tests: one real sweep made by the command (session-wide), copied with
its samples replaced by seeded ones so that a test decides what changed (slower by x, noisier, another NCCL)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from support import ROOT, clean_env

SWEEP_ARGS = ["--collectives=all_reduce,all_gather", "--scopes=scale_up", "--min_bytes=16K", "--max_bytes=256K",
              "--samples=4", "--iters=6", "--store=none"]


def make_sweep(out: str) -> str:
  r = subprocess.run([sys.executable, "-m", "microbench", *SWEEP_ARGS, f"--outdir={out}"], capture_output=True,
                     text=True, timeout=300, env=clean_env(), cwd=ROOT, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  return out


def variant(source: str, dest: str, *, slower: float = 1.0, noise: float = 0.02, seed: int = 0, samples: int = 12,
            env: dict[str, str] | None = None, hosts: list[str] | None = None, stamp: str | None = None) -> str:
  """A copy of the sweep `source` whose every point's samples are seeded around its time x `slower`."""
  shutil.copytree(source, dest)
  rng = np.random.default_rng(seed)
  recs = [json.loads(l) for l in open(os.path.join(dest, "results.jsonl"), encoding="utf-8")]
  with open(os.path.join(dest, "results.jsonl"), "w", encoding="utf-8") as f:
    for r in recs:
      if r.get("status") == "ok":
        base = 100.0 * (1 + r["bytes"] / 65536)  # a fixed time per size, so variants differ only as asked
        t = base * slower
        r["samples_us"] = list(t * np.exp(rng.normal(0, noise, samples)))
        r["time_us"] = float(np.median(r["samples_us"]))
        r["busbw_gbps"] = r["bytes"] / r["time_us"] / 1e3
        r["finished_at"] = stamp or r.get("finished_at")
      f.write(json.dumps(r) + "\n")
  meta = json.load(open(os.path.join(dest, "meta.json"), encoding="utf-8"))
  if env:
    meta["environment"]["variables"].update(env)
  if hosts:
    meta["environment"]["hosts"] = hosts
  if stamp:
    meta["started_at"] = meta["finished_at"] = stamp
  json.dump(meta, open(os.path.join(dest, "meta.json"), "w", encoding="utf-8"))
  return dest
