"""Placements ranked by predicted interference, checked on the emulated cluster: for each job list,
`microbench-study place` ranks candidate placements and writes the first- and last-ranked as plans; both are
run on the testbed and their measured mean sigma compared (the first must measure lower).

Needs root (network namespaces). About 10 minutes on a 2-core machine:

  sudo .venv/bin/python scripts/validate_placement.py --out=/tmp/place_validation
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MACHINE = "testbed:racks=4,hosts_per_rack=2,host_rate=400mbit,uplink_rate=100mbit"
JOB_LISTS = [["dp:2", "dp:2"], ["dp:2", "dp:2", "dp:2"], ["dp:2", "dp:4"]]
RUN = ["--bytes_scale=0.005", "--iters=12", "--grace=5", "--backend=testbed", "--small_job_threshold=1"]


def study(*args: str) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "microbench.cli.study", *args]
  r = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if r.returncode:
    print(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}", file=sys.stderr)
  return r


def mean_sigma(results: str) -> tuple[float | None, str]:
  try:
    with open(os.path.join(results, "report", "sigma.json"), encoding="utf-8") as f:
      rows = json.load(f)
  except OSError:
    return None, "no report"
  sig = [r["sigma"]["sigma"] for r in rows if r.get("sigma")]
  desc = ", ".join(f"{r['strategy']}x{r['gpus']} {r['placement_class']} {r['sigma']['sigma']:.3f}" for r in rows
                   if r.get("sigma"))
  return (statistics.fmean(sig) if sig else None), desc


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  a = ap.parse_args()
  lines = ["| jobs | rank | predicted worst / mean sigma | measured mean sigma | measured per key |",
           "|---|---|---|---|---|"]
  held = 0
  for i, jobs in enumerate(JOB_LISTS, 1):
    base = os.path.join(a.out, f"l{i}")
    r = study("place", f"--machine={MACHINE}", *[f"--jobs={j}" for j in jobs], "--bytes_scale=0.005",
              f"--out={base}")
    if r.returncode:
      continue
    ranked = [line for line in r.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    measured = {}
    for name, row in (("first", ranked[0]), ("last", ranked[-1])):
      res = os.path.join(base, name + "-results")
      if not os.path.exists(os.path.join(res, "report", "sigma.json")):
        study("run", f"--plan={os.path.join(base, name)}", f"--out={res}", *RUN)
        study("report", f"--results={res}", "--noplots")
      measured[name] = mean_sigma(res)
      cells = row.strip("|").split("|")
      m, desc = measured[name]
      lines.append(f"| {' '.join(jobs)} | {name} ({cells[0].strip()}) | {cells[1].strip()} / {cells[2].strip()} |"
                   f" {'n/a' if m is None else f'{m:.3f}'} | {desc} |")
    first, last = measured["first"][0], measured["last"][0]
    held += int(first is not None and last is not None and first < last)
  lines += ["", f"first-ranked measured lower than last-ranked in {held} of {len(JOB_LISTS)} job lists"]
  text = "\n".join(lines) + "\n"
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "validation.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
