"""Collectives extrapolated on the emulated cluster: fit the fabric's host level from a 2-host sweep in one
rack and its uplinks from a 4-host sweep over two racks (a ring, as every larger group loads them: a 2-host pair
across racks underuses them, docs/fabric.md "Fitting the uplinks"), predict 4- and 8-host sweeps inside one rack,
6-host rings over 3 racks x 2 hosts and 2 racks x 3 hosts, and a 2-host pair across racks, then run them and
compare (time per operation at 1-16 MiB). Writes OUT/validation.md and prints it, with every predicted point that
could not be compared named.

Needs root (network namespaces). About 25 minutes on a 2-core machine at the default rates:

  sudo .venv/bin/python scripts/validate_collectives.py --out=/tmp/coll_validation
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from microbench.cluster.testbed import QUEUES

HOST, UPLINK = "400mbit", "200mbit"  # the defaults of --host_rate and --uplink_rate
SWEEP = ["--collectives=all_reduce,all_gather", "--scopes=scale_out", "--step_factor=4", "--samples=5",
         "--warmup=1"]
# the NICs (a pair in one rack), the uplinks (a ring of 2 racks x 2 hosts)
FIT_FROM = [("fit-2hosts", 2, 1), ("fit-2racks-4hosts", 4, 2)]
TARGETS = [("4 hosts, one rack", 4, 1, "1x4"), ("8 hosts, one rack", 8, 1, "1x8"),
           ("3 racks x 2 hosts", 6, 3, "1x2x3"), ("2 racks x 3 hosts", 6, 2, "1x3x2"),
           ("2 hosts across 2 racks (a pair)", 2, 2, "1x1x2")]
PREDICT = {"1M": 1 << 20, "4M": 4 << 20, "16M": 16 << 20}


def sweep(out: str, hosts: int, racks: int, rates: tuple[str, str], queue: str, min_bytes: str = "1M",
          max_bytes: str = "16M") -> None:
  """One sweep on a fresh testbed, kept: a re-run with the same OUT skips what is there."""
  if os.path.exists(os.path.join(out, "results.jsonl")) and os.path.exists(os.path.join(out, "model.json")):
    return
  cmd = [sys.executable, "-m", "microbench.cli.testbed", f"--hosts={hosts}", f"--racks={racks}",
         f"--host_rate={rates[0]}", *([f"--uplink_rate={rates[1]}"] if racks > 1 else []), f"--queue={queue}", "--",
         sys.executable, "-m", "microbench", "--distributed", *SWEEP, f"--min_bytes={min_bytes}", f"--max_bytes={max_bytes}",
         f"--nodes_per_rack={hosts // racks}", f"--outdir={out}"]
  r = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if r.returncode:
    raise SystemExit(f"sweep failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")


def measured(out: str) -> dict[tuple[str, int], dict]:
  """Each record by (collective, requested size), for every size it answers: the sweep rounds a requested size
  to the group (1048560 B, not 1048576, for an all-gather over 6 ranks), so `bytes` is not the key the
  prediction asks for."""
  with open(os.path.join(out, "results.jsonl"), encoding="utf-8") as f:
    recs = [json.loads(line) for line in f]
  return {(r["collective"], b): r for r in recs
          for b in [r.get("requested_bytes", r.get("bytes")), *r.get("also_requested", [])] if b is not None}


def unusable(rec: dict | None) -> str | None:
  """Why a measured point cannot be compared (None when it can)."""
  if rec is None:
    return "not measured"
  if rec.get("status") != "ok":
    return f"status {rec.get('status')}" + (f": {rec['reason']}" if rec.get("reason") else "")
  if rec.get("wrong"):
    return f"{rec['wrong']} wrong elements"
  if not rec.get("time_us"):
    return "no time"
  return None


def compare(pred: dict[tuple[str, int], tuple], got: dict[tuple[str, int], dict]
            ) -> tuple[list[tuple[str, int, float | None, tuple]], list[str]]:
  """Predicted points beside their measurements: rows (collective, requested size, measured us or None,
  prediction) and one line per point that could not be compared, so none vanishes from the table unsaid."""
  rows, dropped = [], []
  for (coll, size), p in sorted(pred.items()):
    rec = got.get((coll, size))
    why = unusable(rec)
    rows.append((coll, size, None if why else float(rec["time_us"]), p))
    if why:
      dropped.append(f"{coll} {size} B: {why}")
  return rows, dropped


def predicted(fit_dirs: list[str], hosts_per_rack: int, racks: int, shape: str, rates: tuple[str, str], queue: str,
              sizes: list[str]) -> dict[tuple[str, int], tuple]:
  cmd = [sys.executable, "-m", "microbench.cli.report",
         f"--fabric=testbed:racks={racks},hosts_per_rack={hosts_per_rack},host_rate={rates[0]},uplink_rate={rates[1]},"
         f"queue={queue}",
         f"--fit_from={','.join(fit_dirs)}", f"--shapes={shape}", f"--predict={','.join(sizes)}",
         "--fabric_collectives=all_reduce,all_gather"]
  r = subprocess.run(cmd, capture_output=True, text=True, check=True)
  out = {}
  for line in r.stdout.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if len(cells) == 8 and cells[3] in sizes:
      out[(cells[0], PREDICT[cells[3]])] = (float(cells[5]), cells[4], cells[7])
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--queue", default="fifo", choices=QUEUES,
                  help="the testbed links' queues (microbench-testbed --queue)")
  ap.add_argument("--fit_min_bytes", default="1M",
                  help="smallest size of the 2-host sweeps the levels are fitted from (1K: latency-bound sizes"
                       " too, so the fits get a latency regime; on this VM their times jitter by milliseconds"
                       " and the regime is judged poor, see BUILD_NOTES)")
  ap.add_argument("--host_rate", default=HOST, help="every host link (microbench-testbed --host_rate)")
  ap.add_argument("--uplink_rate", default=UPLINK, help="the uplinks of the 2-rack sweeps")
  ap.add_argument("--max_bytes", default="16M", choices=list(PREDICT),
                  help="largest size swept and predicted (1M or 4M: a shorter run)")
  keys = [f"{h}x{r}" for _, h, r, _ in TARGETS]
  ap.add_argument("--targets", default=",".join(keys),
                  help=f"the target sweeps to predict and run, HOSTSxRACKS (of {', '.join(keys)})")
  a = ap.parse_args()
  chosen = [t.strip() for t in a.targets.split(",") if t.strip()]
  if not chosen or set(chosen) - set(keys):
    ap.error(f"--targets={a.targets}: give some of {', '.join(keys)}")
  sizes = [k for k, v in PREDICT.items() if v <= PREDICT[a.max_bytes]]
  rates = (a.host_rate, a.uplink_rate)
  os.makedirs(a.out, exist_ok=True)
  fit_dirs = []
  for name, hosts, racks in FIT_FROM:
    fit_dirs.append(os.path.join(a.out, name))
    sweep(fit_dirs[-1], hosts, racks, rates, a.queue, a.fit_min_bytes, a.max_bytes)
  lines = ["| target | collective | size | measured (us) | predicted (us) | algorithm | bottleneck | error |",
           "|---|---|---|---|---|---|---|---|"]
  errors, dropped = [], []
  for name, hosts, racks, shape in [t for t in TARGETS if f"{t[1]}x{t[2]}" in chosen]:
    run_dir = os.path.join(a.out, f"{hosts}hosts-{racks}racks")
    pred = predicted(fit_dirs, hosts // racks, racks, shape, rates, a.queue, sizes)  # before the run
    sweep(run_dir, hosts, racks, rates, a.queue, max_bytes=a.max_bytes)
    rows, lost = compare(pred, measured(run_dir))
    dropped += [f"{name}: {d}" for d in lost]
    for coll, size, m, (t, algo, neck) in rows:
      err = None if m is None else (t - m) / m
      if err is not None:
        errors.append(abs(err))
      lines.append(f"| {name} | {coll} | {size >> 20}M | {'n/a' if m is None else f'{m:.0f}'} | {t:.0f} | {algo} |"
                   f" {neck} | {'n/a' if err is None else f'{100 * err:+.1f}%'} |")
  if errors:
    lines += ["", f"|error| over {len(errors)} points: median {100 * statistics.median(errors):.1f}%, worst"
                  f" {100 * max(errors):.1f}%"]
  lines += ["", f"{len(dropped)} of {len(errors) + len(dropped)} predicted points not compared"
                + (":" if dropped else "")] + [f"- {d}" for d in dropped]
  text = "\n".join(lines) + "\n"
  with open(os.path.join(a.out, "validation.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
