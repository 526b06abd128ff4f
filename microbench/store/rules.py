"""The operator's rules (TOML), each judged on a run: against the fabric model, against a baseline beyond
noise, absolute figures, the doctor's verdict, training MFU. A rule fails only on evidence: a figure whose
own interval still reaches the threshold passes (noise is not a failure), and a rule with nothing to judge
says so.

    [[rule]]
    name = "all-reduce near the model at bandwidth-bound sizes"
    metric = "vs_expected"        # vs_expected, busbw_gbps, time_us, vs_baseline, doctor, or a figure (train/mfu)
    collective = "all_reduce"     # optional filters: collective, scope, dtype, min_bytes, max_bytes
    min_bytes = "64M"
    op = ">="                     # >=, >, <=, <  (default >=)
    value = 0.7
    baseline = "accepted"         # vs_baseline only: a baseline name or "previous"
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import tomllib
from typing import Any

from microbench.store import compare, connect, history, queries

POINT_METRICS = ("vs_expected", "busbw_gbps", "time_us")
METRICS = (*POINT_METRICS, "vs_baseline", "doctor")
_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
_KEYS = {"name", "metric", "op", "value", "collective", "scope", "dtype", "min_bytes", "max_bytes", "baseline"}
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
PASS, FAIL, NONE = "pass", "FAIL", "nothing to judge"


class RulesError(ValueError):
  """A rules file that cannot be used: FILE:LINE: what is wrong."""


@dataclasses.dataclass
class Rule:
  name: str
  metric: str
  op: str
  value: float
  line: int
  collective: str | None = None
  scope: str | None = None
  dtype: str | None = None
  min_bytes: int = 0
  max_bytes: int | None = None
  baseline: str | None = None


@dataclasses.dataclass
class Outcome:
  rule: Rule
  verdict: str  # PASS, FAIL or NONE
  detail: str


def _bytes(text: Any, where: str) -> int:
  m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", str(text), re.I)
  if not m:
    raise RulesError(f"{where}: {text!r} is not a size (8, 64K, 32M, 1G)")
  return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _line_of(text: str, index: int, key: str | None) -> int:
  """The line of the index-th [[rule]] (or of `key` inside it), for messages."""
  lines = text.splitlines()
  starts = [i for i, l in enumerate(lines) if re.match(r"\s*\[\[\s*rule\s*\]\]", l)]
  start = starts[index] if index < len(starts) else 0
  end = starts[index + 1] if index + 1 < len(starts) else len(lines)
  if key:
    for i in range(start, end):
      if re.match(rf"\s*{re.escape(key)}\s*=", lines[i]):
        return i + 1
  return start + 1


def load(path: str) -> list[Rule]:
  """The rules in `path`; RulesError (`path:line: what`) for anything that would not judge as written."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    raise RulesError(f"{path}: {e.strerror}") from None
  try:
    doc = tomllib.loads(text)
  except tomllib.TOMLDecodeError as e:
    m = re.search(r"line (\d+)", str(e))
    raise RulesError(f"{path}:{m.group(1) if m else 1}: not TOML ({str(e).split(' (at')[0]})") from None
  items = doc.get("rule")
  extra = set(doc) - {"rule"}
  if extra or not isinstance(items, list) or not items:
    raise RulesError(f"{path}:1: expected [[rule]] tables only (found {', '.join(sorted(extra)) or 'no rule'})")
  return [_rule(path, text, i, item) for i, item in enumerate(items)]


def _rule(path: str, text: str, i: int, item: dict[str, Any]) -> Rule:
  def where(key: str | None = None) -> str:
    return f"{path}:{_line_of(text, i, key)}"
  unknown = sorted(set(item) - _KEYS)
  if unknown:
    raise RulesError(f"{where(unknown[0])}: unknown key {unknown[0]!r} (keys: {', '.join(sorted(_KEYS))})")
  metric = item.get("metric")
  if not isinstance(metric, str) or not (metric in METRICS or "/" in metric):
    raise RulesError(f"{where('metric')}: metric {metric!r}: choose {', '.join(METRICS)}, or a run figure such as"
                     " train/mfu")
  op = item.get("op", ">=")
  if op not in _OPS:
    raise RulesError(f"{where('op')}: op {op!r}: choose {', '.join(_OPS)}")
  value = item.get("value", 0 if metric == "doctor" else None)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise RulesError(f"{where('value')}: value must be a number (the threshold)")
  if metric == "vs_baseline" and not item.get("baseline"):
    raise RulesError(f"{where()}: a vs_baseline rule names its baseline (baseline = \"NAME\" or \"previous\")")
  return Rule(item.get("name") or f"rule {i + 1} ({metric})", metric, op, float(value), _line_of(text, i, None),
              item.get("collective"), item.get("scope"), item.get("dtype"),
              _bytes(item.get("min_bytes", 0), where("min_bytes")),
              _bytes(item["max_bytes"], where("max_bytes")) if "max_bytes" in item else None, item.get("baseline"))


