"""GPCNeT's congestion impact factor: the canary's per-iteration time beside congestors over its time alone,
for the mean and for the 99th percentile, each with a bootstrap interval.

The two runs are independent samples, so each resample draws the isolated and the congested iterations
separately (with replacement) and takes the ratio; the interval is the resamples' central 95%. A factor
is *resolved* when its interval excludes 1. Below 5 iterations on either side there is no interval (the
study's 5-sample floor). With fewer than 100 iterations a 99th percentile is interpolated between the
largest ones, so it says how long the tail is, not a stable quantile: the note says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_SAMPLES = 5
TAIL = 99.0


def percentile(xs: Sequence[float], q: float) -> float:
  """The q-th percentile, linear between order statistics (numpy's default, as GPCNeT's sorted index)."""
  return float(np.percentile(np.asarray(xs, float), q))


def _mean(x: np.ndarray, axis: int | None = None):
  return np.mean(x, axis=axis)


def _p99(x: np.ndarray, axis: int | None = None):
  return np.percentile(x, TAIL, axis=axis)


STATS = {"mean": _mean, "p99": _p99}  # statistic of the per-iteration times -> one factor each


def _factor(isolated: np.ndarray, congested: np.ndarray, stat, resamples: int, rng: np.random.Generator,
            level: float) -> dict:
  iso, con = float(stat(isolated)), float(stat(congested))
  out = {"isolated_s": iso, "congested_s": con, "cif": con / iso, "low": None, "high": None, "resolved": False}
  if len(isolated) < MIN_SAMPLES or len(congested) < MIN_SAMPLES:
    return out
  a = rng.choice(isolated, (resamples, len(isolated)))
  b = rng.choice(congested, (resamples, len(congested)))
  ratios = stat(b, axis=1) / stat(a, axis=1)
  tail = (1 - level) / 2 * 100
  low, high = np.percentile(ratios, [tail, 100 - tail])
  out.update(low=float(low), high=float(high), resolved=bool(low > 1 or high < 1))
  return out


def impact(isolated: Sequence[float], congested: Sequence[float], resamples: int = 2000, seed: int = 0,
           level: float = 0.95) -> dict:
  """{"mean": ..., "p99": ..., "samples": ..., "notes": [...]}: each factor congested / isolated with its
  interval and whether it is resolved. Raises ValueError on an empty or non-positive side."""
  iso, con = np.asarray(isolated, float), np.asarray(congested, float)
  if not len(iso) or not len(con):
    raise ValueError("the impact factor needs iterations from both runs (isolated and congested)")
  if (iso <= 0).any() or (con <= 0).any():
    raise ValueError("iteration times must be positive")
  rng = np.random.default_rng(seed)
  out = {"mean": _factor(iso, con, STATS["mean"], resamples, rng, level),
         "p99": _factor(iso, con, STATS["p99"], resamples, rng, level),
         "samples": {"isolated": len(iso), "congested": len(con)}, "level": level, "resamples": resamples,
         "notes": []}
  for name in ("mean", "p99"):
    f = out[name]
    if f["low"] is None:
      out["notes"].append(f"{name}: fewer than {MIN_SAMPLES} iterations on a side, no interval")
    elif not f["resolved"]:
      out["notes"].append(f"{name}: unresolved, the {level:.0%} interval [{f['low']:.3f}, {f['high']:.3f}] "
                          "includes 1")
  n = min(len(iso), len(con))
  if n < 100:
    out["notes"].append(f"p99 of {n} iterations lies between the largest ones: it measures the tail's length, "
                        "not a stable quantile")
  return out
