"""Pipeline schedules as tables: which forward and backward each stage runs at each tick.

A schedule is simulated here in plain Python, once, before anything is traced; the executor
(`microbench.models.pipeline`) only looks its rows up. One tick is one slot in which every device may run one
forward (F) and then one backward (B) of one layer chunk on one microbatch, after which activations
move one stage on and gradients one stage back (a ppermute each). Device `d` holds the chunks (virtual
stages) `d, d+S, ..., d+(V-1)S`; a microbatch visits virtual stages 0..S*V-1 in order.

- `gpipe`: every forward, then every backward (a device starts backwards only when its forwards are
  done): M microbatches of activations alive at once.
- `1f1b`: device d runs at most S-d microbatches ahead (PipeDream-Flush / Megatron): the same bubble as
  GPipe, activation memory S microbatches instead of M.
- `interleaved`: 1F1B over V chunks per device in Megatron's order (groups of S microbatches per chunk),
  so the pipeline fills V times faster: bubble (S-1)/(V*M+S-1).

Why a simulator rather than formulas per schedule: the same code checks every dependency (a forward
after its input arrived, a backward after its gradient arrived and its forward ran), assigns stash
slots, counts the memory each schedule needs, and gives the tick-by-tick table the executor runs, so
the schedule that is tested is the schedule that runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved")

# Columns of `Schedule.table[tick, device]`.
F_CHUNK, F_MB, F_SLOT, F_GSLOT, B_CHUNK, B_MB, B_SLOT, B_GSLOT, RECV_X, RECV_G = range(10)
COLUMNS = ("f_chunk", "f_mb", "f_slot", "f_gslot", "b_chunk", "b_mb", "b_slot", "b_gslot", "recv_x", "recv_g")


class ScheduleError(ValueError):
  """A schedule that can't run with these stages/microbatches; one line saying what is allowed."""


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The simulated schedule. Entries of `table` are -1 where nothing happens.

  f_chunk/f_mb: the forward's local chunk and microbatch; f_slot: the activation-stash slot holding
  its input (-1: virtual stage 0 reads the microbatch itself); f_gslot: for the last virtual stage, the
  gradient-stash slot the loss gradient goes to. b_*: the same for the backward (b_gslot: its output
  gradient). recv_x/recv_g: the stash slot where the activation / gradient arriving after this tick's
  transfer is kept (-1: nothing arrives).
  """
  kind: str
  stages: int
  microbatches: int
  virtual: int
  table: np.ndarray  # int32 [ticks, stages, len(COLUMNS)]
  x_slots: int  # activation stash depth per device
  g_slots: int  # gradient stash depth per device

  @property
  def ticks(self) -> int:
    return int(self.table.shape[0])

  def busy(self) -> np.ndarray:
    """[ticks, stages, 2] bool: forward / backward runs."""
    return np.stack([self.table[..., F_CHUNK] >= 0, self.table[..., B_CHUNK] >= 0], axis=-1)

  def bubble(self, backward_cost: float = 2.0) -> float:
    """Idle fraction of device time when ticks run in lockstep (each tick lasts as long as its busiest
    device), a forward costs 1 and a backward `backward_cost`."""
    busy = self.busy()
    tick_cost = (busy[..., 0] * 1.0 + busy[..., 1] * backward_cost).max(axis=1)
    work = self.microbatches * self.virtual * (1.0 + backward_cost)  # per device
    return 1.0 - work / self.virtual / (tick_cost.sum() / self.virtual)


def theory_bubble(kind: str, stages: int, microbatches: int, virtual: int = 1) -> float:
  """The textbook bubble fraction: (S-1)/(M+S-1) for GPipe and 1F1B, (S-1)/(V*M+S-1) interleaved."""
  s, m = stages, microbatches
  return (s - 1) / ((virtual if kind == "interleaved" else 1) * m + s - 1)


def check(kind: str, stages: int, microbatches: int, virtual: int = 1) -> None:
  """Refuses what a schedule can't run, with one line."""
  if kind not in SCHEDULES:
    raise ScheduleError(f"unknown --schedule={kind!r}; choose one of {', '.join(SCHEDULES)}")
  if stages < 1 or microbatches < 1 or virtual < 1:
    raise ScheduleError(f"stages ({stages}), microbatches ({microbatches}) and virtual stages ({virtual}) must"
                        " be >= 1")
  if kind != "interleaved" and virtual != 1:
    raise ScheduleError(f"--virtual_stages={virtual} needs --schedule=interleaved ({kind} runs one chunk per"
                        " stage)")
  if kind == "interleaved":
    if virtual < 2:
      raise ScheduleError("--schedule=interleaved needs --virtual_stages >= 2 (one chunk per stage is 1f1b)")
    if microbatches % stages:
      raise ScheduleError(f"--schedule=interleaved needs --microbatches a multiple of the pipeline stages"
                          f" ({stages}); got {microbatches}")


