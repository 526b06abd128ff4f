"""Jobs running side by side on shared links: every rank's timeline of compute and collectives, the
collectives' flows sharing links max-min fairly, iteration times and sigma.

A job is a program per rank: compute (a fixed time that shares nothing), `Start` of a collective (it begins
once every member has started it and its communicator's earlier collectives are done, as NCCL runs one
communicator's collectives in order on one stream; its flows then share the links with every other flow
in flight), `Wait`
for started collectives, and `Blocking` (start, then wait). A collective ends when its last flow ends. Every
rank repeats its program; the job's iteration ends when its slowest rank ends it (the study's throughput is
the minimum over ranks). All jobs run until each has done `iterations`, so no job's last iterations run on
an emptied fabric (the study respawns jobs that end for the same reason).

A collective may carry a latency (`latency_s`: its start-up and per-step hop latencies, alpha in the
alpha-beta model): once it may run it waits that long, sharing nothing, then its flows go in flight
(t = alpha + beta as the fitted sweeps describe a collective alone). A job of many small collectives is
then mostly latency, which no neighbour slows down.

The model's assumptions, said wherever a prediction is shown (ASSUMPTIONS): jobs start together; compute
is unaffected by other jobs; latencies are paid per collective, unshared; no protocol or congestion-control
cost beyond max-min fair sharing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from microbench.fabric import flows as fl

ASSUMPTIONS = ("jobs start together and repeat their iterations back to back",
               "concurrent flows share each link max-min fairly; no congestion-control loss",
               "a collective's latency (start-up and hops) is paid before its flows and shares nothing",
               "compute is unaffected by other jobs")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective call: its members (rank ids of the job) and its flows (links crossed, bytes)."""
  key: str  # the same on every member for the same call (a group's n-th call of this kind)
  members: tuple[int, ...]
  flows: tuple[tuple[tuple[str, ...], float], ...]
  latency_s: float = 0.0  # paid before the flows start, shared with nobody (alpha)


@dataclasses.dataclass(frozen=True)
class Compute:
  seconds: float


@dataclasses.dataclass(frozen=True)
class Start:
  collective: Collective
  handle: int


@dataclasses.dataclass(frozen=True)
class Wait:
  handles: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Blocking:
  collective: Collective


Step = Compute | Start | Wait | Blocking


@dataclasses.dataclass(frozen=True)
class Job:
  name: str
  programs: Mapping[int, tuple[Step, ...]]  # rank -> its steps for one iteration


class ModelError(RuntimeError):
  """The jobs cannot progress under the model (a collective some member never starts)."""


@dataclasses.dataclass
class _Rank:
  job: int
  rank: int
  steps: tuple[Step, ...]
  pc: int = 0
  iteration: int = 0
  busy_until: float | None = None
  handles: dict[int, tuple] = dataclasses.field(default_factory=dict)  # handle -> call id
  blocked_on: tuple = ()  # call ids it waits for
  awake: bool = True  # in the ready list
  ends: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Call:
  members: frozenset
  flows: tuple[tuple[tuple[str, ...], float], ...]
  comm: tuple  # (job, members): its communicator
  latency_s: float = 0.0
  arrived: set = dataclasses.field(default_factory=set)
  live: set = dataclasses.field(default_factory=set)  # flow ids in flight
  queued: bool = False  # every member has called it
  started: bool = False  # its communicator's earlier calls are done: its flows are in flight
  done: bool = False


def _check_members(job: Job) -> None:
  """Every collective must be called by each of its members (else the model, like the job, would hang)."""
  calls: dict[str, tuple[int, ...]] = {}
  callers: dict[str, set[int]] = {}
  for rank, steps in job.programs.items():
    for step in steps:
      if isinstance(step, (Start, Blocking)):
        calls[step.collective.key] = step.collective.members
        callers.setdefault(step.collective.key, set()).add(rank)
  for key, members in calls.items():
    missing = sorted(set(members) - callers[key])
    if missing:
      raise ModelError(f"job {job.name}: collective {key} is never started by member rank(s)"
                       f" {', '.join(map(str, missing[:4]))}: no rank could get past it")


def run(jobs: Sequence[Job], capacity: Mapping[str, float], iterations: int = 6) -> dict[str, list[float]]:
  """Seconds per iteration of each job (its slowest rank), all jobs running at once from time 0."""
  for job in jobs:
    _check_members(job)
  _check_links(jobs, capacity)
  sim = _Simulation(jobs, capacity, iterations)
  sim.run()
  out: dict[str, list[float]] = {}
  for j, job in enumerate(jobs):
    mine = [st for st in sim.ranks if st.job == j]
    ends = [max(st.ends[i] for st in mine) for i in range(iterations)]
    out[job.name] = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
  return out


