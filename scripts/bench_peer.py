"""The sweep's wall time beside accelerator-microbenchmarks' on the same points, alternating rounds, with
where the toolkit's time went (compile, the check on the devices, the timed check, the timed operations, the
rest).

    python3 -m venv /tmp/peervenv && /tmp/peervenv/bin/pip install jax==0.10.2 pandas pyyaml simple_parsing
    git clone https://github.com/AI-Hypercomputer/accelerator-microbenchmarks /tmp/peer
    /tmp/peervenv/bin/pip install --no-deps -e /tmp/peer
    python scripts/bench_peer.py --rounds=3 --peer_python=/tmp/peervenv/bin/python

Both run as fresh processes (imports, device start-up and compiles included, as a user pays them) on 8 CPU
devices, one group of all of them: all-reduce, all-gather, reduce-scatter and all-to-all, float32, 1, 4, 16
and 64 MiB per device. The toolkit runs twice per round: cold (an empty compilation cache, a first run: the
comparison that counts) and warm (the same sweep again, its programs loaded from the cache the cold run
filled). The peer runs one process per collective (its loader takes one benchmark kind per config), with its
defaults (10 warm-up and 10 timed calls per point, no check of the results) and the `matrix_dim` that gives
the toolkit's size S (nccl-tests' convention: the all-gather's output, the reduce-scatter's input): its buffer
is matrix_dim x 8 x 128 per device (the reduce-scatter's n x matrix_dim x 256), so S / 4096, the all-gather's
S / (4096 n) and the reduce-scatter's S / (1024 n). Without `--peer_python` only the toolkit runs. Prints a
Markdown table; figures go to docs/measured-figures.md under this command.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 3, "alternating rounds (toolkit, then peer)")
flags.DEFINE_string("peer_python", "", "python of a venv with accelerator-microbenchmarks installed (empty: toolkit only)")
flags.DEFINE_string("collectives", "all_reduce,all_gather,reduce_scatter,all_to_all", "the toolkit's collectives")
flags.DEFINE_string("min_bytes", "1M", "smallest message per device")
flags.DEFINE_string("max_bytes", "64M", "largest message per device")
flags.DEFINE_integer("step_factor", 4, "size step")
flags.DEFINE_integer("devices", 8, "CPU devices (one node, one group)")
flags.DEFINE_bool("warm", True, "Also run the toolkit a second time per round on the compilation cache the first"
                  " run filled (a rerun of the same sweep); the first run always starts from an empty cache")


def _toolkit(outdir: str, per_point: dict, cache: str) -> dict[str, float]:
  """One toolkit sweep as a fresh process with its compilation cache in `cache` (empty: a first run)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(FLAGS.devices))
  cmd = [sys.executable, "-c", "from microbench.cli.bench import run; run()", f"--topology=nodes:1,gpus:{FLAGS.devices}",
         f"--compilation_cache={cache}",
         f"--collectives={FLAGS.collectives}", "--scopes=global", "--dtype=float32", f"--min_bytes={FLAGS.min_bytes}",
         f"--max_bytes={FLAGS.max_bytes}", f"--step_factor={FLAGS.step_factor}", f"--outdir={outdir}"]
  t0 = time.perf_counter()
  r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - t0
  if r.returncode:
    raise SystemExit(f"bench_peer: the toolkit failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
  with open(os.path.join(outdir, "results.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  ok = [r for r in rows if r.get("status") == "ok"]
  parts = {k: sum(r.get(k) or 0.0 for r in ok) for k in ("compile_s", "check_s", "timed_check_s")}
  parts["timed_ops_s"] = sum((r["warmup"] + r["samples"]) * (r["short_iters"] + r["iters"]) * r["time_us"] * 1e-6
                             for r in ok)
  wrong = sum((r.get("wrong") or 0) + (r.get("timed_wrong") or 0) for r in ok)
  for r in ok:
    per_point.setdefault((r["collective"], r["requested_bytes"]), []).append(r["time_us"])
  return {"wall_s": wall, "points": len(ok), "wrong": wrong, **parts}


_PEER_MAIN = "from accelerator_microbenchmarks.main import run_main; run_main()"
# Bytes of the toolkit's size S (nccl-tests': the all-gather's output, the reduce-scatter's input, the buffer
# otherwise) per unit of the peer's matrix_dim, float32: its buffer is (dim, 8, 128) per device, the input
# (replicated), except the reduce-scatter's (n, dim, 256); so the same S asks for these dims.
_PEER_BYTES_PER_DIM = {"all_reduce": lambda n: 4096, "all_to_all": lambda n: 4096,
                       "reduce_scatter": lambda n: 1024 * n, "all_gather": lambda n: 4096 * n}


def _peer_configs(tmp: str) -> list[str]:
  """One YAML config per collective, its defaults but float32 and no profiler, at the toolkit's sizes."""
  from microbench.bench import sizes  # pylint: disable=g-import-not-at-top
  lo, hi = sizes.parse_size(FLAGS.min_bytes), sizes.parse_size(FLAGS.max_bytes)
  paths = []
  for name in FLAGS.collectives.split(","):
    dims, b = [], lo
    while b <= hi:
      dims.append(b // _PEER_BYTES_PER_DIM[name](FLAGS.devices))
      b *= FLAGS.step_factor
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
      f.write("global:\n  warmup_tries: 10\n  num_runs: 10\n  dtype: \"float32\"\n  xprof_timing: false\n"
              f"benchmarks:\n  - name: {name}\n" + ('    reduce_op: "sum"\n' if name == "all_reduce" else "")
              + f"    sweep:\n      matrix_dim: {dims}\n")
    paths.append(path)
  return paths


def _peer(tmp: str, per_point: dict) -> float:
  """Runs the peer; its median per-call time of each point goes into per_point[(collective, bytes)]."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(FLAGS.devices))
  t0 = time.perf_counter()
  for config in _peer_configs(tmp):
    name = os.path.basename(config)[:-5]
    out = os.path.join(tmp, "peer_out", name)
    r = subprocess.run([FLAGS.peer_python, "-c", _PEER_MAIN, f"--config={config}", f"--output={out}"],
                       cwd=tmp, env=env, capture_output=True, text=True, check=False)
    if r.returncode:
      raise SystemExit(f"bench_peer: the peer failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-3:]}")
    with open(os.path.join(out, "summary.csv"), encoding="utf-8") as f:
      for row in csv.DictReader(f):
        size = int(row["matrix_dim"]) * _PEER_BYTES_PER_DIM[name](FLAGS.devices)
        per_point.setdefault((name, size), []).append(float(row["p50_ms"]) * 1e3)
  return time.perf_counter() - t0


def main(argv):
  del argv
  rows, ours, theirs = [], {}, {}
  with tempfile.TemporaryDirectory() as tmp:
    for k in range(FLAGS.rounds):
      cache = os.path.join(tmp, f"cache{k}")  # empty: the cold arm compiles every program into it
      row = {"round": k + 1, "cold": _toolkit(os.path.join(tmp, f"r{k}"), ours, cache),
             "warm": _toolkit(os.path.join(tmp, f"w{k}"), ours, cache) if FLAGS.warm else None,
             "peer_s": _peer(tmp, theirs) if FLAGS.peer_python else None}
      rows.append(row)
      print(f"# round {k + 1}: {row}", file=sys.stderr, flush=True)
  print("| round | arm | toolkit wall (s) | compile | check | timed check | timed ops | rest | peer wall (s) |"
        " toolkit / peer |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for row in rows:
    for arm in ("cold", "warm"):
      r = row[arm]
      if r is None:
        continue
      rest = r["wall_s"] - r["compile_s"] - r["check_s"] - r["timed_check_s"] - r["timed_ops_s"]
      ratio = f"{r['wall_s'] / row['peer_s']:.2f}" if row["peer_s"] else "-"
      peer = f"{row['peer_s']:.1f}" if row["peer_s"] else "-"
      print(f"| {row['round']} | {arm} | {r['wall_s']:.1f} ({r['points']} points, {r['wrong']} wrong) |"
            f" {r['compile_s']:.1f} | {r['check_s']:.1f} | {r['timed_check_s']:.1f} | {r['timed_ops_s']:.1f} |"
            f" {rest:.1f} | {peer} | {ratio} |")
  peer_med = statistics.median(r["peer_s"] for r in rows) if FLAGS.peer_python else None
  print()
  for arm in ("cold", "warm"):
    if rows[0][arm] is None:
      continue
    med = statistics.median(r[arm]["wall_s"] for r in rows)
    print(f"median toolkit wall ({arm}) {med:.1f} s" + (f", peer {peer_med:.1f} s, ratio {med / peer_med:.2f}"
                                                        if peer_med else ""))
  if theirs:
    print("\n| point | toolkit per operation (us, median of rounds and arms) | peer per call (p50, us) | peer / toolkit |")
    print("|---|---|---|---|")
    for key in sorted(ours, key=lambda k: (k[0], k[1])):
      if key in theirs:
        a, b = statistics.median(ours[key]), statistics.median(theirs[key])
        print(f"| {key[0]} {key[1] >> 20} MiB | {a:.0f} | {b:.0f} | {b / a:.2f} |")


if __name__ == "__main__":
  app.run(main)