def _orders(kind: str, s: int, m: int, v: int) -> tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]]],
                                                        list[int]]:
  """Per device: forward order, backward order (as (chunk, microbatch)), and how far forwards may run
  ahead of backwards (microbatch-chunks in flight)."""
  if kind == "interleaved":
    fwd, bwd = [], []
    for g in range(m // s):
      group = range(g * s, (g + 1) * s)
      fwd += [(c, mb) for c in range(v) for mb in group]
      bwd += [(c, mb) for c in reversed(range(v)) for mb in group]
    # Megatron's warm-up: (S-d-1)*2 + (V-1)*S forwards before the first backward, then one in one out.
    limits = [min(m * v, (s - d - 1) * 2 + (v - 1) * s + 1) for d in range(s)]
    return [fwd] * s, [bwd] * s, limits
  order = [(0, mb) for mb in range(m)]
  # 1F1B in lockstep ticks: a microbatch's round trip from device d to the loss and back takes
  # 2(S-1-d)+1 ticks, so that many must be in flight for the device never to wait.
  limits = [m if kind == "gpipe" else min(m, 2 * (s - d) - 1) for d in range(s)]
  return [order] * s, [order] * s, limits


def _slots(events: list[tuple[int, int, int]]) -> tuple[dict[int, int], int]:
  """Greedy slot assignment for (key, tick_in, tick_out) lifetimes; a slot freed at tick t is reusable
  by an arrival written at the end of tick t."""
  free, used, out = [], 0, {}
  ends: list[tuple[int, int]] = []  # (tick_out, slot)
  for key, t_in, t_out in sorted(events, key=lambda e: e[1]):
    for end, slot in [e for e in ends if e[0] <= t_in]:
      ends.remove((end, slot))
      free.append(slot)
    slot = min(free) if free else used
    if free:
      free.remove(slot)
    else:
      used += 1
    out[key] = slot
    ends.append((t_out, slot))
  return out, used


def _arrived(g_arrive: dict[tuple[int, int], int], op: tuple[int, int], s: int, d: int, tick: int) -> bool:
  t = g_arrive.get((op[0] * s + d, op[1]))
  return t is not None and t < tick


def make_schedule(kind: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
  """Simulates the schedule tick by tick and returns its table (raises ScheduleError on bad input)."""
  check(kind, stages, microbatches, virtual)
  run = _Run(kind, stages, microbatches, virtual, *_orders(kind, stages, microbatches, virtual))
  run.simulate()
  return run.schedule()


@dataclasses.dataclass
class _Run:
  """The simulation's state: each device's next forward and backward, and when each activation and gradient
  arrives (is usable) and each backward runs; `rows` holds each tick's (forward, backward) per device."""
  kind: str
  s: int
  m: int
  v: int
  fwd_order: list[list[tuple[int, int]]]
  bwd_order: list[list[tuple[int, int]]]
  limits: list[int]
  f_next: list[int] = dataclasses.field(default_factory=list)
  b_next: list[int] = dataclasses.field(default_factory=list)
  x_arrive: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (vstage, mb) -> tick usable
  g_arrive: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
  b_tick: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
  rows: list[list[list[tuple[int, int] | None]]] = dataclasses.field(default_factory=list)

  def __post_init__(self) -> None:
    self.f_next, self.b_next = [0] * self.s, [0] * self.s
    self.x_arrive = {(0, mb): -1 for mb in range(self.m)}

  @property
  def nv(self) -> int:  # virtual stages
    return self.s * self.v

  def simulate(self) -> None:
    """Ticks until every device has run all its backwards: each tick the forwards, then the backwards."""
    s, tick = self.s, 0
    while any(self.b_next[d] < len(self.bwd_order[d]) for d in range(s)):
      if tick > 4 * (self.m * self.v + self.nv) + 8:  # a bug here, not bad input
        raise AssertionError(f"{self.kind} schedule (S={s}, M={self.m}, V={self.v}) deadlocked")
      row: list[list[tuple[int, int] | None]] = [[None, None] for _ in range(s)]
      for d in range(s):
        self.forward(row, d, tick)
      for d in range(s):
        self.backward(row, d, tick)
      self.rows.append(row)
      tick += 1

  def forward(self, row: list[list[tuple[int, int] | None]], d: int, tick: int) -> None:
    """Device d's next forward, if its input is here and it is within its limit of forwards in flight."""
    kind, s, f_next, b_next, bwd_order = self.kind, self.s, self.f_next, self.b_next, self.bwd_order
    if f_next[d] == len(self.fwd_order[d]):
      return
    c, mb = self.fwd_order[d][f_next[d]]
    vs = c * s + d
    # A backward whose gradient is already here runs this tick, so it makes room for this forward.
    b_due = b_next[d] < len(bwd_order[d]) and kind != "gpipe" and _arrived(self.g_arrive, bwd_order[d][b_next[d]],
                                                                          s, d, tick)
    if self.x_arrive.get((vs, mb), tick) < tick and f_next[d] - b_next[d] - b_due < self.limits[d]:
      row[d][0] = (c, mb)
      f_next[d] += 1
      if vs == self.nv - 1:
        # The loss gradient is written during this tick, before this tick's backward: it is usable now,
        # and its slot can't be one that this tick's backward frees.
        self.g_arrive[(vs, mb)] = tick - 1
      else:
        self.x_arrive[(vs + 1, mb)] = tick  # sent at the end of this tick, usable from the next

  def backward(self, row: list[list[tuple[int, int] | None]], d: int, tick: int) -> None:
    """Device d's next backward, if its gradient is here (gpipe: only once all its forwards have run)."""
    if self.b_next[d] == len(self.bwd_order[d]) or (self.kind == "gpipe" and self.f_next[d] < len(self.fwd_order[d])):
      return
    c, mb = self.bwd_order[d][self.b_next[d]]
    vs = c * self.s + d
    if _arrived(self.g_arrive, (c, mb), self.s, d, tick):
      row[d][1] = (c, mb)
      self.b_tick[(vs, mb)] = tick
      self.b_next[d] += 1
      if vs > 0:
        self.g_arrive[(vs - 1, mb)] = tick

  def stash_slots(self) -> tuple[dict, dict, int, int]:
    """Stash slots per device: an activation lives from its arrival to its backward (virtual stage 0 reads
    the microbatch itself); a gradient from its arrival (or the loss) to its backward. Returns the slots of
    activations and gradients, and how many of each a device needs."""
    s, b_tick = self.s, self.b_tick
    x_slot, g_slot, x_depth, g_depth = {}, {}, 1, 1
    for d in range(s):
      xs = [((vs, mb), self.x_arrive[(vs, mb)], b_tick[(vs, mb)]) for (vs, mb) in self.x_arrive
            if vs % s == d and vs > 0]
      gs = [((vs, mb), self.g_arrive[(vs, mb)], b_tick[(vs, mb)]) for (vs, mb) in self.g_arrive if vs % s == d]
      slots, n = _slots(xs)
      x_slot.update(slots)
      x_depth = max(x_depth, n)
      slots, n = _slots(gs)
      g_slot.update(slots)
      g_depth = max(g_depth, n)
    return x_slot, g_slot, x_depth, g_depth

  def schedule(self) -> Schedule:
    """The simulated ticks as the executor's table."""
    s, nv = self.s, self.nv
    table = np.full((len(self.rows), s, len(COLUMNS)), -1, np.int32)
    x_slot, g_slot, x_depth, g_depth = self.stash_slots()
    for t, row in enumerate(self.rows):
      for d, (f, b) in enumerate(row):
        if f is not None:
          c, mb = f
          vs = c * s + d
          table[t, d, [F_CHUNK, F_MB]] = (c, mb)
          table[t, d, F_SLOT] = x_slot.get((vs, mb), -1)
          table[t, d, F_GSLOT] = g_slot[(vs, mb)] if vs == nv - 1 else -1
        if b is not None:
          c, mb = b
          vs = c * s + d
          table[t, d, [B_CHUNK, B_MB]] = (c, mb)
          table[t, d, B_SLOT] = x_slot.get((vs, mb), -1)
          table[t, d, B_GSLOT] = g_slot[(vs, mb)]
    for (vs, mb), t in self.x_arrive.items():
      if vs > 0:
        table[t, vs % s, RECV_X] = x_slot[(vs, mb)]
    for (vs, mb), t in self.g_arrive.items():
      if vs < nv - 1:
        table[t, vs % s, RECV_G] = g_slot[(vs, mb)]
    return Schedule(self.kind, s, self.m, self.v, table, x_depth, g_depth)


def sends(sched: Schedule) -> np.ndarray:
  """[ticks, 2] bool: whether any device sends an activation forward / a gradient back after each tick (the
  last virtual stage's output goes to the head, the first's input gradient leaves the pipeline). The
  executor moves data only on those ticks: a transfer is one collective over every stage, so it runs or not
  for all of them together."""
  s, nv = sched.stages, sched.stages * sched.virtual
  d = np.arange(s)[None, :]
  vs_f = sched.table[..., F_CHUNK] * s + d
  vs_b = sched.table[..., B_CHUNK] * s + d
  fwd = ((sched.table[..., F_CHUNK] >= 0) & (vs_f != nv - 1)).any(axis=1)
  bwd = ((sched.table[..., B_CHUNK] >= 0) & (vs_b != 0)).any(axis=1)
  return np.stack([fwd, bwd], axis=1)


def no_bubble(sched: Schedule) -> Schedule:
  """The same work without the bubble, for timing: every device runs one forward and one backward per
  tick for M*V ticks, with the same transfers, in lockstep. Its values are meaningless (inputs are not
  wired to their producers); only its duration is used."""
  s, m, v = sched.stages, sched.microbatches, sched.virtual
  table = np.full((m * v, s, len(COLUMNS)), -1, np.int32)
  for t in range(m * v):
    c, mb = t // m, t % m
    for d in range(s):
      vs = c * s + d
      table[t, d, [F_CHUNK, F_MB, B_CHUNK, B_MB]] = (c, mb, c, mb)
      table[t, d, [F_SLOT, B_SLOT]] = -1 if vs == 0 else 0
      table[t, d, F_GSLOT] = 0 if vs == s * v - 1 else -1
      table[t, d, B_GSLOT] = 0
  return Schedule(sched.kind + "-no-bubble", s, m, v, table, 1, 1)
