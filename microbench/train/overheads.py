"""What a step's overheads cost, measured: the step timed as it is and with the overhead taken out.

The pipeline bubble: the same executor runs a second table (`pipeline_schedule.no_bubble`) in which every
device does one forward and one backward on every tick, with the same transfers and the same number of
operations, so the only difference between the two programs is the idle ticks; the measured bubble is
`1 - t(no bubble) / t(schedule)`, including what the idle ticks cost in transfers and loop overhead. The
all-to-all share of a mixture of experts: the same step with each token exchange replaced by a local copy
(`Execution(without="all_to_all")`: the same expert matmuls on the same buffer shapes), `1 - t(without) /
t(step)`. Why this method: a stage's wait and a collective's exposed time show in no per-op counter, and
a profile's per-device busy time needs a trace parser per platform; two programs that differ only in the
overhead, run alternately (drifts of a shared machine hit both alike), need neither.

On virtual CPU devices sharing a few cores, an idle device frees its core for the busy ones, so the
measured bubble falls below the theory; on GPUs (one device per chip) it is the real cost.

Why an interval: a share is a small difference of two noisy times. Each round runs both programs, so each
round gives one share (drifts hit both arms of a round alike); the figure is the median of those shares,
with the distribution-free 95% interval of a median (order statistics, exact binomial coverage). It is
`resolved` only when that interval lies above 0 and is no wider than the figure itself; otherwise the
report says "not resolved" (small CPU cases gave shares that fell with fewer microbatches, and below 0).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence

from microbench.models import pipeline_schedule as ps


MIN_ROUNDS = 12  # the fewest timed rounds: a 95% median interval then excludes 2 rounds at each end
CONFIDENCE = 0.95


def median_interval(samples: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
  """The distribution-free interval of the median: sorted samples x_(j) .. x_(n+1-j) for the largest j whose
  exact binomial coverage 1 - 2 P(Bin(n, 1/2) < j) is at least `confidence`. None below 6 samples (even the
  full range covers less than 95% there)."""
  xs, n = sorted(samples), len(samples)
  j, below = 0, 0.0  # below: P(Bin(n, 1/2) < j + 1), the tail mass left out at each end by x_(j+1)
  while True:
    below += math.comb(n, j) / 2**n
    if 1 - 2 * below < confidence:
      break
    j += 1
  return None if j == 0 else (xs[j - 1], xs[n - j])


@dataclasses.dataclass(frozen=True)
class Share:
  """A measured overhead share: the median of the per-round shares and its 95% interval."""
  value: float
  low: float | None  # None: too few rounds for an interval
  high: float | None
  rounds: int

  @property
  def resolved(self) -> bool:
    """The interval excludes 0 (so the share is above it) and is no wider than the share."""
    return self.low is not None and self.low > 0 and self.high - self.low <= self.value

  def text(self) -> str:
    """`0.213 (95% interval 0.190-0.240, 12 rounds)`, or `not resolved (median ..., ...)`."""
    if self.low is None:
      return f"not resolved (median {self.value:.3f}, {self.rounds} rounds: too few for an interval)"
    body = f"95% interval {self.low:.3f} to {self.high:.3f}, {self.rounds} rounds"
    return f"{self.value:.3f} ({body})" if self.resolved else f"not resolved (median {self.value:.3f}, {body})"


def paired_share(full_s: Sequence[float], without_s: Sequence[float]) -> Share:
  """The share of each round's full time its overhead took, 1 - t(without) / t(full), summarised as `Share`."""
  assert len(full_s) == len(without_s) and full_s
  shares = [share(f, w) for f, w in zip(full_s, without_s)]
  ci = median_interval(shares)
  return Share(statistics.median(shares), *(ci or (None, None)), len(shares))


@dataclasses.dataclass(frozen=True)
class BubbleFigure:
  schedule: str
  stages: int
  microbatches: int
  virtual: int
  measured: float  # median over rounds of 1 - t(no bubble) / t(schedule)
  measured_ci: tuple[float, float] | None  # its 95% interval
  resolved: bool  # the interval is above 0 and no wider than the figure
  theory: float  # textbook formula
  lockstep: float  # the table's own idle fraction, backward = 3 forwards (recompute + backward)
  step_time_s: float  # median with the schedule
  no_bubble_time_s: float  # median of the same work without idle ticks
  rounds: int

  def as_dict(self) -> dict[str, float | int | str]:
    return dataclasses.asdict(self)


def alternate(arms: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
  """Seconds of each arm (a call that runs once and waits) in each of `rounds` rounds, the arms run in turn
  in every round, after one untimed run each (first-run allocation and caches)."""
  for fn in arms.values():
    fn()
  times: dict[str, list[float]] = {name: [] for name in arms}
  for _ in range(rounds):
    for name, fn in arms.items():
      t = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t)
  return times


def share(full_s: float, without_s: float) -> float:
  """The share of the full time the removed overhead cost: 1 - t(without) / t(full)."""
  return 1.0 - without_s / full_s


def measure_bubble(run_with: Callable[[ps.Schedule], Callable[[], None]], sched: ps.Schedule,
                   rounds: int = MIN_ROUNDS) -> BubbleFigure:
  """`run_with(table)` compiles the step for that table and returns a call that runs it once and waits.

  Both programs are compiled and run once before timing; then they alternate for `rounds` rounds (drifts
  of a shared machine hit both arms of a round alike) and the per-round shares give `paired_share`.
  """
  times = alternate({"real": run_with(sched), "ideal": run_with(ps.no_bubble(sched))}, rounds)
  fig = paired_share(times["real"], times["ideal"])
  return BubbleFigure(sched.kind, sched.stages, sched.microbatches, sched.virtual, fig.value,
                      None if fig.low is None else (fig.low, fig.high), fig.resolved,
                      ps.theory_bubble(sched.kind, sched.stages, sched.microbatches, sched.virtual),
                      sched.bubble(backward_cost=3.0), statistics.median(times["real"]),
                      statistics.median(times["ideal"]), rounds)
