"""What each rank of a proxy does in one iteration: emulated compute, and collectives started, waited for or
blocking, over named communicators (the study's message schedules, docs/study.md section 1).

A schedule is data, so the bytes a proxy moves can be checked against the study's formulas without running
it, the HLO-derived proxies (`hlo_schedule.py`) produce the same form, and the executor (`proxy.py`) runs
either. Ranks are laid out as the study lays them: the inner group (tensor, expert or FSDP shard) fastest,
then the pipeline stage, then data parallelism. Each communicator is a group of ranks like an MPI/NCCL
communicator: only its members call its collectives, so pipeline stages keep their own timelines.

Where the study's code is followed but not copied:
- FSDP emulates the forward compute of all 16 units (the study's fsdp.cpp sleeps only 15 of them);
- a collective over a group of one rank moves nothing and is left out (the study calls it anyway).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from microbench.study import workloads as wl

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute")


@dataclasses.dataclass(frozen=True)
class Group:
  """A communicator: its kind (what it is for) and its ranks in group-rank order."""
  kind: str
  ranks: tuple[int, ...]

  @property
  def size(self) -> int:
    return len(self.ranks)


@dataclasses.dataclass(frozen=True)
class Comm:
  """One collective. `elements` is the per-rank buffer in nccl-tests' convention (all-gather: the output,
  reduce-scatter: the input, all-to-all: the whole send buffer). A `permute` sends each source's buffer to
  its target, (source, target) pairs given as positions in the group; a stage-to-stage send is the group
  (sender, receiver) with the pair (0, 1)."""
  op: str
  elements: int
  group: Group
  label: str  # the timer the study reports it under (bucket, allgather, reduce_scatter, replica, pp, tp, ep, ...)
  pairs: tuple[tuple[int, int], ...] = ()

  def __post_init__(self):
    if self.op not in COLLECTIVE_OPS:
      raise ValueError(f"unknown collective {self.op!r}")
    if (self.op == "permute") != bool(self.pairs):
      raise ValueError("a permute, and only a permute, has (source, target) pairs")
    if any(not (0 <= a < self.group.size and 0 <= b < self.group.size) for a, b in self.pairs):
      raise ValueError(f"pairs {self.pairs} outside a group of {self.group.size}")


@dataclasses.dataclass(frozen=True)
class Compute:
  seconds: float
  phase: str  # fwd | bwd


@dataclasses.dataclass(frozen=True)
class Start:
  """Dispatch a collective and go on (it runs while the host emulates compute)."""
  comm: Comm
  handle: int


@dataclasses.dataclass(frozen=True)
class Wait:
  """Block until the started collectives `handles` are done: exposed communication."""
  handles: tuple[int, ...]
  label: str


@dataclasses.dataclass(frozen=True)
class Blocking:
  """A collective the rank waits for at once (exposed communication)."""
  comm: Comm


Step = Compute | Start | Wait | Blocking


@dataclasses.dataclass(frozen=True)
class JobSchedule:
  """One iteration of every rank of a job, plus what the record needs to turn time into throughput."""
  name: str  # e.g. "dp/vit-h" or "derived llama3-8b,fsdp"
  gpus: int
  samples_per_iteration: int
  ranks: tuple[tuple[Step, ...], ...]
  meta: dict = dataclasses.field(default_factory=dict, compare=False)

  def comms(self, rank: int) -> Iterator[Comm]:
    for step in self.ranks[rank]:
      if isinstance(step, (Start, Blocking)):
        yield step.comm

  def scaled(self, bytes_scale: float = 1.0, compute_scale: float = 1.0) -> JobSchedule:
    """Every message and every compute time shrunk (for rehearsals on slow networks and CPUs)."""
    def comm(c: Comm) -> Comm:
      return dataclasses.replace(c, elements=scale_elements(c.op, c.elements, c.group.size, bytes_scale))

    def step(s: Step) -> Step:
      if isinstance(s, Compute):
        return Compute(s.seconds * compute_scale, s.phase)
      if isinstance(s, Start):
        return Start(comm(s.comm), s.handle)
      if isinstance(s, Blocking):
        return Blocking(comm(s.comm))
      return s
    meta = dict(self.meta, bytes_scale=bytes_scale, compute_scale=compute_scale)
    return dataclasses.replace(self, ranks=tuple(tuple(step(s) for s in r) for r in self.ranks), meta=meta)


def scale_elements(op: str, elements: int, n: int, scale: float) -> int:
  """Elements after scaling, kept a multiple of the group size where the collective needs it, and >= that."""
  grain = n if op in ("all_gather", "reduce_scatter", "all_to_all") else 1
  return max(grain, int(round(elements * scale / grain)) * grain)


def sent_bytes(comm: Comm, rank: int, element_bytes: int = wl.BF16_BYTES) -> int:
  """Bytes of this collective charged to `rank` (nccl-tests' S); a permute is charged to its sources only."""
  if comm.op == "permute" and comm.group.ranks.index(rank) not in {a for a, _ in comm.pairs}:
    return 0
  return comm.elements * element_bytes


def bytes_per_iteration(job: JobSchedule, rank: int, element_bytes: int = wl.BF16_BYTES) -> dict[str, int]:
  """{label: bytes} one rank moves per iteration, in nccl-tests' size convention."""
  out: dict[str, int] = {}
  for c in job.comms(rank):
    out[c.label] = out.get(c.label, 0) + sent_bytes(c, rank, element_bytes)
  return out


def compute_seconds(job: JobSchedule, rank: int) -> float:
  return sum(s.seconds for s in job.ranks[rank] if isinstance(s, Compute))


def check_consistent(job: JobSchedule) -> None:
  """Every member of a communicator issues the same collectives on it in the same order, every started
  collective is waited for, and the ranks can all finish the iteration (no deadlock). Raises ValueError."""
  seen: dict[tuple, list[tuple[int, list]]] = {}
  for rank, steps in enumerate(job.ranks):
    started: set[int] = set()
    for s in steps:
      if isinstance(s, Start):
        started.add(s.handle)
      elif isinstance(s, Wait):
        missing = set(s.handles) - started
        if missing:
          raise ValueError(f"rank {rank} waits for collectives never started: {sorted(missing)}")
        started -= set(s.handles)
    if started:
      raise ValueError(f"rank {rank} never waits for collectives {sorted(started)}")
    per_group: dict[tuple, list] = {}
    for c in job.comms(rank):
      if rank not in c.group.ranks:
        raise ValueError(f"rank {rank} calls a {c.op} on group {c.group.ranks} it is not in")
      per_group.setdefault(c.group.ranks, []).append((c.op, c.elements, c.pairs))
    for ranks, calls in per_group.items():
      seen.setdefault(ranks, []).append((rank, calls))
  for ranks, members in seen.items():
    if sorted(r for r, _ in members) != sorted(ranks):
      absent = sorted(set(ranks) - {r for r, _ in members})
      raise ValueError(f"group {ranks}: rank(s) {absent} never call its collectives")
    first_rank, first = members[0]
    for rank, calls in members[1:]:
      if calls != first:
        raise ValueError(f"group {ranks}: rank {rank} issues {calls[:3]}... but rank {first_rank} {first[:3]}...")
  _check_progress(job)


def _check_progress(job: JobSchedule) -> None:
  """Plays the iteration with blocking semantics: a blocking collective (or a wait for a started one)
  completes once every member has reached (or started) the same call on that communicator. Raises
  ValueError naming the stuck ranks if the ranks can't all finish: a deadlock."""
  n = len(job.ranks)
  pos = [0] * n
  reached: dict[tuple[tuple[int, ...], int], set[int]] = {}  # (communicator, call number) -> ranks there
  handle_call: list[dict[int, tuple[tuple[int, ...], int]]] = [{} for _ in range(n)]
  mine: list[dict[tuple[int, ...], int]] = [{} for _ in range(n)]

  def arrive(rank: int, c: Comm) -> tuple[tuple[int, ...], int]:
    k = mine[rank].get(c.group.ranks, 0)
    mine[rank][c.group.ranks] = k + 1
    reached.setdefault((c.group.ranks, k), set()).add(rank)
    return c.group.ranks, k

  def complete(call: tuple[tuple[int, ...], int]) -> bool:
    return len(reached.get(call, ())) == len(call[0])

  blocked: list[tuple[tuple[int, ...], int] | None] = [None] * n
  progress = True
  while progress:
    progress = False
    for r in range(n):
      steps = job.ranks[r]
      while pos[r] < len(steps):
        s = steps[pos[r]]
        if isinstance(s, Compute):
          pos[r] += 1
        elif isinstance(s, Start):
          handle_call[r][s.handle] = arrive(r, s.comm)
          pos[r] += 1
        elif isinstance(s, Blocking):
          if blocked[r] is None:
            blocked[r] = arrive(r, s.comm)
          if not complete(blocked[r]):
            break
          blocked[r] = None
          pos[r] += 1
        else:
          if not all(complete(handle_call[r][h]) for h in s.handles):
            break
          pos[r] += 1
        progress = True
  stuck = [r for r in range(n) if pos[r] < len(job.ranks[r])]
  if stuck:
    raise ValueError(f"deadlock: rank(s) {stuck[:8]}{'...' if len(stuck) > 8 else ''} can't finish the iteration "
                     f"(rank {stuck[0]} waits at step {pos[stuck[0]]})")


# ---------------------------------------------------------------------------------------------------------
# The five hand-written proxies.


@dataclasses.dataclass(frozen=True)
class Layout:
  """rank = ((data * stages) + stage) * inner + inner_id (the study's layout)."""
  deg: wl.Degrees

  def rank(self, data: int, stage: int, inner: int) -> int:
    return (data * self.deg.stages + stage) * self.deg.inner + inner

  def coords(self, rank: int) -> tuple[int, int, int]:
    inner = rank % self.deg.inner
    stage = (rank // self.deg.inner) % self.deg.stages
    return rank // (self.deg.inner * self.deg.stages), stage, inner

  def inner_group(self, kind: str, rank: int) -> Group:
    d, s, _ = self.coords(rank)
    return Group(kind, tuple(self.rank(d, s, i) for i in range(self.deg.inner)))

  def data_group(self, kind: str, rank: int) -> Group:
    _, s, i = self.coords(rank)
    return Group(kind, tuple(self.rank(d, s, i) for d in range(self.deg.data)))


class _Steps:
  """Builds one rank's steps; collectives over a group of one rank are dropped (they move nothing)."""

  def __init__(self):
    self.steps: list[Step] = []
    self._next = 0

  def compute(self, seconds: float, phase: str) -> None:
    self.steps.append(Compute(seconds, phase))

  def start(self, comm: Comm) -> int | None:
    if comm.group.size < 2:
      return None
    self._next += 1
    self.steps.append(Start(comm, self._next))
    return self._next

  def wait(self, handles: Sequence[int | None], label: str) -> None:
    live = tuple(h for h in handles if h is not None)
    if live:
      self.steps.append(Wait(live, label))

  def blocking(self, comm: Comm) -> None:
    if comm.group.size >= 2:
      self.steps.append(Blocking(comm))


def _dp(model: wl.ModelShape, fwd: float, gpus: int, rank: int) -> list[Step]:
  world = Group("data", tuple(range(gpus)))
  b = _Steps()
  b.compute(fwd, "fwd")
  handles = []
  for elements in wl.split(model.params, wl.DP_BUCKETS):
    b.compute(2 * fwd / wl.DP_BUCKETS, "bwd")
    handles.append(b.start(Comm("all_reduce", elements, world, "bucket")))
  b.wait(handles, "barrier")
  return b.steps


def _fsdp(model: wl.ModelShape, fwd: float, lay: Layout, rank: int) -> list[Step]:
  f, units = lay.deg.inner, wl.FSDP_UNITS
  shard = [wl.ceil_div(u, f) for u in wl.split(model.params, units)]
  unit_group = lay.inner_group("shard", rank)
  replicas = lay.data_group("replica", rank)

  def gather(u: int) -> Comm:
    return Comm("all_gather", shard[u] * f, unit_group, "allgather")

  b = _Steps()
  b.blocking(gather(0))
  for u in range(units - 1):
    h = b.start(gather(u + 1))
    b.compute(fwd / units, "fwd")
    b.wait([h], "allgather_wait_fwd")
  b.compute(fwd / units, "fwd")
  reduces = []
  for u in range(units - 1, -1, -1):
    h = b.start(gather(u - 1)) if u > 0 else None
    b.compute(2 * fwd / units, "bwd")
    b.blocking(Comm("reduce_scatter", shard[u] * f, unit_group, "reduce_scatter"))
    reduces.append(b.start(Comm("all_reduce", shard[u], replicas, "replica")))
    b.wait([h], "allgather_wait_bwd")
  b.wait(reduces, "barrier")
  return b.steps


def _pipeline(strategy: str, model: wl.ModelShape, fwd: float, lay: Layout, rank: int) -> list[Step]:
  """GPipe: all M forwards, then all M backwards, blocking stage transfers; then the DP all-reduce."""
  deg, m = lay.deg, wl.MICROBATCHES
  data, stage, inner = lay.coords(rank)
  pp_msg = model.seq * model.d_model * (wl.LOCAL_BATCH // m)
  per_mb = fwd / (deg.stages * m * (deg.inner if strategy == "dp+pp+tp" else 1))

  def transfer(src_stage: int, dst_stage: int) -> Comm:
    pair = (lay.rank(data, src_stage, inner), lay.rank(data, dst_stage, inner))
    return Comm("permute", pp_msg, Group("stage_pair", pair), "pp", ((0, 1),))

  inner_calls: list[Comm] = []
  if strategy == "dp+pp+tp":
    inner_calls = [Comm("all_reduce", pp_msg // deg.inner, lay.inner_group("tensor", rank), "tp")] * 2
  elif strategy == "dp+pp+ep":
    layers_per_stage = max(1, round(model.layers / deg.stages))
    tokens = (wl.LOCAL_BATCH // m) * model.seq
    per_peer = tokens * model.top_k * model.d_model // deg.inner
    inner_calls = [Comm("all_to_all", per_peer * deg.inner, lay.inner_group("expert", rank), "ep")] * (
        2 * layers_per_stage)

  b = _Steps()
  first, last = stage == 0, stage == deg.stages - 1
  for _ in range(m):
    if not first:
      b.blocking(transfer(stage - 1, stage))
    b.compute(per_mb, "fwd")
    if not last:
      b.blocking(transfer(stage, stage + 1))
    for c in inner_calls:
      b.blocking(c)
  for _ in range(m):
    if not last:
      b.blocking(transfer(stage + 1, stage))
    b.compute(2 * per_mb, "bwd")
    if not first:
      b.blocking(transfer(stage, stage - 1))
    for c in inner_calls:
      b.blocking(c)
  dp_group = lay.data_group("data", rank)
  if strategy == "dp+pp":
    b.blocking(Comm("all_reduce", model.params // deg.stages, dp_group, "dp"))
  elif strategy == "dp+pp+tp":
    b.blocking(Comm("all_reduce", model.params // (deg.stages * deg.inner), dp_group, "dp"))
  else:
    b.blocking(Comm("all_reduce", model.non_expert_params // deg.stages, lay.inner_group("expert", rank), "dp_ep"))
    dp_elems = model.non_expert_params // deg.stages + model.expert_params // (deg.stages * deg.inner)
    b.blocking(Comm("all_reduce", dp_elems, dp_group, "dp"))
  return b.steps


def build(strategy: str, gpus: int, gpu: str = "A100", model: str | None = None) -> JobSchedule:
  """The hand-written proxy of `strategy` for a job of `gpus` ranks on `gpu` (full scale; see `scaled`)."""
  st = wl.strategy(strategy)
  shape = wl.model(model or st.model)
  fwd = wl.forward_seconds(shape, wl.gpu(gpu))
  deg = wl.degrees(st.name, gpus)
  lay = Layout(deg)
  ranks = []
  for r in range(gpus):
    if st.name == "dp":
      steps = _dp(shape, fwd, gpus, r)
    elif st.name == "fsdp":
      steps = _fsdp(shape, fwd, lay, r)
    else:
      steps = _pipeline(st.name, shape, fwd, lay, r)
    ranks.append(tuple(steps))
  meta = {"strategy": st.name, "model": shape.name, "gpu": wl.gpu(gpu).name,
          "degrees": dataclasses.asdict(deg), "forward_s": fwd}
  return JobSchedule(f"{st.name}/{shape.name}", gpus, wl.samples_per_iteration(st.name, gpus),
                     tuple(ranks), meta)
