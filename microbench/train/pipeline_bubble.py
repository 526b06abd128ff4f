"""The pipeline bubble, measured: the step timed with its schedule and with the same work minus the bubble.

Why this method: the bubble is time a stage waits, which no per-op counter shows, and a profile's
per-device busy time needs a trace parser per platform. Instead the same executor runs a second table
(`pipeline_schedule.no_bubble`) in which every device does one forward and one backward on every tick,
with the same transfers and the same number of operations, so the only difference between the two
programs is the idle ticks. The measured bubble is `1 - t(no bubble) / t(schedule)`: the share of the
step the bubble costs, including what the idle ticks cost in transfers and loop overhead.

On virtual CPU devices sharing a few cores, an idle device frees its core for the busy ones, so the
measured figure falls below the theory; on GPUs (one device per chip) it is the real cost.
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


def measure_bubble(run_with: Callable[[ps.Schedule], Callable[[], None]], sched: ps.Schedule,
                   rounds: int = 5) -> BubbleFigure:
  """`run_with(table)` compiles the step for that table and returns a call that runs it once and waits.

  Both programs are compiled and run once before timing; then they alternate for `rounds` rounds and
  the medians are compared (alternating arms: drifts of a shared machine hit both alike).
  """
  real, ideal = run_with(sched), run_with(ps.no_bubble(sched))
  real(), ideal()  # warm-up: first-run allocation and caches, never timed
  t_real, t_ideal = [], []
  for _ in range(rounds):
    for fn, out in ((real, t_real), (ideal, t_ideal)):
      t = time.perf_counter()
      fn()
      out.append(time.perf_counter() - t)
  real_s, ideal_s = statistics.median(t_real), statistics.median(t_ideal)
  return BubbleFigure(sched.kind, sched.stages, sched.microbatches, sched.virtual, 1.0 - ideal_s / real_s,
                      ps.theory_bubble(sched.kind, sched.stages, sched.microbatches, sched.virtual),
                      sched.bubble(backward_cost=3.0), real_s, ideal_s, rounds)
