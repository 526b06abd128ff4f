"""A run judged against a named baseline, the same machine's previous run, or any run: point by point with
the report's intervals (the spread between runs where a side has several, the samples' bootstrap where each
side has one), per collective and scope, and in one line whose exit status a script can act on.

A point regressed when its time ratio's interval lies wholly above 1 (beyond noise) and its ratio is beyond
--tolerance as well: noise alone never fails a run, and a real change smaller than the operator cares about
does not either.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from microbench.report import tables
from microbench.store import connect, queries

REGRESSED, IMPROVED, SAME, UNKNOWN = "regressed", "improved", "same", "unknown"


@dataclasses.dataclass
class Comparison:
  run_id: str
  against: str  # what it was compared with, in words
  against_ids: list[str]
  points: list[dict[str, Any]]  # one per matched point: key, ratio, interval, verdict
  series: list[dict[str, Any]]  # per collective and scope: counts and the geometric-mean ratio
  changes: list[str]  # what differs between the fingerprints
  machine_note: str | None  # said when the machines differ
  only: tuple[int, int]  # points only the other side / only this run has
  tolerance: float

  @property
  def regressed(self) -> list[dict[str, Any]]:
    return [p for p in self.points if p["verdict"] == REGRESSED]

  @property
  def exit_status(self) -> int:
    return 1 if self.regressed else 0

  def verdict(self) -> str:
    n = len(self.points)
    counts = {v: sum(1 for p in self.points if p["verdict"] == v) for v in (REGRESSED, IMPROVED, SAME, UNKNOWN)}
    if not n:
      return f"verdict: nothing to compare against {self.against} (no timed point in common)"
    head = "REGRESSED" if counts[REGRESSED] else "improved" if counts[IMPROVED] else "same within noise"
    return (f"verdict: {head} against {self.against}: {counts[REGRESSED]} of {n} point(s) slower beyond noise and"
            f" {100 * self.tolerance:g}%, {counts[IMPROVED]} faster, {counts[SAME]} the same within noise"
            + (f", {counts[UNKNOWN]} without an interval" if counts[UNKNOWN] else ""))


def _judge(ratio: float, lo: float | None, hi: float | None, tolerance: float) -> str:
  if lo is None or hi is None:
    return UNKNOWN
  if lo > 1 and ratio > 1 + tolerance:
    return REGRESSED
  if hi < 1 and ratio < 1 / (1 + tolerance):
    return IMPROVED
  return SAME


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(d, dict):
    return {prefix: d}
  out: dict[str, Any] = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
  return out


def fingerprint_changes(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
  """`key: A -> B` for every fingerprint field that differs (a node, an NCCL version, an XLA flag)."""
  fa, fb = _flat(a), _flat(b)
  return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def _against(conn, run: dict[str, Any], against: str, other: str | None) -> tuple[str, list[str]]:
  if other is not None:
    return f"run {other}", [other]
  if against == "previous":
    prev = queries.previous(conn, run)
    if prev is None:
      raise queries.NotFound(f"run {run['run_id']}: no earlier {run['kind']} run on this machine to compare with")
    return f"the previous run {prev}", [prev]
  named = queries.baseline(conn, against)
  return f"baseline {against} ({len(named[1])} run(s))", named[1]


def compare(store: connect.Store, run_id: str, against: str, tolerance: float = 0.05) -> Comparison:
  """Run `run_id` against `against` (a baseline name, "previous", or a run folder or id)."""
  other = None
  if against != "previous":
    with store.read() as conn:
      is_baseline = queries.baseline(conn, against) is not None
    if not is_baseline:  # a run folder (indexed now if new) or a run id
      other = queries.resolve_run(store, against)
  with store.read() as conn:
    run = queries.run_row(conn, run_id)
    words, ids = _against(conn, run, against, other)
    others = [queries.run_row(conn, i) for i in ids]
    a_side = [queries.records(conn, i) for i in ids]
    b_side = queries.records(conn, run_id)
  rows = tables.ratio_rows(a_side, b_side)
  points = []
  for row in rows["both"]:
    key, ratio, lo, hi = tables.ratio_of(row)
    points.append({"collective": key[0], "scope": key[1], "dtype": key[2], "group_size": key[3], "bytes": key[4],
                   "time_ratio": ratio, "lo": lo, "hi": hi, "busbw_a": row[8], "busbw_b": row[9],
                   "interval_from": row[16], "verdict": _judge(ratio, lo, hi, tolerance)})
  series = _series(points, rows["series_interval"])
  machine_note = None
  if any(o["machine_id"] != run["machine_id"] for o in others):
    machine_note = ("different machines: " + ", ".join(sorted({o['machine_id'] for o in others})) + f" against"
                    f" {run['machine_id']}; compared as asked, but a difference may be the machine's")
  return Comparison(run_id, words, ids, points, series, fingerprint_changes(others[-1]["fingerprint"],
                                                                            run["fingerprint"]),
                    machine_note, (len(rows["only_a"]), len(rows["only_b"])), tolerance)


def _series(points: list[dict[str, Any]], intervals: dict) -> list[dict[str, Any]]:
  out: dict[tuple[str, str], dict[str, Any]] = {}
  for p in points:
    s = out.setdefault((p["collective"], p["scope"]), {"collective": p["collective"], "scope": p["scope"],
                                                       "points": 0, REGRESSED: 0, IMPROVED: 0, SAME: 0, UNKNOWN: 0,
                                                       "_logs": []})
    s["points"] += 1
    s[p["verdict"]] += 1
    s["_logs"].append(math.log(p["time_ratio"]))
  for s in out.values():
    s["geomean_time_ratio"] = math.exp(sum(s["_logs"]) / len(s["_logs"]))
    del s["_logs"]
  return list(out.values())


def lines(c: Comparison) -> list[str]:
  """The comparison for people: the fingerprint's changes, a row per collective and scope, the points that
  regressed, and the verdict last."""
  out = [f"run {c.run_id} against {c.against}"]
  if c.machine_note:
    out.append(f"NOTE {c.machine_note}")
  out += [f"changed: {x}" for x in c.changes] or ["changed: nothing in the fingerprint (same machine, software and"
                                                  " environment)"]
  if c.series:
    out.append(f"{'collective':<24} {'scope':<11} {'points':>6} {'slower':>6} {'faster':>6} {'same':>6}"
               f" {'time B/A':>9}")
    out += [f"{s['collective']:<24} {s['scope']:<11} {s['points']:>6} {s[REGRESSED]:>6} {s[IMPROVED]:>6}"
            f" {s[SAME]:>6} {s['geomean_time_ratio']:>9.3f}" for s in c.series]
  for p in c.regressed:
    out.append(f"REGRESSED {p['collective']} {p['scope']} {p['dtype']} n={p['group_size']} {p['bytes']} B: time x"
               f"{p['time_ratio']:.3f} [{p['lo']:.3f}, {p['hi']:.3f}], busbw {p['busbw_a'] or 0:.4g} -> "
               f"{p['busbw_b'] or 0:.4g} GB/s")
  if any(c.only):
    out.append(f"unmatched: {c.only[0]} point(s) only in {c.against}, {c.only[1]} only in this run")
  out.append(c.verdict())
  return out
