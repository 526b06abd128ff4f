"""Self-check on one GPU (not a test): what the collective timing method relies on, verified on the device.

One call, under 8 minutes on one GPU; writes a JSON report and prints a verdict per item:
(a) the timed loop's compiled HLO has a `known_trip_count` (and a loop with a runtime bound has none);
(b) the per-repetition cost of the in-graph loop on a tiny on-device op, from k=10 vs k=1000 repetitions:
    microseconds per repetition, which must not contain a host round trip; the same loop with a runtime
    trip count (the old design) beside it shows what a host round trip costs; and what entering the loop
    adds once per call (k=10 vs the loop-free k=2 short arm), the one cost the difference does not cancel;
(c) on one device every collective is degenerate: `microbench` says so and records no point;
(d) the training MFU check (scripts/bench_gpu_mfu.py) if present, else reported as not available.

  python scripts/gpu_check.py --out=$OUT/gpu_check.json     # on the GPU machine
  python scripts/gpu_check.py --smoke                       # the same path on CPU (CI runs this)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from microbench.cluster import launch
from microbench.output import run_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_bool("smoke", False, "Run on CPU (one device) with small settings: checks the script itself.")
flags.DEFINE_string("out", None, "Write the JSON report here.")
flags.DEFINE_float("max_rep_us", 5.0, "(b) passes when a repetition costs less than this (a host round trip"
                   " on a GPU is ~10 us or more).")
flags.DEFINE_integer("samples", 15, "(b) timed calls per repetition count.")
FLAGS = flags.FLAGS


def _env() -> dict[str, str]:
  """The children's environment: ours (main already set --smoke's CPU settings in it), the checkout on the path."""
  return launch.with_repo_on_path(dict(os.environ))


def _tiny_step(c):
  (x,) = c
  return (x * 0.5 + 1.0,)  # tiny, on-device, and each repetition depends on the previous one


def _loop_program(reps: int, static: bool):
  """The toolkit's loop builder on a tiny op (one device has no collective to repeat); with
  `static=False`, the old design: the bound is a runtime argument."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from microbench.bench import program  # pylint: disable=g-import-not-at-top

  x = jax.ShapeDtypeStruct((256,), jnp.float32)
  if static:
    fn = jax.jit(lambda v: program.repeat(_tiny_step, reps, (v,))[0], donate_argnums=0)
    return fn.lower(x).compile(), None
  fn = jax.jit(lambda v, k: jax.lax.fori_loop(0, k, lambda _, c: _tiny_step(_tiny_step(c)), (v,))[0],
               donate_argnums=0)
  return fn.lower(x, jax.ShapeDtypeStruct((), jnp.int32)).compile(), reps // 2


def check_a() -> dict:
  from microbench.hlo import parse  # pylint: disable=g-import-not-at-top
  static, _ = _loop_program(1000, static=True)
  runtime, _ = _loop_program(1000, static=False)
  loops = parse.while_loops(static.as_text())
  old = parse.while_loops(runtime.as_text())
  trips = [w.trip_count for w in loops]
  ok = bool(loops) and all(t is not None for t in trips) and sum(trips) * 2 == 1000
  return {"verdict": "pass" if ok and all(w.trip_count is None for w in old) else "fail",
          "timed_loop_trip_counts": trips, "runtime_bound_loop_trip_counts": [w.trip_count for w in old],
          "while": loops[0].line[:300] if loops else None}


def _per_call(compiled, k_arg, samples: int) -> float:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  x = jnp.ones((256,), jnp.float32)
  args = (jnp.int32(k_arg),) if k_arg is not None else ()
  x = compiled(x, *args)
  jax.block_until_ready(x)
  times = []
  for _ in range(samples):
    t0 = time.perf_counter()
    x = compiled(x, *args)
    jax.block_until_ready(x)
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def check_b() -> dict:
  out = {}
  for static in (True, False):
    t = {}
    for k in (2, 10, 1000) if static else (10, 1000):
      compiled, k_arg = _loop_program(k, static)
      t[k] = _per_call(compiled, k_arg, FLAGS.samples)
    per_rep_us = (t[1000] - t[10]) / 990 * 1e6
    row = {"per_call_us_k10": t[10] * 1e6, "per_call_us_k1000": t[1000] * 1e6, "per_rep_us": per_rep_us,
           "naive_per_rep_us_k10": t[10] / 10 * 1e6}
    if static:  # k=2 is the short arm: two steps, no loop (XLA inlines one trip); what the loop adds once
      row["per_call_us_k2"] = t[2] * 1e6
      row["loop_entry_us"] = (t[10] - t[2]) * 1e6 - 8 * per_rep_us
    out["known_trip_count" if static else "runtime_trip_count"] = row
  rep = out["known_trip_count"]["per_rep_us"]
  out["verdict"] = "pass" if rep < FLAGS.max_rep_us else "fail"
  out["threshold_us"] = FLAGS.max_rep_us
  return out


