"""A latency-bandwidth (alpha-beta) model per series of a sweep: t(S) = alpha + S / beta.

One fit per collective, scope, dtype and group size, over the points that ran and were right. The fit
passes through the largest measured point and minimises the relative error over the others, so
microsecond latencies at small sizes count as much as milliseconds at large ones (an ordinary least-squares
fit on absolute times is decided by the largest sizes alone and returns an alpha that can be off by its
whole value), and the few large sizes are not outvoted by the many small ones (a least-squares fit on
relative error missed the largest point by 26-58% on CPU runs).

A series that reaches down into latency-bound sizes (at least two sizes whose bandwidth term is under half
their time) is fitted in two regimes: the latency is the median excess of those sizes over the bandwidth term,
the bandwidth the line from that latency through the largest point. One line fitted across both regimes
lets the curvature of the middle sizes (a transport's per-message costs, a token bucket's burst) decide the
latency, which then misses the small sizes by their whole value; each regime is judged on its own points.

Besides the algorithmic beta (S / t at large S), each fit carries the collective's algorithmic form for
later extrapolation to other group sizes: its busbw factor f(n) (so beta * f(n) is the asymptotic busbw,
comparable with link peaks) and the latency steps of a ring, so alpha / steps is a per-hop latency.
Written to model.json in the run folder; this module does no plotting.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from microbench.fabric import conventions
from microbench.report import tables

MODEL = "model.json"
# A fit is flagged poor below this R^2 or above this worst relative residual: with relative weighting a
# good sweep fits within a few percent everywhere (the synthetic 1%-noise runs: R^2 > 0.99, worst < 5%), and
# a 25% miss at one size means the two-parameter form does not describe that series (a protocol switch,
# an algorithm change between sizes), so its predictions should not be trusted.
POOR_R2 = 0.9
POOR_MAX_REL_ERR = 0.25
# Latency-bound points are judged more loosely: their times are a few hundred microseconds or less, where one
# descheduled sample or a timer wake-up moves the median by tens of percent, and the latency is their median
# (robust to one such point); 50% still flags a latency that is not one number (a protocol switch).
POOR_LATENCY_REL_ERR = 0.5
LATENCY_BOUND = 0.5  # a size is latency-bound when its bandwidth term is under this share of its time
FORM = "t_us(S) = alpha_us + S / (beta_gbps * 1e3)"  # S in bytes; 1 GB/s = 1e3 bytes per microsecond


def ring_steps(collective: str, n: int) -> int | None:
  """Latency steps of NCCL's algorithm for the collective (fabric.conventions), None for one it does not know."""
  try:
    return conventions.total_steps(collective, n)
  except ValueError:
    return None


@dataclasses.dataclass(frozen=True)
class Fit:
  collective: str
  scope: str
  dtype: str
  group_size: int
  points: int
  min_bytes: int
  max_bytes: int
  alpha_us: float | None
  beta_gbps: float | None  # None: no bandwidth term could be fitted (times do not grow with size)
  method: str
  r2: float | None = None  # on times, over the points used
  rel_rms: float | None = None  # root-mean-square relative error of the fitted times
  max_rel_err: float | None = None
  busbw_factor: float | None = None
  busbw_beta_gbps: float | None = None
  ring_steps: int | None = None
  alpha_per_step_us: float | None = None
  latency_points: int = 0  # latency-bound sizes the latency came from (0: one regime, no such sizes)
  latency_max_rel_err: float | None = None  # over the latency-bound points (two-regime fits)
  bandwidth_max_rel_err: float | None = None  # over the other points

  def bandwidth_poor(self) -> str | None:
    """Why the bandwidth (the points the latency does not dominate) should not be trusted, or None."""
    if self.alpha_us is None:
      return "no fit"
    err = self.max_rel_err if self.bandwidth_max_rel_err is None else self.bandwidth_max_rel_err
    if err is not None and err > POOR_MAX_REL_ERR:
      regime = " (bandwidth-bound)" if self.latency_points else ""
      return f"worst point off by {100 * err:.0f}% > {100 * POOR_MAX_REL_ERR:.0f}%{regime}"
    return None

  def latency_poor(self) -> str | None:
    """Why the latency regime should not be trusted, or None (also for one-regime fits)."""
    err = self.latency_max_rel_err
    if self.latency_points and err is not None and err > POOR_LATENCY_REL_ERR:
      return f"worst latency-bound point off by {100 * err:.0f}% > {100 * POOR_LATENCY_REL_ERR:.0f}%"
    return None

  def poor(self) -> str | None:
    """Why the fit should not be trusted (one phrase), or None for a good fit."""
    if self.alpha_us is None:
      return "no fit"
    why = []
    if self.r2 is not None and self.r2 < POOR_R2:
      why.append(f"R^2 {self.r2:.3g} < {POOR_R2:g}")
    why += [w for w in (self.bandwidth_poor(), self.latency_poor()) if w]
    return ", ".join(why) or None

  def extrapolation(self, size_bytes: float) -> str:
    """How far a prediction reaches past the measured sizes, so a reader weighs it accordingly."""
    if size_bytes > self.max_bytes:
      return f"{size_bytes / self.max_bytes:.3g}x past the largest measured size ({tables.size_text(self.max_bytes)})"
    if size_bytes < self.min_bytes:
      return f"{self.min_bytes / size_bytes:.3g}x below the smallest measured size ({tables.size_text(self.min_bytes)})"
    return "within the measured sizes"

  def predict_us(self, size_bytes: float) -> float | None:
    if self.alpha_us is None:
      return None
    bw = 0.0 if self.beta_gbps is None else size_bytes / (self.beta_gbps * 1e3)
    return self.alpha_us + bw


