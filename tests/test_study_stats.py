"""The study's statistics against hand-computed cases: the median's 95% interval (Le Boudec, with the study's
0-based indices), sigma = geomean(baseline) / median(concurrent) with its interval, the >5% share, and the
communication share. Broken variants (1-based indices, averaged ratios) are shown to fail the same checks."""

from __future__ import annotations

import math
import statistics

import pytest

from microbench.study import stats

# n, lower index floor((n - 1.96 sqrt n) / 2), upper index ceil(1 + (n + 1.96 sqrt n) / 2), by hand:
# n=6: floor(0.600)=0, ceil(6.400)=7 -> clamped to 5; n=10: floor(1.901)=1, ceil(9.099)=10 -> 9;
# n=20: floor(5.617)=5, ceil(15.383)=16; n=100: floor(40.2)=40, ceil(60.8)=61.
HAND = {6: (0, 5), 10: (1, 9), 20: (5, 16), 100: (40, 61)}


@pytest.mark.parametrize("n", sorted(HAND))
def test_median_ci_indices_by_hand(n):
  xs = [float(10 * i + 3) for i in range(n)]  # distinct and sorted, so value = index
  lo, hi = stats.median_ci(list(reversed(xs)))  # order of the input does not matter
  assert (xs.index(lo), xs.index(hi)) == HAND[n]


def test_small_samples_collapse_to_the_median():
  assert stats.median_ci([5.0, 1.0, 3.0]) == (3.0, 3.0)
  assert stats.median_ci([1.0, 2.0, 3.0, 4.0]) == (2.5, 2.5)
  assert stats.median_ci([7.0]) == (7.0, 7.0)
  with pytest.raises(ValueError):
    stats.median_ci([])


def _one_based(samples):
  """Le Boudec's expressions read as 1-based order statistics: a plausible bug the tests must catch."""
  xs = sorted(samples)
  n = len(xs)
  lo = math.floor(0.5 * n - 0.98 * math.sqrt(n)) - 1
  hi = math.ceil(0.5 * n + 1 + 0.98 * math.sqrt(n)) - 1
  return xs[max(0, lo)], xs[min(n - 1, hi)]


def test_a_one_based_interval_fails_the_hand_cases():
  xs = [float(10 * i + 3) for i in range(20)]
  assert _one_based(xs) != stats.median_ci(xs)
  assert (xs.index(_one_based(xs)[0]), xs.index(_one_based(xs)[1])) != HAND[20]


def test_sigma_by_hand():
  base = [8.0, 9.0, 10.0, 11.0, 12.0, 13.0]  # n=6: CI [8, 13]
  conc = [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]  # median 6.5, CI [4, 9]
  s = stats.sigma(base, conc)
  g = math.exp(sum(math.log(x) for x in base) / 6)
  assert s.baseline_geomean == pytest.approx(g)
  assert s.sigma == pytest.approx(g / 6.5)
  assert (s.low, s.high) == (pytest.approx(8 / 9), pytest.approx(13 / 4))
  assert s.baseline_ci == (8.0, 13.0) and s.concurrent_ci == (4.0, 9.0)
  # slower than 5%: g / x > 1.05 <=> x < g / 1.05 = 10.27: all six concurrent samples
  assert s.share_slower == 1.0
  assert not s.excludes_one
  assert stats.sigma([10.0] * 6, [10.2, 9.6, 9.0, 10.0, 9.4, 10.5]).share_slower == pytest.approx(2 / 6)


def test_sigma_is_a_ratio_of_statistics_not_an_average_of_ratios():
  base = [10.0] * 8
  conc = [1.0, 9.0, 9.5, 10.0, 10.0, 10.0, 10.0, 10.0]  # one very slow sample
  s = stats.sigma(base, conc)
  assert s.sigma == pytest.approx(10.0 / 10.0)  # the median is robust to the outlier
  mean_of_ratios = statistics.fmean(10.0 / x for x in conc)
  assert mean_of_ratios > 2.0 and s.sigma != pytest.approx(mean_of_ratios)


def test_no_interval_from_five_samples_or_fewer():
  s = stats.sigma([10.0] * 5, [5.0] * 9)
  assert (s.low, s.high) == (2.0, 2.0) and not s.has_interval and not s.excludes_one


def test_sigma_interval_excludes_one_when_clearly_slower():
  base = [100.0 + i for i in range(30)]
  conc = [50.0 + i for i in range(30)]
  s = stats.sigma(base, conc)
  assert s.sigma > 1.1 and s.low > 1.0 and s.excludes_one


def test_slowdowns_and_comm_share():
  assert stats.slowdowns_percent(10.0, [10.0, 5.0, 20.0]) == [0.0, 100.0, -50.0]
  assert stats.comm_share([0.2, 0.4]) == pytest.approx(0.3)
  assert math.isnan(stats.comm_share([]))
  with pytest.raises(ValueError):
    stats.geomean([1.0, 0.0])


def test_bootstrap_interval_holds_sigma_where_the_studys_does_not():
  """The artifact's case: 17 baseline samples of 1.0 and 3 of 100 against a concurrent median of 1: sigma is the
  baseline geomean, 100^(3/20) = 1.995; the study's interval pairs the baseline median's CI ([1, 1]) with it and
  misses it; the bootstrap of the same statistic holds it."""
  base, conc = [1.0] * 17 + [100.0] * 3, [1.0] * 20
  s = stats.sigma(base, conc)
  assert s.sigma == pytest.approx(1.995, abs=1e-3)
  assert (s.low, s.high) == (1.0, 1.0)  # the artifact's figure, kept
  assert s.boot_low <= s.sigma <= s.boot_high and s.boot_high > 3
  assert stats.bootstrap_ci(base, conc) == (s.boot_low, s.boot_high)  # seeded
  # a symmetric case: the bootstrap interval holds sigma and lies inside the study's, which pairs the two
  # medians' intervals at their extremes (1.91-2.09 inside 1.81-2.21 here)
  even = stats.sigma([10.0 + 0.1 * i for i in range(20)], [5.0 + 0.05 * i for i in range(20)])
  assert even.low < even.boot_low < even.sigma < even.boot_high < even.high


def test_sigma_per_experiment():
  base = [10.0] * 8
  per = stats.per_experiment(base, {"e000": [5.0] * 8, "e001": [10.0] * 8, "e002": []})
  assert set(per) == {"e000", "e001"}
  assert per["e000"].sigma == pytest.approx(2.0) and per["e001"].sigma == pytest.approx(1.0)


def test_baselines_time_their_warmup_iteration():
  """The artifact's baselines run 0 warm-up + (1 + R) iterations; concurrent jobs 1 + R with the first untimed."""
  from microbench.study import generator as gen
  from microbench.study import machines, run_plan
  job = gen.job_entry("j0", "dp", 2, "intra-l1", [0, 1])
  m, s = machines.parse("testbed"), run_plan.RunSettings("p", "o")
  base = run_plan.proxy_command(job, m, s, "raw", "t", baseline=True)
  conc = run_plan.proxy_command(job, m, s, "raw", "t")
  assert "--iters=7" in base and "--warmup=0" in base  # DP: R = 6
  assert "--iters=6" in conc and "--warmup=1" in conc
  given = run_plan.proxy_command(job, m, run_plan.RunSettings("p", "o", iters=8, warmup=2), "raw", "t", baseline=True)
  assert "--iters=8" in given and "--warmup=2" in given
  assert run_plan.RunSettings("p", "o").walltime == 200.0
