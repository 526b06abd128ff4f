"""GPCNeT's congestion impact factor on the emulated cluster: one canary, alone and then beside each congestor
kind, placed across the canary's rack uplinks and inside other racks; measured CIF (mean, p99) against the
flow model's prediction. The table goes to OUT/validation.md and stdout.

Needs root (network namespaces). About 6 minutes on a 2-core machine:

  sudo .venv/bin/python scripts/validate_gpcnet.py --out=/tmp/gpcnet_validation

The scenarios are fixed here, before any result was seen. Machine: 4 racks x 2 hosts, hosts 400 Mbit/s,
uplinks 100 Mbit/s; the canary is a 2-host all-reduce across racks 0 and 1 (nodes 0 and 2), float32 (the wire
XLA:CPU uses, so the model is given the bytes that move), unless a scenario says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from microbench.cluster.testbed import QUEUES

MACHINE = "testbed:racks=4,hosts_per_rack=2,host_rate=400mbit,uplink_rate=100mbit"
CANARY = "all_reduce:1M@0,2"
M12 = "testbed:racks=4,hosts_per_rack=3,host_rate=400mbit,uplink_rate=100mbit"
# (name, canary, congestor specs, extra flags)
SCENARIOS: list[tuple[str, str, list[str], list[str]]] = [
    ("alltoall across the canary's uplinks", CANARY, ["alltoall@1,3"], []),
    ("incast across (into node 1, from racks 1 and 2)", CANARY, ["incast@1,3,5"], []),
    ("broadcast across (node 3 -> node 1)", CANARY, ["broadcast@3,1"], []),
    ("permutation across (nodes 1,3,5,7)", CANARY, ["permutation@1,3,5,7"], []),
    ("alltoall inside rack 2", CANARY, ["alltoall@4,5"], []),
    ("incast inside rack 3", CANARY, ["incast@6,7"], []),
    ("broadcast inside rack 2", CANARY, ["broadcast@4,5"], []),
    ("permutation inside rack 3", CANARY, ["permutation@6,7"], []),
    ("DP proxy canary, alltoall across", "dp@0,2", ["alltoall@1,3"], ["--bytes_scale=0.005", "--iters=15"]),
    # Added after the first table: GPCNeT's layout, the four kinds at once on 12 hosts (4 racks x 3).
    ("all four kinds at once, inside other racks (spread)", "all_reduce:1M@0,3",
     ["alltoall,incast,broadcast,permutation"], [f"--machine={M12}"]),
    ("all four kinds at once, across the canary's uplinks", "all_reduce:1M@0,3",
     ["alltoall@1,4", "incast@2,6,9", "broadcast@5,7", "permutation@8,10,11"], [f"--machine={M12}"]),
]
DEFAULT = [f"--machine={MACHINE}", "--iters=30", "--proxy_dtype=float32", "--grace=5"]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--only", default="", help="comma-separated scenario numbers (from 1)")
  ap.add_argument("--queue", default="fifo", choices=QUEUES,
                  help="the testbed links' queues (microbench-testbed --queue): fair is what the model describes")
  a = ap.parse_args()
  os.makedirs(a.out, exist_ok=True)
  only = {int(x) for x in a.only.split(",") if x}
  rows = []
  for i, (name, canary, congs, extra) in enumerate(SCENARIOS, 1):
    if only and i not in only:
      continue
    out = os.path.join(a.out, f"s{i:02d}")
    path = os.path.join(out, "gpcnet.json")
    given = {f.split("=")[0] for f in extra}
    flags = extra + [f for f in DEFAULT if f.split("=")[0] not in given]
    flags = [f + f",queue={a.queue}" if f.startswith("--machine=") and a.queue != "fifo" else f for f in flags]
    if not (os.path.exists(path) and "impact" in json.load(open(path, encoding="utf-8"))):
      cmd = [sys.executable, "-m", "microbench.cli.study", "gpcnet", f"--canary={canary}",
             *[f"--congestors={c}" for c in congs], "--backend=testbed", *flags, f"--out={out}"]
      t0 = time.time()
      r = subprocess.run(cmd, capture_output=True, text=True, check=False)
      print(f"[{i}] {name}: {time.time() - t0:.0f} s, exit {r.returncode}", file=sys.stderr, flush=True)
      if r.returncode:
        print(r.stderr[-2000:], file=sys.stderr)
    try:
      res = json.load(open(path, encoding="utf-8"))
    except OSError:
      res = {}
    rows.append((i, name, canary, congs, res))
  lines = ["| # | scenario | canary | congestors | shares a link | predicted CIF | measured mean CIF [95% CI] |"
           " measured p99 CIF [95% CI] | canary alone: predicted / measured mean (ms) | congestor in flight |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for i, name, canary, congs, res in rows:
    p, imp = res.get("predicted"), res.get("impact")
    if not p or not imp:
      lines.append(f"| {i} | {name} | {canary} | {' '.join(congs)} | | | not measured | | | |")
      continue

    def fmt(f: dict) -> str:
      ci = f"[{f['low']:.3f}, {f['high']:.3f}]" if f["low"] is not None else "(no interval)"
      return f"{f['cif']:.3f} {ci}" + ("" if f["resolved"] else " unresolved")
    cover = res["measured"]["congested"].get("congestor_coverage", {})
    lines.append(f"| {i} | {name} | `{canary}` | `{' '.join(congs)}` | {'yes' if p['shared_links'] else 'no'} |"
                 f" {p['cif']:.3f} | {fmt(imp['mean'])} | {fmt(imp['p99'])} | {p['alone_s'] * 1e3:.1f} /"
                 f" {imp['mean']['isolated_s'] * 1e3:.1f} | {', '.join(f'{100 * v:.0f}%' for v in cover.values())} |")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(a.out, "validation.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
