"""The study's statistics (docs/study.md, section 4): the median's 95% confidence interval (Le Boudec), the
congestion impact sigma = geomean(baseline) / median(concurrent) with its interval, the share of samples
slower than 5%, and the communication share. Ratios are never averaged: sigma is a ratio of two location
statistics of throughput samples, and its interval is formed from theirs.

Beside the study's interval (kept for comparison with the paper), `sigma` gives a percentile bootstrap interval
of the same statistic, geomean(baseline) / median(concurrent), both samples resampled independently (2000
resamples, seeded): the study's interval pairs the baseline median's interval with a point estimate built on
the baseline geomean, so a skewed baseline can put sigma outside its own interval (17 samples of 1.0 and 3
of 100 against a concurrent median of 1: sigma 1.995, study interval [1.0, 1.0]; bootstrap about [1.0, 4.0]).
`per_experiment` gives sigma per experiment (the artifact's unit: one mix's samples against the key's
baseline) beside the pooled per-key sigma.

The interval uses the study's indices on sorted 0-based samples, lower floor((n - 1.96 sqrt n) / 2), upper
ceil(1 + (n + 1.96 sqrt n) / 2), clamped; with n <= 5 it collapses to the median (no distribution-free
95% interval exists that small). Le Boudec writes the same expressions for 1-based order statistics, so the
study's interval sits one order statistic above his; it is kept so results compare with the paper's.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Sequence

SLOWDOWN_THRESHOLD = 1.05


def median_ci(samples: Sequence[float]) -> tuple[float, float]:
  """(low, high) 95% confidence interval of the median."""
  xs = sorted(samples)
  n = len(xs)
  if n == 0:
    raise ValueError("no samples")
  if n <= 5:
    m = statistics.median(xs)
    return m, m
  lo = math.floor((n - 1.96 * math.sqrt(n)) / 2)
  hi = math.ceil(1 + (n + 1.96 * math.sqrt(n)) / 2)
  return xs[max(0, min(n - 1, lo))], xs[max(0, min(n - 1, hi))]


def geomean(samples: Sequence[float]) -> float:
  if not samples or min(samples) <= 0:
    raise ValueError("geomean needs positive samples")
  return math.exp(sum(math.log(x) for x in samples) / len(samples))


@dataclasses.dataclass(frozen=True)
class Sigma:
  """Congestion impact of one key: > 1 means slower when sharing the machine."""
  sigma: float
  low: float
  high: float
  baseline_geomean: float
  baseline_median: float
  baseline_ci: tuple[float, float]
  concurrent_median: float
  concurrent_ci: tuple[float, float]
  n_baseline: int
  n_concurrent: int
  share_slower: float  # fraction of concurrent samples with geomean(baseline)/sample > 1.05
  boot_low: float = float("nan")  # percentile bootstrap interval of sigma itself (see the module's doc)
  boot_high: float = float("nan")

  @property
  def has_interval(self) -> bool:
    """Both medians have a real interval (more than 5 samples each); else it collapsed to the medians."""
    return self.n_baseline > 5 and self.n_concurrent > 5

  @property
  def excludes_one(self) -> bool:
    return self.has_interval and (self.low > 1.0 or self.high < 1.0)


def sigma(baseline: Sequence[float], concurrent: Sequence[float], threshold: float = SLOWDOWN_THRESHOLD) -> Sigma:
  """sigma = geomean(baseline) / median(concurrent), CI [base_lo / conc_hi, base_hi / conc_lo]; samples are
  throughputs (higher is faster)."""
  if not baseline or not concurrent:
    raise ValueError("sigma needs baseline and concurrent samples")
  g = geomean(baseline)
  b_lo, b_hi = median_ci(baseline)
  c_lo, c_hi = median_ci(concurrent)
  c_med = statistics.median(concurrent)
  slower = sum(1 for x in concurrent if g / x > threshold) / len(concurrent)
  lo, hi = bootstrap_ci(baseline, concurrent)
  return Sigma(g / c_med, b_lo / c_hi, b_hi / c_lo, g, statistics.median(baseline), (b_lo, b_hi), c_med,
               (c_lo, c_hi), len(baseline), len(concurrent), slower, lo, hi)


def bootstrap_ci(baseline: Sequence[float], concurrent: Sequence[float], resamples: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
  """Percentile bootstrap interval of geomean(baseline) / median(concurrent): each resample draws both samples
  with replacement; the interval is the (1 - level) / 2 and (1 + level) / 2 quantiles of the resampled
  ratios. Seeded, so a report reads the same twice."""
  rng = random.Random(seed)
  logs = [math.log(x) for x in baseline]
  nb, nc = len(logs), len(concurrent)
  ratios = sorted(math.exp(sum(rng.choices(logs, k=nb)) / nb) / statistics.median(rng.choices(concurrent, k=nc))
                  for _ in range(resamples))
  a = (1 - level) / 2
  return ratios[int(math.floor(a * (resamples - 1)))], ratios[int(math.ceil((1 - a) * (resamples - 1)))]


def per_experiment(baseline: Sequence[float], concurrent: dict[str, Sequence[float]]) -> dict[str, Sigma]:
  """sigma per experiment: each mix's concurrent samples against the key's baseline (the artifact's unit)."""
  return {e: sigma(baseline, xs) for e, xs in concurrent.items() if xs}


def slowdowns_percent(baseline_geomean: float, concurrent: Sequence[float]) -> list[float]:
  """Each concurrent sample's (geomean(baseline) / sample - 1) x 100: the violins' points."""
  return [(baseline_geomean / x - 1.0) * 100.0 for x in concurrent]


def comm_share(per_iteration_max_shares: Sequence[float]) -> float:
  """Communication share: per iteration the largest exposed/runtime over ranks, then the mean."""
  return statistics.fmean(per_iteration_max_shares) if per_iteration_max_shares else float("nan")