def _check_links(jobs: Sequence[Job], capacity: Mapping[str, float]) -> None:
  """Every flow must cross links with a capacity (a flow crossing none would have an unbounded rate)."""
  for job in jobs:
    for steps in job.programs.values():
      for s in steps:
        if isinstance(s, (Start, Blocking)):
          for p, size in s.collective.flows:
            if size > 0 and not p:
              raise ModelError(f"job {job.name}: a flow of {s.collective.key} crosses no link (unbounded rate)")
            if any(x not in capacity for x in p):
              raise ModelError(f"job {job.name}: {s.collective.key} crosses links with no capacity:"
                               f" {', '.join(x for x in p if x not in capacity)}")


class _Simulation:
  """The jobs' ranks, their calls and the flows in flight, advanced from event to event (a rank's compute
  ending, a flow ending, a call's latency ending) until every rank has done `iterations`."""

  def __init__(self, jobs: Sequence[Job], capacity: Mapping[str, float], iterations: int) -> None:
    self.capacity, self.iterations = capacity, iterations
    self.ranks = [_Rank(j, r, tuple(steps)) for j, job in enumerate(jobs)
                  for r, steps in sorted(job.programs.items())]
    self.calls: dict[tuple, _Call] = {}
    self.queues: dict[tuple, list[tuple]] = {}  # communicator -> its calls ready to run, the first one running
    self.left: dict[str, float] = {}  # flow -> bytes left
    self.paths: dict[str, tuple[str, ...]] = {}  # flow -> its links
    self.owner: dict[str, tuple] = {}  # flow -> its call
    self.waiters: dict[tuple, list[_Rank]] = {}  # call -> ranks blocked on it (woken when it is done)
    self.timers: dict[tuple, float] = {}  # call -> when its latency ends and its flows start
    self.ready: list[_Rank] = list(self.ranks)  # ranks that may move now; the others wait for time or a call
    self.finished = 0  # ranks that have done `iterations`
    self.now = 0.0
    self.rates: dict[str, float] = {}
    self.flows_at_rates: frozenset = frozenset()
    self.per_path: dict[tuple[str, ...], int] = {}  # flows in flight per path, kept as they start and end
    self.solved: dict[frozenset, dict[tuple[str, ...], float]] = {}  # iterations repeat: so do the flow mixes

  def run(self) -> None:
    """Moves every rank that may move, then time to the next event, until all are finished."""
    while self.finished < len(self.ranks):
      while self.ready and self.finished < len(self.ranks):
        st = self.ready.pop()
        st.awake = False
        self.advance(st)
      if self.finished == len(self.ranks):
        break
      self.update_rates()
      busy = [st for st in self.ranks if st.busy_until is not None]
      step = self.next_event(busy)
      self.now += step
      self.progress_flows(step)
      for cid, t in sorted(self.timers.items(), key=lambda kv: kv[1]):
        if t <= self.now + fl.EPS:
          del self.timers[cid]
          self.start_flows(cid)
      for st in busy:
        if st.busy_until <= self.now + fl.EPS:
          self.wake(st)

  def update_rates(self) -> None:
    """Each flow's rate, max-min fair over the paths in flight (rates change only when a flow starts or ends)."""
    if self.flows_at_rates != self.paths.keys():
      mix = frozenset((p, c) for p, c in self.per_path.items() if c)
      if mix not in self.solved:
        self.solved[mix] = fl.path_rates(dict(mix), self.capacity)
      self.rates = {f: self.solved[mix][p] for f, p in self.paths.items()}
      self.flows_at_rates = frozenset(self.paths)

  def next_event(self, busy: list[_Rank]) -> float:
    """Seconds to the next event: a busy rank's compute, a flow or a call's latency ending."""
    candidates = [st.busy_until - self.now for st in busy]
    candidates += [self.left[f] / self.rates[f] for f in self.left]
    candidates += [t - self.now for t in self.timers.values()]
    if not candidates:
      waiting = sorted({str(c) for st in self.ranks for c in st.blocked_on if not self.calls[c].started})
      raise ModelError(f"no rank can progress: collectives some member never starts: {', '.join(waiting[:3])}")
    return max(min(candidates), 0.0)

  def progress_flows(self, step: float) -> None:
    """Moves every flow's bytes on by `step` seconds at its rate; a call whose last flow ends is done."""
    for f in list(self.left):
      self.left[f] -= self.rates[f] * step
      if self.left[f] <= self.rates[f] * fl.TIME_EPS:  # within a nanosecond of done: done (no sliver events)
        call = self.calls[self.owner[f]]
        call.live.discard(f)
        if not call.live:
          self.finish(self.owner[f])
        self.per_path[self.paths[f]] -= 1
        del self.left[f], self.paths[f], self.owner[f]

  def wake(self, st: _Rank) -> None:
    if not st.awake:
      st.awake = True
      self.ready.append(st)

  def launch(self, cid: tuple) -> None:
    """A call that may run: its latency first (a timer), then its flows."""
    self.calls[cid].started = True
    if self.calls[cid].latency_s > 0:
      self.timers[cid] = self.now + self.calls[cid].latency_s
    else:
      self.start_flows(cid)

  def start_flows(self, cid: tuple) -> None:
    """Puts a call's flows in flight; a call with none is done at once and the next one queued on its
    communicator goes."""
    call = self.calls[cid]
    for i, (links, size) in enumerate(call.flows):
      if size > 0:
        fid = f"{cid}/{i}"
        self.left[fid], self.paths[fid], self.owner[fid] = float(size), tuple(links), cid
        self.per_path[self.paths[fid]] = self.per_path.get(self.paths[fid], 0) + 1
        call.live.add(fid)
    if not call.live:
      self.finish(cid)

  def finish(self, cid: tuple) -> None:
    call = self.calls[cid]
    call.done = True
    for st in self.waiters.pop(cid, ()):
      self.wake(st)
    queue = self.queues[call.comm]
    queue.pop(0)
    if queue:
      self.launch(queue[0])

  def arrive(self, st: _Rank, c: Collective) -> tuple:
    """A rank calls a collective; once every member has, it queues on its communicator. Returns the call."""
    cid = (st.job, st.iteration, c.key)
    call = self.calls.setdefault(cid, _Call(frozenset(c.members), c.flows, (st.job, c.members), c.latency_s))
    call.arrived.add(st.rank)
    if not call.queued and call.arrived >= call.members:
      # One communicator runs its collectives one at a time, in order (NCCL: one stream per communicator).
      call.queued = True
      queue = self.queues.setdefault(call.comm, [])
      queue.append(cid)
      if len(queue) == 1:
        self.launch(cid)
    return cid

  def advance(self, st: _Rank) -> None:
    """Runs the rank's steps until one blocks (it is woken again by time or by the call it waits for)."""
    while True:
      if st.blocked_on:
        undone = [c for c in st.blocked_on if not self.calls[c].done]
        if undone:
          self.waiters.setdefault(undone[0], []).append(st)  # woken when it is done, then checks the rest
          return
        st.blocked_on = ()
      if st.busy_until is not None:
        if st.busy_until > self.now + fl.EPS:
          return
        st.busy_until = None
      if st.pc == len(st.steps):
        st.ends.append(self.now)
        st.iteration, st.pc, st.handles = st.iteration + 1, 0, {}
        if len(st.ends) == self.iterations:
          self.finished += 1
        if self.finished == len(self.ranks):
          return
        continue
      step = st.steps[st.pc]
      st.pc += 1
      if isinstance(step, Compute):
        if step.seconds > 0:
          st.busy_until = self.now + step.seconds
      elif isinstance(step, Start):
        st.handles[step.handle] = self.arrive(st, step.collective)
      elif isinstance(step, Blocking):
        st.blocked_on = (self.arrive(st, step.collective),)
      else:
        st.blocked_on = tuple(st.handles[h] for h in step.handles)


def steady(times: Sequence[float]) -> float:
  """The median iteration time without the first (jobs start aligned, so the first is not typical)."""
  rest = sorted(times[1:]) or sorted(times)
  return rest[len(rest) // 2]


def sigma(jobs: Sequence[Job], capacity: Mapping[str, float], iterations: int = 6) -> dict[str, dict[str, float]]:
  """Per job: its iteration time alone, beside the others, and sigma = together / alone."""
  together = run(jobs, capacity, iterations)
  out = {}
  for j in jobs:
    alone = steady(run([j], capacity, iterations)[j.name])
    mixed = steady(together[j.name])
    out[j.name] = {"alone_s": alone, "together_s": mixed, "sigma": mixed / alone if alone > 0 else float("nan")}
  return out