def fit_points(sizes: Iterable[float], times_us: Iterable[float]) -> tuple[float, float | None, str]:
  """(alpha_us, beta_gbps, method): through the largest measured point, alpha >= 0 and beta > 0.

  With latency-bound sizes (see `LATENCY_BOUND`), two regimes: alpha is their median excess over the bandwidth
  term, beta the line from alpha through the largest point. Without them, one line through the largest point
  whose slope minimises the squared relative errors of all points: a least-squares fit (even on relative
  error) lets the many latency-bound small sizes outvote the few bandwidth-bound large ones and missed the
  largest point - the one an extrapolation leans on - by 26-58% on CPU runs. A series the two-term form does
  not describe keeps a large worst error somewhere, which `Fit.poor` flags."""
  s, t, s_max, t_max = _arrays(sizes, times_us)
  two = _two_regimes(s, t, s_max, t_max)
  if two is not None:
    alpha, b, lat = two
    return alpha, 1.0 / (b * 1e3), (f"two regimes: latency the median of {int(lat.sum())} latency-bound sizes,"
                                    " bandwidth through the largest point")

  # b (microseconds per byte) minimising the relative errors' squares with alpha = t_max - s_max b: closed form.
  u = t_max / t - 1.0
  v = (s - s_max) / t
  b = float(np.clip(-np.sum(u * v) / np.sum(v * v), 0.0, t_max / s_max)) if np.sum(v * v) > 0 else 0.0
  alpha = t_max - s_max * b
  if b <= 0:  # times do not grow with size: latency only
    y = 1.0 / t
    return float(2.0 / (y.max() + y.min())), None, "latency only (times do not grow with size)"
  method = ("through the largest point, least squares on relative error" if alpha > 0 else
            "bandwidth only, through the largest point (no latency visible)")
  return max(0.0, float(alpha)), 1.0 / (b * 1e3), method


def _arrays(sizes: Iterable[float], times_us: Iterable[float]) -> tuple[np.ndarray, np.ndarray, float, float]:
  s = np.asarray(list(sizes), np.float64)
  t = np.asarray(list(times_us), np.float64)
  if s.size < 2 or np.unique(s).size < 2:
    raise ValueError("an alpha-beta fit needs points at two or more sizes")
  s_max = float(s.max())
  return s, t, s_max, float(np.median(t[s == s_max]))  # several runs of the largest size: their median


def latency_bound(s: np.ndarray, t: np.ndarray, b: float) -> np.ndarray:
  """Which points are latency-bound at `b` us/byte: bandwidth term under LATENCY_BOUND of the time, and not
  the largest size (the bandwidth regime's anchor)."""
  return (s * b < LATENCY_BOUND * t) & (s < s.max())