def check_c() -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    run = os.path.join(tmp, "run")
    r = subprocess.run([sys.executable, "-m", "microbench", "--max_bytes=64K", f"--outdir={run}"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300, check=False)
    recs = run_folder.read_results(run)
  said = "nothing to measure or check" in r.stderr and "groups of one device" in r.stdout
  ok = r.returncode == 2 and said and not recs
  return {"verdict": "pass" if ok else "fail", "exit_code": r.returncode, "records": len(recs),
          "said_degenerate": said, "stdout_tail": r.stdout[-600:], "stderr_tail": r.stderr[-600:] if not ok else ""}


def check_d() -> dict:
  script = os.path.join(ROOT, "scripts", "bench_gpu_mfu.py")
  if not os.path.exists(script):
    return {"verdict": "not available", "reason": "scripts/bench_gpu_mfu.py is not in this checkout"}
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "mfu.json")
    cmd = [sys.executable, script, f"--out={path}"] + (["--smoke", "--steps=3", "--warmup_steps=1"] if FLAGS.smoke else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=330, check=False)
    data = json.load(open(path)) if os.path.exists(path) else {}
    rows = data.get("rows", []) if isinstance(data, dict) else data  # {"rows": [...], ...} per configuration
  ok_rows = [row for row in rows if row.get("status") == "ok"]
  best = max((row.get("mfu") or 0 for row in ok_rows), default=None)
  if FLAGS.smoke:
    verdict = "pass" if r.returncode == 0 and ok_rows else "fail"
  else:
    verdict = "pass" if best is not None and best >= 0.45 else "fail"
  return {"verdict": verdict, "best_mfu": best, "target": None if FLAGS.smoke else 0.45, "rows": rows,
          "exit_code": r.returncode, "stderr_tail": r.stderr[-600:] if r.returncode else ""}


def main(argv: list[str]) -> int:
  del argv
  if FLAGS.smoke:
    os.environ.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    FLAGS.samples = min(FLAGS.samples, 5)
    FLAGS.max_rep_us = max(FLAGS.max_rep_us, 1000.0)  # CPU: checks the path, not the GPU figure
  import jax  # pylint: disable=g-import-not-at-top
  report = {"device": str(jax.devices()[0].device_kind), "platform": jax.devices()[0].platform,
            "jax": jax.__version__, "smoke": FLAGS.smoke, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
  names = {"a": "timed loop has a known trip count", "b": "per-repetition cost of the in-graph loop",
           "c": "one device: collectives are degenerate and nothing is recorded", "d": "training MFU check"}
  t0 = time.perf_counter()
  for item, fn in (("a", check_a), ("b", check_b), ("c", check_c), ("d", check_d)):
    t = time.perf_counter()
    try:
      report[item] = fn()
    except Exception as e:  # pylint: disable=broad-except
      report[item] = {"verdict": "fail", "error": f"{type(e).__name__}: {str(e)[:500]}"}
    report[item]["seconds"] = time.perf_counter() - t
    detail = ""
    if item == "b" and "known_trip_count" in report[item]:
      b = report[item]
      detail = (f": {b['known_trip_count']['per_rep_us']:.2f} us per repetition with a known trip count,"
                f" {b['runtime_trip_count']['per_rep_us']:.2f} us with a runtime one; loop entry"
                f" {b['known_trip_count']['loop_entry_us']:.1f} us once per call")
    elif item == "d" and report[item].get("best_mfu") is not None:
      detail = f": best MFU {100 * report[item]['best_mfu']:.1f}%"
    print(f"gpu_check ({item}) {names[item]}: {report[item]['verdict'].upper()}{detail}", flush=True)
  report["seconds"] = time.perf_counter() - t0
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=1, default=str)
  print(json.dumps({k: v.get("verdict") if isinstance(v, dict) else v for k, v in report.items()}))
  return 1 if any(isinstance(v, dict) and v.get("verdict") == "fail" for v in report.values()) else 0


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
