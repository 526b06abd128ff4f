"""Benchmark of the timing method itself (not a test). Prints the figures of docs/measured-figures.md.

(a) small-message all-reduce: the toolkit's per-operation time (difference of two repetition counts, in-graph)
    vs naive one-call-per-measurement host timing; floors (min) and medians.
(b) wall time of the default sweep (`microbench` with no flags), split into compile and the rest;
    target: at most 120 s on a 2-core machine, compile at most half.
(c) large-message intra-process all-reduce busbw next to this machine's single-thread memcpy bandwidth.
(d) per collective at 1, 16 and 64 MiB per rank (one group of 8 CPU devices): the default run's time against
    a plain jitted call in a Python loop and against a long in-graph loop, alternating rounds, medians;
    target: within 10% of the better of the two.
(e) 2-process all_reduce busbw, 1 KiB to 64 MiB: the toolkit (`microbench`), a plain jitted psum across the
    same 2 JAX processes, and torch.distributed with gloo (`pip install torch==2.13.0`), each with the same
    warm-up, samples, a barrier before each sample and the slowest rank's time; arms alternate, medians.

Usage: python scripts/bench_timing.py [--parts=a,b,c,d,e] [--large_bytes=64M] [--rounds=3]
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

from absl import app, flags  # noqa: E402

from microbench.output import run_folder  # noqa: E402

flags.DEFINE_list("parts", ["a", "b", "c", "d", "e"], "Which parts to run.")
flags.DEFINE_string("large_bytes", "64M", "Message size for part (c).")
flags.DEFINE_list("a_devices", ["2", "4", "8"], "CPU device counts for part (a).")
flags.DEFINE_integer("reps", 200, "Timed calls for the naive method in part (a).")
flags.DEFINE_list("d_sizes", ["1M", "16M", "64M"], "Per-rank sizes for part (d).")
flags.DEFINE_list("d_collectives", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                                    "ppermute"], "Collectives for part (d).")
flags.DEFINE_integer("rounds", 3, "Alternating rounds for parts (d) and (e).")
flags.DEFINE_string("e_min", "1K", "Smallest size for part (e).")
flags.DEFINE_string("e_max", "64M", "Largest size for part (e).")
flags.DEFINE_integer("e_samples", 10, "Timed samples per size in part (e), every arm.")
flags.DEFINE_integer("e_warmup", 2, "Untimed calls per size in part (e), every arm.")
# Worker flags (set by part (e) for its own processes).
flags.DEFINE_integer("rank", 0, "Part (e) worker: this process's rank.")
flags.DEFINE_integer("world", 2, "Part (e) worker: number of processes.")
flags.DEFINE_string("coordinator", "", "Part (e) worker: host:port of the rendezvous.")
flags.DEFINE_string("out", "", "Part (e) worker: write results (rank 0) as JSON here.")
FLAGS = flags.FLAGS


def _mesh(topology):
  from microbench.meshes.mesh import build_mesh, ordered_devices  # pylint: disable=g-import-not-at-top
  return build_mesh(topology, ordered_devices()[:topology.num_devices])


def _config(**kw):
  from microbench.bench import sweep  # pylint: disable=g-import-not-at-top
  base = dict(collectives=("all_reduce",), scopes=("global",), dtypes=("float32",), min_bytes=1, max_bytes=1,
              step_factor=2.0, iters=20, warmup=1, samples=10, check=True, sample_s=0.02)
  base.update(kw)
  return sweep.SweepConfig(**base)


def part_a_one() -> dict:
  """Part (a) on however many CPU devices this process has (one group of all of them)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from microbench.meshes.scopes import plan_scopes  # pylint: disable=g-import-not-at-top
  from microbench.meshes.topology import Topology  # pylint: disable=g-import-not-at-top
  from microbench.bench import collectives, sweep  # pylint: disable=g-import-not-at-top

  n = jax.device_count()
  topo = Topology(1, 1, n)
  mesh = _mesh(topo)
  plan = plan_scopes(topo, ["scale_up"])[0]
  out = {}
  for nbytes in (1024, 4096):
    # The toolkit: its default repetition policy, 20 samples, per-operation times by difference.
    rec = sweep.run_point(_config(iters=200, samples=20), mesh, plan, collectives.get("all_reduce"), "float32",
                          nbytes, lambda: None)
    toolkit = np.asarray(rec["samples_us"]) * 1e-6
    # Naive: one jitted all-reduce per call, timed from the host around each call.
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, plan.axes), mesh=mesh, in_specs=jax.P(plan.axes),
                               out_specs=jax.P(plan.axes), check_vma=False))
    x = jax.device_put(np.ones(mesh.size * nbytes // 4, np.float32), jax.NamedSharding(mesh, jax.P(plan.axes)))
    for _ in range(10):
      fn(x).block_until_ready()
    naive = []
    for _ in range(FLAGS.reps):
      t0 = time.perf_counter()
      fn(x).block_until_ready()
      naive.append(time.perf_counter() - t0)
    naive = np.asarray(naive)
    out[nbytes] = {
        "devices": n, "iters": rec["iters"], "call_overhead_us": rec.get("call_overhead_us"),
        "toolkit_min_us": float(toolkit.min() * 1e6), "toolkit_median_us": rec["time_us"],
        "naive_min_us": float(naive.min() * 1e6), "naive_median_us": float(np.median(naive) * 1e6),
        "floor_ratio": float(naive.min() / max(toolkit.min(), 1e-12)),
        "median_ratio": float(np.median(naive) / (rec["time_us"] * 1e-6))}
  return out


def _child(parts: str, env: dict) -> dict:
  r = subprocess.run([sys.executable, __file__, f"--parts={parts}", *_passed_flags()], env=env,
                     capture_output=True, text=True, cwd=ROOT)
  if r.returncode:
    raise SystemExit(f"part {parts} failed: {r.stderr[-2000:]}")
  return json.loads(r.stdout[r.stdout.index("{"):])[parts]


def _passed_flags() -> list[str]:
  return [f"--{name}={','.join(v) if isinstance(v, list) else v}" for name in
          ("reps", "d_sizes", "d_collectives", "rounds", "large_bytes")
          for v in [FLAGS[name].value]]


def part_a() -> dict:
  """Part (a) for 2, 4 and 8 CPU devices, each in a fresh process (the device count is fixed at start)."""
  out = {}
  for n in FLAGS.a_devices:
    res = _child("a_one", {**os.environ, "JAX_NUM_CPU_DEVICES": str(n)})
    out[n] = res
    for nbytes, v in res.items():
      print(f"(a) all_reduce {nbytes} B, one group of {n} CPU devices: toolkit min {v['toolkit_min_us']:.1f} us"
            f" (median {v['toolkit_median_us']:.1f}, long arm {v['iters']} ops, per-call overhead removed"
            f" {v['call_overhead_us'] or 0:.0f} us), naive host timing min {v['naive_min_us']:.1f} us"
            f" (median {v['naive_median_us']:.1f}); floor ratio {v['floor_ratio']:.1f}x,"
            f" median ratio {v['median_ratio']:.1f}x", flush=True)
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
    recs = run_folder.read_results(f"{tmp}/run")
  compile_s = sum(r.get("compile_s", 0.0) for r in recs)
  methods = sorted({r.get("time_method", "?") for r in recs})
  out = {"points": len(recs), "wall_s": wall, "compile_s": compile_s, "other_s": wall - compile_s,
         "time_methods": methods, "load_avg": os.getloadavg()[0]}
  print(f"(b) default sweep: {len(recs)} points, wall {wall:.1f} s (target <= 120 s), of which XLA compile"
        f" {compile_s:.1f} s ({100 * compile_s / wall:.0f}%, target <= 50%); methods {methods};"
        f" load average {out['load_avg']:.1f}", flush=True)
  return out


def part_c() -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from microbench.meshes.scopes import plan_scopes  # pylint: disable=g-import-not-at-top
  from microbench.meshes.topology import Topology  # pylint: disable=g-import-not-at-top
  from microbench.bench import collectives, sizes, sweep  # pylint: disable=g-import-not-at-top

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
  mesh = _mesh(topo)
  out = {"memcpy_gbps": memcpy}
  for plan in plan_scopes(topo, ["scale_up", "global"]):
    rec = sweep.run_point(_config(samples=5), mesh, plan, collectives.get("all_reduce"), "float32", nbytes,
                          lambda: None)
    out[plan.name] = {"busbw_gbps": rec["busbw_gbps"], "time_us": rec["time_us"], "wrong": rec["wrong"],
                      "ratio_to_memcpy": rec["busbw_gbps"] / memcpy}
    print(f"(c) all_reduce {FLAGS.large_bytes} {plan.name} (n={plan.group_size}, one process): busbw"
          f" {rec['busbw_gbps']:.2f} GB/s vs single-thread memcpy {memcpy:.2f} GB/s: ratio"
          f" {rec['busbw_gbps'] / memcpy:.2f}", flush=True)
  return out


def part_d() -> dict:
  """Default run vs plain jitted call vs long in-graph loop, one group of 8 CPU devices, alternating."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from microbench.meshes.scopes import plan_scopes  # pylint: disable=g-import-not-at-top
  from microbench.meshes.topology import Topology  # pylint: disable=g-import-not-at-top
  from microbench.bench import collectives, program, sizes, sweep  # pylint: disable=g-import-not-at-top

  topo = Topology(1, 2, 4)
  mesh = _mesh(topo)
  plan = plan_scopes(topo, ["global"])[0]
  out = {}
  for name in FLAGS.d_collectives:
    coll = collectives.get(name)
    for size in FLAGS.d_sizes:
      nbytes = sizes.parse_size(size)
      count = sizes.round_count(nbytes, 4, coll.count_multiple(plan.group_size))
      point = program.build_check(coll, mesh, plan, count, "float32")
      plain = point.check_prog.fn  # the jitted one-operation program, called as a user would: fresh output
      x = program.known_input_array(point)
      jax.block_until_ready(plain(x))
      op_s = program.call_time(point)
      # Long enough that per-call costs (at 64 MiB on CPU, fresh temporaries: ~0.25 s a call) fall below a few
      # percent of the call: at least 40 operations, up to 200 or ~3 s.
      long_reps = int(min(200, max(40, 3.0 / op_s)))
      long_reps -= long_reps % 2
      long = program.build_timed(coll, mesh, plan, count, "float32", long_reps)
      carry = program.initial_carry(point)
      rows = {"default": [], "plain": [], "long_loop": [], "call_overhead": []}
      for _ in range(FLAGS.rounds):
        rec = sweep.run_point(_config(), mesh, plan, coll, "float32", nbytes, lambda: None)
        rows["default"].append(rec["time_us"])
        rows["call_overhead"].append(rec.get("call_overhead_us") or 0.0)
        calls = []
        for _ in range(max(3, min(20, int(0.5 / op_s)))):
          t0 = time.perf_counter()
          jax.block_until_ready(plain(x))
          calls.append(time.perf_counter() - t0)
        rows["plain"].append(float(np.median(calls)) * 1e6)
        t0 = time.perf_counter()
        carry = long.fn(*carry)
        jax.block_until_ready(carry)
        rows["long_loop"].append((time.perf_counter() - t0) / long_reps * 1e6)
      del carry, x
      med = {k: float(np.median(v)) for k, v in rows.items()}
      best = min(med["plain"], med["long_loop"])
      out[f"{name}/{size}"] = {**med, "rounds": rows, "long_reps": long_reps, "ratio_to_best": med["default"] / best,
                               "default_iters": rec["iters"], "default_method": rec["time_method"]}
      print(f"(d) {name} {size}/rank, 8 devices: default run {med['default'] / 1e3:.2f} ms"
            f" (long arm {rec['iters']} ops), plain jitted call {med['plain'] / 1e3:.2f} ms, long loop"
            f" ({long_reps} ops) {med['long_loop'] / 1e3:.2f} ms: default / best = {med['default'] / best:.2f}"
            f" (target <= 1.10); per-call cost the difference removed {med['call_overhead'] / 1e3:.2f} ms,"
            f" i.e. {med['call_overhead'] / long_reps / 1e3:.2f} ms per operation left in the long loop",
            flush=True)
  return out


def _e_sizes() -> list[int]:
  from microbench.bench import sizes  # pylint: disable=g-import-not-at-top
  return sizes.sweep(sizes.parse_size(FLAGS.e_min), sizes.parse_size(FLAGS.e_max), 4)


def e_psum_worker() -> None:
  """One process of the plain-psum arm: jax.distributed, a jitted psum, same protocol as the others."""
  from microbench.cluster import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(distributed.Settings(True, FLAGS.coordinator, FLAGS.world, FLAGS.rank))
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
  sharding = jax.NamedSharding(mesh, jax.P("x"))
  psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))
  ones = jax.make_array_from_callback((len(devices),), sharding, lambda i: np.ones(1, np.int32))
  barrier = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P()))
  out = {}
  for nbytes in _e_sizes():
    n = nbytes // 4
    x = jax.make_array_from_callback((len(devices) * n,), sharding, lambda i, n=n: np.ones(n, np.float32))
    for _ in range(FLAGS.e_warmup):
      jax.block_until_ready(psum(x))
    times = []
    for _ in range(FLAGS.e_samples):
      barrier(ones).block_until_ready()
      t0 = time.perf_counter()
      jax.block_until_ready(psum(x))
      times.append(time.perf_counter() - t0)
    slowest = np.asarray(multihost_utils.process_allgather(np.asarray(times), tiled=False)).max(axis=0)
    out[nbytes] = float(np.median(slowest))
  if FLAGS.rank == 0:
    with open(FLAGS.out, "w") as f:
      json.dump(out, f)


def e_torch_worker() -> None:
  """One process of the torch arm: gloo all_reduce, same protocol (barrier, slowest rank by MAX)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import torch.distributed as dist  # pylint: disable=g-import-not-at-top

  dist.init_process_group("gloo", init_method=f"tcp://{FLAGS.coordinator}", rank=FLAGS.rank, world_size=FLAGS.world)
  out = {}
  for nbytes in _e_sizes():
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    for _ in range(FLAGS.e_warmup):
      dist.all_reduce(x)
    times = []
    for _ in range(FLAGS.e_samples):
      dist.barrier()
      t0 = time.perf_counter()
      dist.all_reduce(x)
      times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out[nbytes] = float(np.median(t.numpy()))
  if FLAGS.rank == 0:
    with open(FLAGS.out, "w") as f:
      json.dump(out, f)
  dist.destroy_process_group()


def _job(cmd_for_rank, log_dir: str, world: int = 2, timeout: float = 900) -> None:
  """One 2-process job through the launcher (a failed or hung rank stops the others; logs in log_dir)."""
  from microbench.cluster import launch  # pylint: disable=g-import-not-at-top
  coordinator = f"127.0.0.1:{launch.free_port()}"
  env = launch.with_repo_on_path({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
  env["JAX_NUM_CPU_DEVICES"] = "1"
  os.makedirs(log_dir, exist_ok=True)
  procs = [launch.Proc("e", r, cmd_for_rank(r, coordinator), env, os.path.join(log_dir, f"rank{r}.log"))
           for r in range(world)]
  result = launch.run_jobs({"e": procs}, timeout=timeout)["e"]
  if result.returncode:
    raise SystemExit(f"part (e) job failed ({result.reason or result.returncode}): the failing rank's last lines"
                     " are above")


def part_e() -> dict:
  """Toolkit vs plain psum vs torch gloo, 2 processes x 1 CPU device, alternating rounds."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  try:
    import torch  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise SystemExit("part (e) needs torch: pip install torch==2.13.0 (the bench extra)") from None
  sizes_ = _e_sizes()
  arms = {"toolkit": [], "psum": [], "torch": []}
  with tempfile.TemporaryDirectory() as tmp:
    for rnd in range(FLAGS.rounds):
      run = f"{tmp}/tk{rnd}"
      _job(lambda r, c, run=run: [
          sys.executable, "-m", "microbench", "--collectives=all_reduce", "--scopes=global",
          f"--min_bytes={FLAGS.e_min}", f"--max_bytes={FLAGS.e_max}", "--step_factor=4",
          f"--samples={FLAGS.e_samples}", f"--warmup={FLAGS.e_warmup}", f"--outdir={run}", "--distributed",
          f"--coordinator_address={c}", "--num_processes=2", f"--process_id={r}"], f"{tmp}/logs-tk{rnd}")
      arms["toolkit"].append({r["bytes"]: r["time_us"] * 1e-6 for r in run_folder.read_results(run)})
      for arm, mode in (("psum", "e_psum"), ("torch", "e_torch")):
        path = f"{tmp}/{arm}{rnd}.json"
        _job(lambda r, c, mode=mode, path=path: [
            sys.executable, __file__, f"--parts={mode}", f"--rank={r}", "--world=2", f"--coordinator={c}",
            f"--out={path}", f"--e_min={FLAGS.e_min}", f"--e_max={FLAGS.e_max}", f"--e_samples={FLAGS.e_samples}",
            f"--e_warmup={FLAGS.e_warmup}"], f"{tmp}/logs-{arm}{rnd}")
        with open(path) as f:
          arms[arm].append({int(k): v for k, v in json.load(f).items()})
  out = {}
  for nbytes in sizes_:
    t = {arm: float(np.median([r[nbytes] for r in rounds])) for arm, rounds in arms.items()}
    busbw = {arm: nbytes / v / 1e9 for arm, v in t.items()}  # 2 ranks: factor 2(n-1)/n = 1
    out[nbytes] = {"time_s": t, "busbw_gbps": busbw, "toolkit_vs_torch": busbw["toolkit"] / busbw["torch"],
                   "psum_vs_torch": busbw["psum"] / busbw["torch"], "toolkit_vs_psum": busbw["toolkit"] / busbw["psum"]}
    print(f"(e) all_reduce {nbytes:>9} B, 2 processes: busbw toolkit {busbw['toolkit']:.3f}, plain psum"
          f" {busbw['psum']:.3f}, torch gloo {busbw['torch']:.3f} GB/s; toolkit/torch"
          f" {out[nbytes]['toolkit_vs_torch']:.2f}, psum/torch {out[nbytes]['psum_vs_torch']:.2f},"
          f" toolkit/psum {out[nbytes]['toolkit_vs_psum']:.2f}", flush=True)
  return out


def main(argv):
  del argv
  workers = {"e_psum": e_psum_worker, "e_torch": e_torch_worker}
  if FLAGS.parts[0] in workers:
    workers[FLAGS.parts[0]]()
    return
  if FLAGS.parts != ["a_one"]:
    print(f"# bench_timing on {os.cpu_count()} CPU(s), {time.strftime('%Y-%m-%d %H:%M')}, load average"
          f" {os.getloadavg()[0]:.1f}", flush=True)
  results = {}
  for part in FLAGS.parts:
    results[part] = {"a": part_a, "a_one": part_a_one, "b": part_b, "c": part_c, "d": part_d, "e": part_e}[part]()
  print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
  app.run(main)
