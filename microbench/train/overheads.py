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
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

from models import pipeline_schedule as ps


@dataclasses.dataclass(frozen=True)
class BubbleFigure:
  schedule: str
  stages: int
  microbatches: int
  virtual: int
  measured: float  # 1 - t(no bubble) / t(schedule)
  theory: float  # textbook formula
  lockstep: float  # the table's own idle fraction, backward = 3 forwards (recompute + backward)
  step_time_s: float  # median with the schedule
  no_bubble_time_s: float  # median of the same work without idle ticks
  rounds: int

  def as_dict(self) -> dict[str, float | int | str]:
    return dataclasses.asdict(self)


def alternate(arms: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
  """Median seconds of each arm (a call that runs once and waits), the arms run in turn `rounds` times
  after one untimed run each (first-run allocation and caches)."""
  for fn in arms.values():
    fn()
  times: dict[str, list[float]] = {name: [] for name in arms}
  for _ in range(rounds):
    for name, fn in arms.items():
      t = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t)
  return {name: statistics.median(ts) for name, ts in times.items()}


def share(full_s: float, without_s: float) -> float:
  """The share of the full time the removed overhead cost: 1 - t(without) / t(full)."""
  return 1.0 - without_s / full_s


def measure_bubble(run_with: Callable[[ps.Schedule], Callable[[], None]], sched: ps.Schedule,
                   rounds: int = 5) -> BubbleFigure:
  """`run_with(table)` compiles the step for that table and returns a call that runs it once and waits.

  Both programs are compiled and run once before timing; then they alternate for `rounds` rounds and
  the medians are compared (alternating arms: drifts of a shared machine hit both alike).
  """
  medians = alternate({"real": run_with(sched), "ideal": run_with(ps.no_bubble(sched))}, rounds)
  real_s, ideal_s = medians["real"], medians["ideal"]
  return BubbleFigure(sched.kind, sched.stages, sched.microbatches, sched.virtual, share(real_s, ideal_s),
                      ps.theory_bubble(sched.kind, sched.stages, sched.microbatches, sched.virtual),
                      sched.bubble(backward_cost=3.0), real_s, ideal_s, rounds)
