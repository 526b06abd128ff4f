"""Benchmark of the timing method itself (not a test). Prints figures for BUILD_NOTES.md.

(a) small-message all-reduce: in-graph repetition vs naive one-call-per-measurement host timing;
    target: the in-graph floor is at least 3x lower.
(b) wall time of the default sweep (`microbench` with no flags), split into compile and run;
    target: at most 120 s on a 2-core machine, compile at most half.
(c) large-message intra-process all-reduce busbw next to this machine's single-thread memcpy bandwidth.

Usage: python scripts/bench_timing.py [--parts=a,b,c] [--large_bytes=64M]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

from absl import app, flags

flags.DEFINE_list("parts", ["a", "b", "c"], "Which parts to run.")
flags.DEFINE_string("large_bytes", "64M", "Message size for part (c).")
flags.DEFINE_list("a_devices", ["2", "4", "8"], "CPU device counts for part (a).")
flags.DEFINE_integer("reps", 200, "Timed calls for the naive method / repetitions in-graph for part (a).")
FLAGS = flags.FLAGS


def part_a_one() -> dict:
  """Part (a) on however many CPU devices this process has (one group of all of them)."""
  import jax
  import numpy as np
  from meshes.mesh import build_mesh, ordered_devices
  from meshes.scopes import plan_scopes
  from meshes.topology import Topology
  from microbench.bench import collectives, program

  n = jax.device_count()
  topo = Topology(1, 1, n)
  mesh = build_mesh(topo, ordered_devices())
  plan = plan_scopes(topo, ["scale_up"])[0]
  coll = collectives.get("all_reduce")
  out = {}
  for nbytes in (1024, 4096):
    count = nbytes // 4
    # In-graph: --reps repetitions in one program, several samples, per-op time.
    prog = program.build(coll, mesh, plan, count, "float32")
    program.check(prog)
    in_graph = program.time_runs(prog, iters=FLAGS.reps, warmup=2, samples=10, barrier=lambda: None)
    # Naive: one jitted all-reduce per call, timed from the host around each call.
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, plan.axes), mesh=mesh, in_specs=jax.P(plan.axes),
                               out_specs=jax.P(plan.axes), check_vma=False))
    x = jax.device_put(np.ones(mesh.size * count, np.float32), jax.NamedSharding(mesh, jax.P(plan.axes)))
    for _ in range(10):
      fn(x).block_until_ready()
    naive = []
    for _ in range(FLAGS.reps):
      t0 = time.perf_counter()
      fn(x).block_until_ready()
      naive.append(time.perf_counter() - t0)
    naive = np.asarray(naive)
    out[nbytes] = {
        "devices": n,
        "in_graph_min_us": float(in_graph.min() * 1e6), "in_graph_median_us": float(np.median(in_graph) * 1e6),
        "naive_min_us": float(naive.min() * 1e6), "naive_median_us": float(np.median(naive) * 1e6),
        "floor_ratio": float(naive.min() / in_graph.min()),
        "median_ratio": float(np.median(naive) / np.median(in_graph))}
  return out


def part_a() -> dict:
  """Part (a) for 2, 4 and 8 CPU devices, each in a fresh process (the device count is fixed at start)."""
  out = {}
  for n in FLAGS.a_devices:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(n)}
    r = subprocess.run([sys.executable, __file__, "--parts=a_one"], env=env, capture_output=True, text=True)
    if r.returncode:
      raise SystemExit(f"part (a) with {n} devices failed: {r.stderr[-2000:]}")
    res = json.loads(r.stdout[r.stdout.index("{"):])["a_one"]
    out[n] = res
    for nbytes, v in res.items():
      print(f"(a) all_reduce {nbytes} B, one group of {n} CPU devices: in-graph min {v['in_graph_min_us']:.1f} us"
            f" (median {v['in_graph_median_us']:.1f}), naive host timing min {v['naive_min_us']:.1f} us"
            f" (median {v['naive_median_us']:.1f}); floor ratio {v['floor_ratio']:.1f}x (target >= 3x),"
            f" median ratio {v['median_ratio']:.1f}x",
            flush=True)
  return out


def part_b() -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "microbench", f"--outdir={tmp}/run"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
      raise SystemExit(f"default sweep failed: {r.stderr[-2000:]}")
    with open(f"{tmp}/run/results.jsonl") as f:
      recs = [json.loads(line) for line in f]
  compile_s = sum(r.get("compile_s", 0.0) for r in recs)
  out = {"points": len(recs), "wall_s": wall, "compile_s": compile_s, "other_s": wall - compile_s}
  print(f"(b) default sweep: {len(recs)} points, wall {wall:.1f} s (target <= 120 s), of which XLA compile"
        f" {compile_s:.1f} s ({100 * compile_s / wall:.0f}%, target <= 50%)", flush=True)
  return out


def part_c() -> dict:
  import numpy as np
  from meshes.mesh import build_mesh, ordered_devices
  from meshes.scopes import plan_scopes
  from meshes.topology import Topology
  from microbench.bench import collectives, sizes, sweep

  nbytes = sizes.parse_size(FLAGS.large_bytes)
  src = np.ones(nbytes // 8, np.float64)
  dst = np.empty_like(src)
  best = float("inf")
  for _ in range(10):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - t0)
  memcpy = nbytes / best / 1e9
  topo = Topology(1, 2, 4)
  mesh = build_mesh(topo, ordered_devices())
  out = {"memcpy_gbps": memcpy}
  cfg = sweep.SweepConfig(("all_reduce",), ("scale_up", "global"), ("float32",), nbytes, nbytes, 2, 5, 1, 5, True)
  for plan in plan_scopes(topo, ["scale_up", "global"]):
    rec = sweep.run_point(cfg, mesh, plan, collectives.get("all_reduce"), "float32", nbytes, lambda: None)
    out[plan.name] = {"busbw_gbps": rec["busbw_gbps"], "time_us": rec["time_us"], "wrong": rec["wrong"],
                      "ratio_to_memcpy": rec["busbw_gbps"] / memcpy}
    print(f"(c) all_reduce {FLAGS.large_bytes} {plan.name} (n={plan.group_size}, one process): busbw"
          f" {rec['busbw_gbps']:.2f} GB/s vs single-thread memcpy {memcpy:.2f} GB/s: ratio"
          f" {rec['busbw_gbps'] / memcpy:.2f}", flush=True)
  return out


def main(argv):
  del argv
  if FLAGS.parts != ["a_one"]:
    print(f"# bench_timing on {os.cpu_count()} CPU(s), {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
  results = {}
  for part in FLAGS.parts:
    results[part] = {"a": part_a, "a_one": part_a_one, "b": part_b, "c": part_c}[part]()
  print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
  app.run(main)
