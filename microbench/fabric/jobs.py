"""Jobs of compute and communication phases running side by side on shared links: iteration times and sigma.

A job's iteration is a sequence of phases, each either compute (a fixed time: it shares nothing) or a set
of flows that all start together and end the phase when the last one finishes. Every job repeats its
iteration; flows of all jobs share links max-min fairly while they overlap in time (`flows.max_min_rates`),
rates recomputed at every event. The model's assumptions, said wherever a prediction is shown: jobs start
together; compute does not slow down beside other jobs; no latency, protocol or congestion-control cost
beyond fair sharing; a job's ranks move in step (a phase is its slowest flow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from microbench.fabric import flows as fl

ASSUMPTIONS = ("jobs start together and repeat their iterations back to back",
               "concurrent flows share each link max-min fairly; no latency or congestion-control loss",
               "compute is unaffected by other jobs; a communication phase ends with its slowest flow")


@dataclasses.dataclass(frozen=True)
class Phase:
  compute_s: float = 0.0
  flows: tuple[tuple[tuple[str, ...], float], ...] = ()  # (links crossed, bytes) per flow

  def __post_init__(self):
    if self.compute_s and self.flows:
      raise ValueError("a phase is compute or communication, not both")


@dataclasses.dataclass(frozen=True)
class Job:
  name: str
  phases: tuple[Phase, ...]


@dataclasses.dataclass
class _State:
  job: Job
  phase: int = 0
  phase_end: float | None = None  # compute phases
  left: dict[str, float] = dataclasses.field(default_factory=dict)  # flow id -> bytes left
  paths: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  iteration_start: float = 0.0
  times: list[float] = dataclasses.field(default_factory=list)


def run(jobs: Sequence[Job], capacity: Mapping[str, float], iterations: int = 6) -> dict[str, list[float]]:
  """Seconds per iteration of each job, `iterations` of each, all jobs running at once from time 0."""
  states = [_State(j) for j in jobs]
  now = 0.0

  def enter(st: _State) -> None:
    """Starts phases until one takes time (a phase with nothing to do passes at once)."""
    while len(st.times) < iterations:
      if st.phase == len(st.job.phases):
        st.times.append(now - st.iteration_start)
        st.iteration_start, st.phase = now, 0
        continue
      ph = st.job.phases[st.phase]
      if ph.compute_s > 0:
        st.phase_end = now + ph.compute_s
        return
      live = [(links, b) for links, b in ph.flows if b > 0]
      if live:
        for i, (links, b) in enumerate(live):
          fid = f"{st.job.name}/{st.phase}/{i}"
          st.left[fid], st.paths[fid] = float(b), tuple(links)
        return
      st.phase += 1

  for st in states:
    enter(st)
  while any(len(st.times) < iterations for st in states):
    paths = {f: p for st in states for f, p in st.paths.items()}
    rates = fl.max_min_rates(paths, capacity) if paths else {}
    step = min([st.phase_end - now for st in states if st.phase_end is not None]
               + [st.left[f] / rates[f] for st in states for f in st.left])
    now += max(step, 0.0)
    for st in states:
      for f in list(st.left):
        st.left[f] -= rates[f] * step
        if st.left[f] <= fl.EPS * max(1.0, rates[f]):
          del st.left[f], st.paths[f]
      finished = (st.phase_end is not None and st.phase_end <= now + fl.EPS) or (
          st.phase_end is None and not st.left and len(st.times) < iterations)
      if finished:
        st.phase_end = None
        st.phase += 1
        enter(st)
  return {st.job.name: st.times for st in states}


def steady(times: Sequence[float]) -> float:
  """An iteration time that leaves out the first (jobs start aligned, so the first is not typical)."""
  rest = list(times[1:]) or list(times)
  return sorted(rest)[len(rest) // 2]


def sigma(jobs: Sequence[Job], capacity: Mapping[str, float], iterations: int = 6) -> dict[str, dict[str, float]]:
  """Per job: its iteration time alone, beside the others, and sigma = together / alone."""
  together = run(jobs, capacity, iterations)
  out = {}
  for j in jobs:
    alone = steady(run([j], capacity, iterations)[j.name])
    mixed = steady(together[j.name])
    out[j.name] = {"alone_s": alone, "together_s": mixed, "sigma": mixed / alone if alone > 0 else float("nan")}
  return out