def _selected(rule: Rule, r: dict[str, Any]) -> bool:
  b = int(r.get("bytes") or 0)
  return ((rule.collective is None or r.get("collective") == rule.collective)
          and (rule.scope is None or r.get("scope") == rule.scope)
          and (rule.dtype is None or r.get("dtype") == rule.dtype)
          and b >= rule.min_bytes and (rule.max_bytes is None or b <= rule.max_bytes))


def _bounds(rule: Rule, r: dict[str, Any]) -> tuple[float, float, float] | None:
  """(value, most favourable, least favourable) of a point's figure within its own interval."""
  t = r.get("time_us")
  v = r.get(rule.metric)
  if r.get("status") != "ok" or v is None or not t or t <= 0:
    return None
  iv = history.median_interval(list(r.get("samples_us") or []))
  if iv is None or iv[0] <= 0:
    return v, v, v
  if rule.metric == "time_us":
    return v, iv[0], iv[1]
  return v, v * t / iv[0], v * t / iv[1]  # busbw and vs_expected scale with 1/time


def _judge_points(rule: Rule, recs: list[dict[str, Any]]) -> Outcome:
  cmp = _OPS[rule.op]
  checked, failed = 0, []
  for r in recs:
    if not _selected(rule, r):
      continue
    b = _bounds(rule, r)
    if b is None:
      continue
    checked += 1
    lower_is_better = rule.op in ("<=", "<")
    best = min(b[1], b[2]) if lower_is_better else max(b[1], b[2])
    if not cmp(best, rule.value):
      failed.append(f"{r['collective']} {r['scope']} {r['bytes']} B: {b[0]:.4g}")
  if not checked:
    return Outcome(rule, NONE, "no timed point matches its filters")
  if failed:
    return Outcome(rule, FAIL, f"{len(failed)} of {checked} point(s) {rule.metric} not {rule.op} {rule.value:g} even"
                   f" at their interval's edge: " + "; ".join(failed[:4]) + (" ..." if len(failed) > 4 else ""))
  return Outcome(rule, PASS, f"{checked} point(s) {rule.metric} {rule.op} {rule.value:g} (within their intervals)")


def _judge_baseline(rule: Rule, store: connect.Store, run_id: str) -> Outcome:
  c = compare.compare(store, run_id, rule.baseline, tolerance=0.0)
  judged, failed = 0, []
  for p in c.points:
    if not _selected(rule, p) or p["hi"] is None:
      continue
    judged += 1
    busbw_best = 1 / p["lo"]  # busbw ratio B/A at the favourable end of the time ratio's interval
    if not _OPS[rule.op](busbw_best, rule.value):
      failed.append(f"{p['collective']} {p['scope']} {p['bytes']} B: x{1 / p['time_ratio']:.3f}")
  if not judged:
    return Outcome(rule, NONE, f"no point with an interval in common with {c.against}")
  if failed:
    return Outcome(rule, FAIL, f"{len(failed)} of {judged} point(s) below {rule.value:g} x {c.against} beyond noise: "
                   + "; ".join(failed[:4]) + (" ..." if len(failed) > 4 else ""))
  return Outcome(rule, PASS, f"{judged} point(s) at {rule.value:g} x {c.against} or better within noise")


def judge(store: connect.Store, run_id: str, rule_list: list[Rule]) -> list[Outcome]:
  with store.read() as conn:
    run = queries.run_row(conn, run_id)
    recs = queries.records(conn, run_id)
    figs = queries.figures(conn, run_id)
  out = []
  for rule in rule_list:
    if rule.metric in POINT_METRICS:
      out.append(_judge_points(rule, recs))
    elif rule.metric == "vs_baseline":
      try:
        out.append(_judge_baseline(rule, store, run_id))
      except queries.NotFound as e:
        out.append(Outcome(rule, NONE, str(e)))
    elif rule.metric == "doctor":
      status = figs.get("doctor/status")
      out.append(Outcome(rule, NONE, f"run {run['name']} is not a doctor run") if status is None else
                 Outcome(rule, PASS if status == 0 else FAIL, "healthy" if status == 0 else
                         f"the doctor named {figs.get('doctor/culprits', 0):g} part(s) (exit {status:g})"))
    else:
      v = figs.get(rule.metric)
      out.append(Outcome(rule, NONE, f"run has no figure {rule.metric}") if v is None or math.isnan(v) else
                 Outcome(rule, PASS if _OPS[rule.op](v, rule.value) else FAIL, f"{rule.metric} = {v:.4g}"))
  return out
