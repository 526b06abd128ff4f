"""The check over the input space the command line accepts: draw cases (microbench.bench.matrix), run each honest
one and, where it runs, every mutant that applies to it (microbench.bench.mutants), and report.

    python scripts/check_matrix.py                              # the default sample, every backend installed
    python scripts/check_matrix.py --cpu=60 --gpu=40 --tpu=40 --seed=7 --out=matrix.json

CPU cases run in one worker process per device count (JAX fixes it at start: `JAX_NUM_CPU_DEVICES`); target
cases (GPU kinds need the gpu-compile extra, TPU kinds the tpu-compile extra) in one worker each, skipped with
the reason when the extra is absent. The report: cases per backend and how they came out, the dtypes and group
sizes covered, every honest case that failed and every mutant that was missed (both must be none), the time.
Exit status 1 on any failure or miss.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(payload: str) -> None:
  """In a worker process: run the cases (and their mutants) given as JSON, print the outcomes as JSON lines."""
  from microbench.bench import matrix  # pylint: disable=g-import-not-at-top
  job = json.loads(payload)
  for raw in job["cases"]:
    case = matrix.Case(**raw)
    outcomes = [matrix.run_case(case)]
    if job["mutants"]:
      outcomes += matrix.run_mutants(case, limit=job.get("max_mutants"))
    for o in outcomes:
      print(json.dumps(o.as_dict()), flush=True)


def _groups(cases) -> dict[tuple[str, int], list]:
  """Cases by worker: CPU cases by device count, each target kind apart."""
  out = collections.defaultdict(list)
  for c in cases:
    out[("cpu", c.devices) if c.backend == "cpu" else (c.backend, 0)].append(c)
  return out


def _available(backend: str) -> str | None:
  """Why a backend can't be run here (the extra it needs), or None."""
  from microbench.bench import matrix  # pylint: disable=g-import-not-at-top
  from microbench.aot import gpu_compile, tpu_compile  # pylint: disable=g-import-not-at-top
  if backend in matrix.TPU_KINDS and not tpu_compile.libtpu_available():
    return "libtpu is not installed: pip install -e '.[tpu-compile]'"
  if backend in matrix.GPU_KINDS and not gpu_compile.plugin_available():
    return f"JAX's CUDA plugin is not installed: {gpu_compile.INSTALL_HINT}"
  return None


def main() -> int:
  from microbench.bench import matrix  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--cpu", type=int, default=48, help="CPU cases (spread over --cpu_devices)")
  p.add_argument("--gpu", type=int, default=24, help="cases per GPU kind")
  p.add_argument("--tpu", type=int, default=24, help="cases per TPU kind")
  p.add_argument("--cpu_devices", default="8,32,72,128", help="device counts of the CPU workers")
  p.add_argument("--no_mutants", action="store_true", help="honest cases only")
  p.add_argument("--max_mutants", type=int, default=None,
                 help="at most this many mutants per case, a seeded draw (default: every one that applies)")
  p.add_argument("--max_bytes", type=int, default=None, help="largest size drawn (default: the space's, 1 GiB on"
                 " targets, 4 MiB on CPU devices)")
  p.add_argument("--out", default=None, help="write every outcome and the summary as JSON here")
  args = p.parse_args()
  counts = {"cpu": args.cpu, **{k: args.gpu for k in matrix.GPU_KINDS}, **{k: args.tpu for k in matrix.TPU_KINDS}}
  devices = tuple(int(v) for v in args.cpu_devices.split(","))
  cases = matrix.cases(args.seed, {k: v for k, v in counts.items() if v}, cpu_devices=devices,
                       max_bytes=args.max_bytes)
  t0 = time.perf_counter()
  results, skipped = [], {}
  for (backend, n), group in sorted(_groups(cases).items()):
    why = _available(backend)
    if why:
      skipped[backend] = why
      continue
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    if backend == "cpu":
      env["JAX_NUM_CPU_DEVICES"] = str(n)
    payload = json.dumps({"cases": [c.__dict__ for c in group], "mutants": not args.no_mutants and backend == "cpu",
                          "max_mutants": args.max_mutants})
    t = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--worker", payload], capture_output=True, text=True, env=env,
                       cwd=ROOT)
    lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    results += lines
    print(f"{backend}{f' x{n}' if n else ''}: {len(group)} case(s), {len(lines)} outcome(s) in"
          f" {time.perf_counter() - t:.0f} s" + ("" if r.returncode == 0 else f"; worker exit {r.returncode}:"
                                                 f" {r.stderr.strip().splitlines()[-1:] }"), flush=True)
    if r.returncode:
      results.append({"backend": backend, "status": "failed", "mutant": None, "reason": r.stderr[-2000:],
                      "collective": "(worker)", "dtype": "", "topology": "", "scope": "", "bytes": 0})
  report = _report(results, skipped, time.perf_counter() - t0)
  print(json.dumps(report["summary"], indent=1))
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({**report, "outcomes": results, "args": vars(args)}, f, indent=1)
  return 1 if report["summary"]["honest_failures"] or report["summary"]["mutants_missed"] else 0


def _report(results: list[dict], skipped: dict[str, str], seconds: float) -> dict:
  honest = [r for r in results if r.get("mutant") is None]
  muts = [r for r in results if r.get("mutant") is not None and r["status"] not in ("refused", "skipped")]
  ok = ("compiled", "refused", "skipped")
  bad = [r for r in honest if not (r["status"] in ok or r["status"] == "ok" and not r.get("wrong")
                                   and not r.get("timed_wrong"))]
  missed = [r for r in muts if not (r["status"] == "error" or r.get("wrong") or r.get("timed_wrong"))]
  by = collections.defaultdict(collections.Counter)
  for r in honest:
    by[r["backend"]][r["status"]] += 1
  dtypes = collections.defaultdict(collections.Counter)
  for r in honest:
    dtypes[r["backend"]][r["dtype"]] += 1
  kinds = collections.Counter(r["mutant"].rsplit("(", 1)[-1].rstrip(")") for r in muts)
  summary = {
      "cases": len(honest), "by_backend": {k: dict(v) for k, v in sorted(by.items())},
      "dtypes_by_backend": {k: dict(v) for k, v in sorted(dtypes.items())},
      "group_sizes": sorted({r.get("group_size") for r in honest if r.get("group_size")}),
      "mutants": len(muts), "mutant_kinds": dict(kinds),
      "honest_failures": [f"{r.get('backend')} {r.get('topology')} {r.get('collective')} over {r.get('scope')},"
                          f" {r.get('dtype')}, {r.get('bytes')} B: {r['status']}: {str(r.get('reason'))[:300]}"
                          for r in bad],
      "mutants_missed": [f"{r['mutant']}: {r.get('backend')} {r.get('topology')} over {r.get('scope')}, {r.get('dtype')},"
                         f" {r.get('bytes')} B, iters={r.get('iters')}" for r in missed],
      "skipped_backends": skipped, "seconds": round(seconds, 1)}
  return {"summary": summary}


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2])
  else:
    sys.exit(main())
