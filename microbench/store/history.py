"""A machine's figures over time: per collective, scope, dtype, group size and size, each run's busbw (with
its own interval from its samples), the baseline's band, the fabric model's expectation, and the change
points where the series moved.

Change points, the stated method: binary segmentation of the series of log run medians (least squares, as
`ruptures`' Binseg with an L2 cost), a split kept only when the step between the two sides is beyond their
noise (Student's t at 99.9% on the pooled variance, floored by the runs' own sampling variance so a flat,
quiet series cannot make any wiggle significant) and beyond the tolerance. Segments of one run are allowed at the
end only (a last run that moved is news; one odd run in the middle is an outlier the rules already judge).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import sqlalchemy as sa

from microbench.store import schema

Series = tuple[str, str, str, int, int]  # collective, scope, dtype, group size, bytes
_ALPHA = 0.001  # two-sided: a change point in one of 1000 flat series of the same length


@dataclasses.dataclass
class Point:
  run_id: str
  finished_at: str
  busbw: float
  lo: float | None  # the run's own busbw interval (from its samples), where it has them
  hi: float | None
  expected: float | None


def median_interval(samples: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
  """Distribution-free interval of a median (order statistics, binomial), None under 6 samples."""
  x = sorted(samples)
  n = len(x)
  if n < 6:
    return None
  from scipy import stats  # pylint: disable=import-outside-toplevel  (scipy comes with jax)
  k = int(stats.binom.ppf((1 - confidence) / 2, n, 0.5))
  return x[max(k - 1, 0)], x[min(n - k, n - 1)]


def _busbw_point(run_id: str, finished: str, r: dict[str, Any]) -> Point | None:
  bw, t = r.get("busbw_gbps"), r.get("time_us")
  if r.get("status") != "ok" or not bw or not t or t <= 0:
    return None
  iv = median_interval(list(r.get("samples_us") or []))
  lo, hi = (bw * t / iv[1], bw * t / iv[0]) if iv and iv[0] > 0 else (None, None)
  return Point(run_id, finished, float(bw), lo, hi, r.get("expected_busbw_gbps"))


def series(conn: sa.Connection, machine_id: str, since: str | None = None,
           kinds: tuple[str, ...] = ("sweep",)) -> dict[Series, list[Point]]:
  """Every timed point of the machine's runs, grouped by series, in finishing order."""
  q = (sa.select(schema.runs.c.run_id, schema.runs.c.finished_at, schema.points.c.record)
       .join(schema.points, schema.points.c.run_id == schema.runs.c.run_id)
       .where(schema.runs.c.machine_id == machine_id, schema.runs.c.kind.in_(kinds))
       .order_by(schema.runs.c.finished_at, schema.runs.c.run_id, schema.points.c.seq))
  if since:
    q = q.where(schema.runs.c.finished_at >= since)
  out: dict[Series, list[Point]] = {}
  for run_id, finished, text in conn.execute(q):
    r = json.loads(text)
    p = _busbw_point(run_id, finished, r)
    if p is not None:
      key = (r["collective"], r["scope"], r["dtype"], int(r.get("group_size") or 0), int(r.get("bytes") or 0))
      out.setdefault(key, []).append(p)
  return out


def _sampling_var(points: list[Point]) -> float:
  """The runs' own variance of log busbw (from their intervals: a 95% interval is about 4 sigma wide)."""
  widths = [(math.log(p.hi) - math.log(p.lo)) / 3.92 for p in points if p.lo and p.hi and p.lo > 0]
  return float(np.median(np.square(widths))) if widths else 0.0


def _step(y: np.ndarray, k: int, floor: float) -> tuple[float, float]:
  """(|t| over its critical value, step) of splitting y before index k: a two-sample t on the sides' means,
  the variance pooled over both sides (a side of two runs alone would understate it) and floored by the
  runs' own sampling variance; the critical value Student's at 99.9% two-sided."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  a, b = y[:k], y[k:]
  df = a.size + b.size - 2
  pooled = (float(np.sum((a - a.mean()) ** 2) + np.sum((b - b.mean()) ** 2)) / df) if df > 0 else 0.0
  se = math.sqrt(max(pooled, floor) * (1 / a.size + 1 / b.size))
  d = float(b.mean() - a.mean())
  crit = float(stats.t.ppf(1 - _ALPHA / 2, max(df, 1)))
  return (abs(d) / se / crit if se > 0 else math.inf if d else 0.0), d


def change_points(points: list[Point], tolerance: float = 0.05) -> list[int]:
  """Indices i where the series moved between run i-1 and run i (binary segmentation; module docstring)."""
  if len(points) < 3:
    return []
  y = np.log([p.busbw for p in points])
  floor = max(_sampling_var(points), 1e-8)
  found: list[int] = []

  def split(lo: int, hi: int) -> None:
    seg = y[lo:hi]
    if seg.size < 3:
      return
    best, best_cost = None, float(np.sum((seg - seg.mean()) ** 2))
    for k in range(2, seg.size):  # the left side has >= 2 runs; the right side may be the last run alone
      if k < seg.size - 1 or hi == len(y):
        cost = float(np.sum((seg[:k] - seg[:k].mean()) ** 2) + np.sum((seg[k:] - seg[k:].mean()) ** 2))
        if cost < best_cost:
          best, best_cost = k, cost
    if best is None:
      return
    t, d = _step(seg, best, floor)
    if t > 1 and abs(math.expm1(d)) > tolerance:
      found.append(lo + best)
      split(lo, lo + best)
      split(lo + best, hi)

  split(0, len(y))
  return sorted(found)
