"""Measured overhead shares (the pipeline bubble, the all-to-all share) come with a 95% interval and say when
they are not resolved: the median interval's coverage, clean and noisy synthetic rounds, what the summary
and TensorBoard show, and a pipelined training run's record."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from microbench.output.train_log import TrainLog  # noqa: E402
from microbench.train import overheads  # noqa: E402


def test_median_interval_is_order_statistics_with_95_percent_coverage():
  assert overheads.median_interval(range(5)) is None  # even the whole range covers only 94%
  assert overheads.median_interval([5, 1, 4, 2, 6, 3]) == (1, 6)
  assert overheads.median_interval(range(1, 13)) == (3, 10)
  assert overheads.median_interval(range(1, 21)) == (6, 15)
  # Its coverage, drawn: the true median (log-normal: 1.0) falls inside in about 96% of 12-round draws.
  rng = np.random.default_rng(0)
  hits = 0
  for _ in range(4000):
    low, high = overheads.median_interval(rng.lognormal(0.0, 0.5, 12))
    hits += low <= 1.0 <= high
  assert 0.95 <= hits / 4000 <= 0.975  # exact: 1 - 2 P(Bin(12, 1/2) <= 2) = 0.961


def _rounds(share: float, noise: float, n: int = overheads.MIN_ROUNDS, seed: int = 0):
  """Per-round (full, without) seconds: the overhead is `share` of a 100 ms step, each time jittered by
  `noise` (relative, independent per arm and round)."""
  rng = np.random.default_rng(seed)
  full = 0.1 * (1 + noise * rng.standard_normal(n))
  without = 0.1 * (1 - share) * (1 + noise * rng.standard_normal(n))
  return list(full), list(without)


def test_clean_rounds_are_resolved():
  fig = overheads.paired_share(*_rounds(0.2, 0.005))
  assert fig.resolved and fig.value == pytest.approx(0.2, abs=0.01) and 0 < fig.low <= fig.value <= fig.high
  assert fig.text().startswith(f"{fig.value:.3f} (95% interval {fig.low:.3f} to {fig.high:.3f}, 12 rounds)")


@pytest.mark.parametrize("share,noise,n,why", [
    (0.05, 0.2, overheads.MIN_ROUNDS, "the interval includes 0"),
    (-0.15, 0.005, overheads.MIN_ROUNDS, "below 0 (the overhead made the step faster: not a bubble)"),
    (0.2, 0.005, 5, "too few rounds for an interval"),
])
def test_noisy_or_negative_rounds_are_not_resolved(share, noise, n, why):
  fig = overheads.paired_share(*_rounds(share, noise, n))
  assert not fig.resolved, why
  assert fig.text().startswith(f"not resolved (median {fig.value:.3f}, ")


def test_an_interval_wider_than_the_figure_is_not_resolved():
  # Above 0 but known only to a factor of several: 0.02 .. 0.2 around 0.1.
  fig = overheads.Share(0.1, 0.02, 0.2, 12)
  assert fig.low > 0 and not fig.resolved
  assert overheads.Share(0.1, 0.06, 0.14, 12).resolved


def test_tensorboard_leaves_an_unresolved_share_out_and_keeps_its_interval(monkeypatch):
  seen = {}
  log = TrainLog(None)
  monkeypatch.setattr(log, "scalars", lambda values, step: seen.update(values))
  log.summary({"bubble_measured": -0.04, "bubble_measured_ci": [-0.2, 0.1], "bubble_resolved": False,
               "all_to_all_share": 0.3, "all_to_all_share_ci": [0.25, 0.33], "all_to_all_resolved": True})
  assert "summary/bubble_measured" not in seen and seen["summary/bubble_resolved"] == 0.0
  assert (seen["summary/bubble_measured_ci_low"], seen["summary/bubble_measured_ci_high"]) == (-0.2, 0.1)
  assert seen["summary/all_to_all_share"] == 0.3 and seen["summary/all_to_all_resolved"] == 1.0
  assert seen["summary/all_to_all_share_ci_high"] == 0.33


@pytest.mark.slow
def test_pipelined_run_reports_the_bubble_with_its_interval():
  from microbench import train  # pylint: disable=g-import-not-at-top
  cfg = train.TrainConfig(model="llama3", size="tiny", parallelism="pp:2", batch=4, seq_len=16, microbatches=2,
                          steps=2, warmup_steps=1, write=False, verbose=False,
                          compiler_options={"xla_backend_optimization_level": 0})
  s = train.run(cfg, train.plan(cfg, jax.devices()[:2])).summary
  assert s["overhead_rounds"] == overheads.MIN_ROUNDS
  low, high = s["bubble_measured_ci"]
  assert low <= s["bubble_measured"] <= high and isinstance(s["bubble_resolved"], bool)
  assert s["bubble_resolved"] == (low > 0 and high - low <= s["bubble_measured"])
  line = next(ln for ln in train.format_table(s).splitlines() if ln.strip().startswith("pipeline"))
  want = "measured not resolved (median" if not s["bubble_resolved"] else f"measured {s['bubble_measured']:.3f} (95%"
  assert want in line and "95% interval" in line, line