def _two_regimes(s: np.ndarray, t: np.ndarray, s_max: float, t_max: float
                 ) -> tuple[float, float, np.ndarray] | None:
  """(alpha_us, b us/byte, latency-bound mask), or None with fewer than two latency-bound sizes below the
  largest or a largest size that is latency-bound itself. Fixed point: the bandwidth term decides which sizes
  are latency-bound, their median excess is alpha, and alpha moves the line through the largest point; it
  settles in a few rounds (alpha << t_max)."""
  alpha, mask = 0.0, None
  for _ in range(20):
    b = (t_max - alpha) / s_max
    new_mask = latency_bound(s, t, b)
    if np.unique(s[new_mask]).size < 2:
      return None
    new_alpha = max(0.0, float(np.median(t[new_mask] - s[new_mask] * b)))
    if new_alpha > (1.0 - LATENCY_BOUND) * t_max:  # even the largest size is latency-bound: no bandwidth regime
      return None
    if mask is not None and np.array_equal(mask, new_mask) and abs(new_alpha - alpha) <= 1e-9 * t_max:
      break
    alpha, mask = new_alpha, new_mask
  return alpha, (t_max - alpha) / s_max, mask


def _series(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str, int], list[dict[str, Any]]]:
  # A wrong result's time is not the collective's.
  return tables.by_series(r for r in tables.ok(records) if not (r.get("wrong") or 0) > 0 and r.get("time_us"))


def fit_series(key: tuple[str, str, str, int], recs: list[dict[str, Any]]) -> Fit:
  recs = sorted(recs, key=lambda r: r["bytes"])
  sizes = [float(r["bytes"]) for r in recs]
  times = [float(r["time_us"]) for r in recs]
  coll, scope, dtype, n = key
  base = dict(collective=coll, scope=scope, dtype=dtype, group_size=n, points=len(recs),
              min_bytes=int(sizes[0]), max_bytes=int(sizes[-1]))
  try:
    alpha, beta, method = fit_points(sizes, times)
  except ValueError as e:
    return Fit(**base, alpha_us=None, beta_gbps=None, method=f"no fit: {e}")
  t = np.asarray(times)
  pred = alpha + (0.0 if beta is None else np.asarray(sizes) / (beta * 1e3))
  rel = (pred - t) / t
  regimes: dict[str, Any] = {}
  if method.startswith("two regimes"):
    lat = latency_bound(np.asarray(sizes), t, 1.0 / (beta * 1e3))
    regimes = dict(latency_points=int(lat.sum()), latency_max_rel_err=float(np.max(np.abs(rel[lat]))),
                   bandwidth_max_rel_err=float(np.max(np.abs(rel[~lat]))))
  ss_tot = float(np.sum((t - t.mean()) ** 2))
  r2 = 1.0 - float(np.sum((pred - t) ** 2)) / ss_tot if ss_tot > 0 else None
  factor = _busbw_factor(recs)
  steps = ring_steps(coll, n)
  return Fit(**base, alpha_us=alpha, beta_gbps=beta, method=method, r2=r2,
             rel_rms=float(np.sqrt(np.mean(rel ** 2))), max_rel_err=float(np.max(np.abs(rel))),
             busbw_factor=factor,
             busbw_beta_gbps=None if (beta is None or factor is None) else beta * factor,
             ring_steps=steps, alpha_per_step_us=alpha / steps if steps else None, **regimes)


def _busbw_factor(recs: list[dict[str, Any]]) -> float | None:
  """busbw / algbw as the run recorded it (the collective's own factor for this group size)."""
  for r in recs:
    if r.get("algbw_gbps"):
      return float(r["busbw_gbps"]) / float(r["algbw_gbps"])
  return None


def fit_run(records: Iterable[dict[str, Any]]) -> list[Fit]:
  """One fit per series with at least one good point, in the order the series first appear."""
  return [fit_series(k, v) for k, v in _series(records).items()]


def to_json(fits: list[Fit]) -> dict[str, Any]:
  return {"form": FORM, "weights": "through the largest point; latency from the latency-bound sizes (two regimes)"
                  " or least squares on relative error (1/t^2)",
          "fits": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in dataclasses.asdict(f).items()} for f in fits]}


def write_model(outdir: str, fits: list[Fit]) -> str:
  path = os.path.join(outdir, MODEL)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(to_json(fits), f, indent=2)
  os.replace(tmp, path)
  return path


def read_model(outdir: str) -> list[Fit] | None:
  path = os.path.join(outdir, MODEL)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  names = {f.name for f in dataclasses.fields(Fit)}
  return [Fit(**{k: v for k, v in d.items() if k in names}) for d in data.get("fits", [])]
