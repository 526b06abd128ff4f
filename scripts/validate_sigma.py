"""Predicted against measured sigma on the emulated cluster: each scenario is planned, predicted
(`microbench-study predict`, before the run), run on the testbed and reported; the table of every matching
key's measured and predicted sigma, with the error, goes to OUT/validation.md and stdout.

Needs root (network namespaces). About 15-20 minutes on a 2-core machine:

  sudo .venv/bin/python scripts/validate_sigma.py --out=/tmp/sigma_validation

The scenarios are fixed here, before any result was seen, and no test tunes to them; a scenario the model
gets wrong stays in the table.

`--repredict=NAME` predicts every finished scenario again with the model as it is now (`--model_flags`, e.g.
`--proxy_dtype=float32 --call_us=200000`) into RESULTS/NAME.json and tables those predictions against the
measurements already there: a revised model checked on the same runs, after the fact (say so when quoting).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from microbench.cluster.testbed import QUEUES
from microbench.study.predict import LATENCY_BOUND_SHARE, PREDICTED
from microbench.study.run_plan import key_name

M400_100 = "testbed:racks=4,hosts_per_rack=2,host_rate=400mbit,uplink_rate=100mbit"
# (name, machine, jobs or generator flags, extra run flags)
SCENARIOS: list[tuple[str, str, list[str], list[str]]] = [
    ("2-way uplink, DP", M400_100, ["dp@0,2", "dp@1,3"], []),
    ("isolated DP (own uplinks)", M400_100, ["dp@0,2", "dp@4,6"], []),
    ("inside racks, DP", M400_100, ["dp@0,1", "dp@2,3"], []),
    ("3-way uplink, DP", "testbed:racks=2,hosts_per_rack=3,host_rate=400mbit,uplink_rate=100mbit",
     ["dp@0,3", "dp@1,4", "dp@2,5"], []),
    ("DP beside FSDP on one uplink", M400_100, ["dp@0,2", "fsdp@1,3"], ["--compute_scale=0.25"]),
    ("FSDP pair on one uplink", M400_100, ["fsdp@0,2", "fsdp@1,3"], ["--compute_scale=0.25"]),
    ("DP+PP across 4 racks beside DP", M400_100, ["dp+pp@0,2,4,6", "dp@1,3"], ["--compute_scale=0.25"]),
    ("2-way uplink at 200 Mbit/s", "testbed:racks=4,hosts_per_rack=2,host_rate=400mbit,uplink_rate=200mbit",
     ["dp@0,2", "dp@1,3"], []),
    ("uplink wide enough (800 Mbit/s)", "testbed:racks=4,hosts_per_rack=2,host_rate=400mbit,uplink_rate=800mbit",
     ["dp@0,2", "dp@1,3"], []),
    ("host-bound (200 Mbit/s hosts, 100 uplink)", "testbed:racks=4,hosts_per_rack=2,host_rate=200mbit,"
     "uplink_rate=100mbit", ["dp@0,2", "dp@1,3"], []),
    ("2-way uplink, DP, 4x compute", M400_100, ["dp@0,2", "dp@1,3"], ["--compute_scale=4"]),
    ("rack-local job beside a shared-uplink pair", M400_100, ["dp@0,1", "dp@2,4", "dp@3,5"], []),
    ("generated plan (testbed, size_divisor 8)", "testbed", ["--size_divisor=8", "--samples_per_bin=1"],
     ["--compute_scale=0.02", "--bytes_scale=1e-4", "--iters=8"]),
]
DEFAULT_RUN = ["--bytes_scale=0.005", "--iters=12", "--small_job_threshold=1"]


def study(*args: str) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "microbench.cli.study", *args]
  r = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if r.returncode != 0:
    print(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}", file=sys.stderr)
  return r


def scale_flags(run_flags: list[str]) -> list[str]:
  """The run's flags with the defaults filled in (predict needs the same scales)."""
  given = {f.split("=")[0] for f in run_flags}
  return run_flags + [f for f in DEFAULT_RUN if f.split("=")[0] not in given]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--only", default="", help="comma-separated scenario numbers (from 1)")
  ap.add_argument("--repredict", default="", help="predict finished scenarios again into RESULTS/NAME.json")
  ap.add_argument("--model_flags", default="", help="extra `predict` flags for --repredict (space-separated)")
  ap.add_argument("--predict_flags", default="",
                  help="extra `predict` flags for the prediction made before each run (space-separated)")
  ap.add_argument("--queue", default="fifo", choices=QUEUES,
                  help="the testbed links' queues (microbench-testbed --queue): fair is what the model describes")
  a = ap.parse_args()
  os.makedirs(a.out, exist_ok=True)
  only = {int(x) for x in a.only.split(",") if x}
  rows = []
  for i, (name, machine, jobs, run_flags) in enumerate(SCENARIOS, 1):
    if only and i not in only:
      continue
    base = os.path.join(a.out, f"s{i:02d}")
    plan, res = base + "-plan", base + "-results"
    flags = scale_flags(run_flags)
    if a.queue != "fifo":
      machine += ("," if ":" in machine else ":") + f"queue={a.queue}"
    if not os.path.exists(os.path.join(res, "report", "sigma.json")):
      job_flags = [f"--jobs={j}" for j in jobs if "@" in j] + [j for j in jobs if "@" not in j]
      if study("plan", f"--machine={machine}", *job_flags, f"--out={plan}").returncode:
        continue
      pred_flags = [f for f in flags if f.split("=")[0] in ("--bytes_scale", "--compute_scale")]
      if study("predict", f"--plan={plan}", f"--out={res}", *pred_flags, *a.predict_flags.split()).returncode:
        continue
      t0 = time.time()
      study("run", f"--plan={plan}", f"--out={res}", "--backend=testbed", "--grace=5", *flags)
      study("report", f"--results={res}", "--noplots")
      print(f"[{i}] {name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    try:
      with open(os.path.join(res, "report", "sigma.json"), encoding="utf-8") as f:
        table = json.load(f)
    except OSError:
      rows.append((i, name, "-", None, None, "no report", None))  # the table still shows the others
      continue
    again = None
    if a.repredict:
      tmp = os.path.join(a.out, f".{a.repredict}-s{i:02d}")
      pred_flags = [f for f in flags if f.split("=")[0] in ("--bytes_scale", "--compute_scale")]
      if study("predict", f"--plan={plan}", f"--out={tmp}", *pred_flags, *a.model_flags.split()).returncode:
        continue
      os.replace(os.path.join(tmp, PREDICTED), os.path.join(res, f"{a.repredict}.json"))
      os.rmdir(tmp)
      with open(os.path.join(res, f"{a.repredict}.json"), encoding="utf-8") as f:
        again = json.load(f)["keys"]
    try:
      with open(os.path.join(res, PREDICTED), encoding="utf-8") as f:
        before = json.load(f)["keys"]
    except (OSError, KeyError, ValueError):
      before = {}
    for r in table:
      key = f"{r['strategy']} x{r['gpus']} {r['model']} {r['placement_class']}"
      measured = r.get("sigma", {}).get("sigma")
      ci = r.get("sigma", {})
      predicted = r.get("predicted", {}).get("sigma")
      name_of = key_name((r["strategy"], r["model"], r["gpus"], r["placement_class"]))
      share = (again if again is not None else before).get(name_of, {}).get("latency_share")
      if again is not None:
        predicted = again.get(name_of, {}).get("sigma")
      interval = f"[{ci['low']:.3f}, {ci['high']:.3f}]" if ci.get("has_interval") else "none"
      rows.append((i, name, key, measured, predicted, interval, share))
  lines = ["| # | scenario | key | measured sigma [95% CI] | predicted | error | latency share (predicted) |",
           "|---|---|---|---|---|---|---|"]
  errors, bandwidth = [], []
  for i, name, key, measured, predicted, interval, share in rows:
    err = None if measured is None or predicted is None else (predicted - measured) / measured
    bound = share is not None and share > LATENCY_BOUND_SHARE
    if err is not None:
      errors.append(abs(err))
      if not bound:
        bandwidth.append(abs(err))
    m = "n/a" if measured is None else f"{measured:.3f} {interval}"
    p = "n/a" if predicted is None else f"{predicted:.3f}"
    lat = "n/a" if share is None else f"{100 * share:.0f}%" + (" **latency-bound**" if bound else "")
    lines.append(f"| {i} | {name} | {key} | {m} | {p} | {'n/a' if err is None else f'{100 * err:+.1f}%'} | {lat} |")
  if errors:
    lines += ["", f"|error| over {len(errors)} key(s): median {100 * statistics.median(errors):.1f}%, worst"
                  f" {100 * max(errors):.1f}%"]
  if bandwidth and len(bandwidth) < len(errors):
    lines += ["", f"|error| over the {len(bandwidth)} key(s) the model does not mark latency-bound (latency share"
                  f" <= {100 * LATENCY_BOUND_SHARE:.0f}%): median {100 * statistics.median(bandwidth):.1f}%, worst"
                  f" {100 * max(bandwidth):.1f}%"]
  text = "\n".join(lines) + "\n"
  md = f"validation-{a.repredict}.md" if a.repredict else "validation.md"
  with open(os.path.join(a.out, md), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
