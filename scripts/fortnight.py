"""A simulated fortnight on the emulated cluster: every night the doctor and a short sweep across the hosts,
each recorded in one results store; from night --slow_from on one host's link runs at a quarter of its rate.
Then what an operator's nightly job does: the first nights kept as baseline `accepted`, each night judged
against it and against the rules, the history's change point, the fleet's per-node view and the Prometheus
textfile. Prints one JSON summary (the test and docs/measured-figures.md read it). Needs root (the testbed).

  python scripts/fortnight.py --nights=14 --slow_from=9 --hosts=4 --out=/tmp/fortnight
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_integer("nights", 14, "Nights to run.", lower_bound=4)
flags.DEFINE_integer("slow_from", 9, "First night with the slow link (1-based).", lower_bound=2)
flags.DEFINE_integer("hosts", 4, "Emulated hosts (2 racks).", lower_bound=4)
flags.DEFINE_integer("baseline_nights", 3, "The first nights named baseline `accepted`.", lower_bound=1)
flags.DEFINE_string("slow_host", "h2", "The host whose link slows.")
flags.DEFINE_string("rate", "200mbit", "Host and uplink link rate.")
flags.DEFINE_string("out", None, "Folder for the nights' runs, the store and the views (required).")
FLAGS = flags.FLAGS

RULES = """\
[[rule]]
name = "no slower than the accepted baseline beyond noise"
metric = "vs_baseline"
baseline = "accepted"
value = 0.8

[[rule]]
name = "the doctor finds the fleet healthy"
metric = "doctor"
"""


BED = f"tbf{secrets.token_hex(3)}"  # one name for the fortnight: a cluster's nodes keep their names night to night


def _testbed(night: int, command: list[str]) -> subprocess.CompletedProcess:
  fault = [f"--fault={FLAGS.slow_host}:rate=0.25"] if night >= FLAGS.slow_from else []
  cmd = [sys.executable, "-m", "microbench.cli.testbed", f"--id={BED}", f"--hosts={FLAGS.hosts}",
         "--racks=2", f"--host_rate={FLAGS.rate}", f"--uplink_rate={FLAGS.rate}", *fault, "--", *command]
  return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)


def _report(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "microbench.cli.report", *args], capture_output=True, text=True,
                        cwd=ROOT, timeout=300, check=False)


def _night(night: int, store: str) -> dict:
  t0 = time.perf_counter()
  doctor, sweep = os.path.join(FLAGS.out, f"night{night:02d}-doctor"), os.path.join(FLAGS.out, f"night{night:02d}-sweep")
  d = _testbed(night, [sys.executable, "-m", "microbench.cli.doctor", f"--out={doctor}", f"--store={store}"])
  s = _testbed(night, [sys.executable, "-m", "microbench", "--collectives=all_reduce", "--scopes=scale_out",
                       "--min_bytes=1M", "--max_bytes=4M", "--samples=5", "--warmup=1", f"--outdir={sweep}",
                       f"--store={store}"])
  if s.returncode != 0 or not os.path.exists(os.path.join(sweep, "results.jsonl")):
    raise SystemExit(f"night {night}: the sweep failed (exit {s.returncode}): {s.stderr[-2000:]}")
  return {"night": night, "doctor": doctor, "sweep": sweep, "doctor_exit": d.returncode, "seconds": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
  del argv
  if not FLAGS.out:
    raise app.UsageError("--out=FOLDER is required")
  os.makedirs(FLAGS.out, exist_ok=True)
  store = os.path.join(FLAGS.out, "microbench.db")
  rules = os.path.join(FLAGS.out, "rules.toml")
  with open(rules, "w", encoding="utf-8") as f:
    f.write(RULES)
  t0 = time.perf_counter()
  nights = [_night(n, store) for n in range(1, FLAGS.nights + 1)]
  base = _report(f"--store={store}", "--baseline=accepted", *[n["sweep"] for n in nights[:FLAGS.baseline_nights]])
  if base.returncode:
    raise SystemExit(base.stderr)
  for n in nights:
    sweep = _report(f"--store={store}", n["sweep"], "--against=accepted", f"--rules={rules}")
    doctor = _report(f"--store={store}", n["doctor"], f"--rules={rules}")
    n.update(sweep_exit=sweep.returncode, sweep_verdict=[l for l in sweep.stdout.splitlines() if l.startswith("verdict")],
             doctor_rules_exit=doctor.returncode, drain=[l for l in doctor.stdout.splitlines() if "scontrol" in l])
  history = _report(f"--store={store}", "--history", f"--out={os.path.join(FLAGS.out, 'history')}")
  fleet = _report(f"--store={store}", "--fleet", f"--prometheus={os.path.join(FLAGS.out, 'microbench.prom')}")
  summary = {"nights": nights, "history": history.stdout.splitlines(), "history_exit": history.returncode,
             "fleet": fleet.stdout.splitlines(), "prometheus": os.path.join(FLAGS.out, "microbench.prom"),
             "change_nights": [int(l.split(" at run ")[1].split()[0]) for l in history.stdout.splitlines()
                               if l.startswith("CHANGE")],
             "seconds": time.perf_counter() - t0, "slow_from": FLAGS.slow_from, "slow_host": FLAGS.slow_host}
  print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  app.run(main)
