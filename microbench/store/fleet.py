"""The fleet's view of the store: per node, what the doctor said over time (how often it named the node, when
it last did, the node's last healthy run), and the latest figures and verdicts as Prometheus text exposition
for node_exporter's textfile collector (write NAME.prom.$$ then rename, so the collector never reads half a file)."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from microbench.store import queries, schema


def nodes(conn: sa.Connection, since: str | None = None) -> list[dict[str, Any]]:
  """Per node over the doctor runs: runs, times named, last named, last healthy."""
  q = (sa.select(schema.node_results.c.node, schema.node_results.c.verdict, schema.node_results.c.detail,
                 schema.runs.c.finished_at)
       .join(schema.runs, schema.runs.c.run_id == schema.node_results.c.run_id)
       .order_by(schema.runs.c.finished_at))
  if since:
    q = q.where(schema.runs.c.finished_at >= since)
  out: dict[str, dict[str, Any]] = {}
  for node, verdict, detail, finished in conn.execute(q):
    n = out.setdefault(node, {"node": node, "runs": 0, "named": 0, "unresolved": 0, "last_named": None,
                              "last_healthy": None, "last_verdict": None, "last_detail": ""})
    n["runs"] += 1
    n["last_verdict"], n["last_detail"] = verdict, detail
    if verdict == "named":
      n["named"] += 1
      n["last_named"] = finished
    elif verdict == "unresolved":
      n["unresolved"] += 1
    else:
      n["last_healthy"] = finished
  return [out[k] for k in sorted(out)]


def table(rows: list[dict[str, Any]]) -> str:
  head = f"{'node':<20} {'doctor runs':>11} {'named':>6} {'last named':<26} {'last healthy':<26} now"
  lines = [head, "-" * len(head)]
  for n in rows:
    lines.append(f"{n['node']:<20} {n['runs']:>11} {n['named']:>6} {n['last_named'] or '-':<26}"
                 f" {n['last_healthy'] or 'never':<26} {n['last_verdict']}"
                 + (f" ({n['last_detail']})" if n['last_verdict'] != "healthy" else ""))
  return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------- Prometheus

def _label(v: Any) -> str:
  return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _metric(name: str, help_text: str, kind: str, samples: Iterable[tuple[dict[str, Any], float]]) -> list[str]:
  rows = list(samples)
  if not rows:
    return []
  out = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
  for labels, value in rows:
    text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
    out.append(f"{name}{{{text}}} {value:.17g}")
  return out


def _epoch(iso: str | None) -> float | None:
  if not iso:
    return None
  return datetime.datetime.fromisoformat(iso).timestamp()


def _latest_sweeps(conn: sa.Connection) -> list[dict[str, Any]]:
  """Each machine's latest sweep."""
  latest: dict[str, dict[str, Any]] = {}
  for r in queries.machine_runs(conn, kind="sweep"):
    latest[r["machine_id"]] = r
  return list(latest.values())


def exposition(conn: sa.Connection, node: str | None = None, rule_results: dict[str, int] | None = None) -> str:
  """The store's latest state as Prometheus text: per node (the run's nodes, or `node` alone), collective,
  scope and size the latest busbw and its ratio to the model; the doctor's latest verdict per node; when each
  node was last named and last healthy; the rules' verdicts given."""
  fleet = [n for n in nodes(conn) if node is None or n["node"] == node]
  bw, vs = [], []
  for run in _latest_sweeps(conn):
    identity = json.loads(conn.execute(sa.select(schema.machines.c.identity).where(
        schema.machines.c.machine_id == run["machine_id"])).scalar_one())
    run_nodes = identity.get("nodes") or ["-"]
    if node is not None and node not in run_nodes:
      continue
    for r in queries.records(conn, run["run_id"]):
      if r.get("status") != "ok" or not r.get("busbw_gbps"):
        continue
      for n in ([node] if node else run_nodes):
        labels = {"node": n, "machine": run["machine_id"], "collective": r["collective"], "scope": r["scope"],
                  "dtype": r["dtype"], "bytes": int(r.get("bytes") or 0)}
        bw.append((labels, float(r["busbw_gbps"]) * 1e9))
        if r.get("vs_expected"):
          vs.append((labels, float(r["vs_expected"])))
  lines = _metric("microbench_busbw_bytes_per_second", "Bus bandwidth of the latest sweep on this node's machine.",
                  "gauge", bw)
  lines += _metric("microbench_vs_expected_ratio", "Measured over the fabric model's expected busbw, latest sweep.",
                   "gauge", vs)
  lines += _metric("microbench_doctor_node_healthy", "1 when the latest doctor run found this node healthy.", "gauge",
                   [({"node": n["node"]}, 1.0 if n["last_verdict"] == "healthy" else 0.0) for n in fleet])
  lines += _metric("microbench_doctor_named", "Doctor runs in the store that named this node.", "gauge",
                   [({"node": n["node"]}, float(n["named"])) for n in fleet])
  lines += _metric("microbench_doctor_last_healthy_timestamp_seconds", "When the doctor last found this node"
                   " healthy (Unix time).", "gauge",
                   [({"node": n["node"]}, _epoch(n["last_healthy"])) for n in fleet if n["last_healthy"]])
  lines += _metric("microbench_rule_passed", "1 when the rule passed on the judged run, 0 when it failed.", "gauge",
                   [({"rule": k}, float(v)) for k, v in sorted((rule_results or {}).items())])
  return "\n".join(lines) + "\n" if lines else ""


def write_textfile(path: str, text: str) -> str:
  """Atomically (temporary file, then rename): node_exporter may read the folder at any moment."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)
  return path
