"""A proxy whose collectives are those of a real training step: read from the compiled (partitioned) HLO of
microbench-train's step for a model and strategy, in program order, with the op, bytes and group of each.

`derive("llama3-8b,fsdp", gpus)` lays the study's strategy on `gpus` devices as microbench-train would
(`microbench.train.plan`), compiles the step ahead of time (`Trainer.compile_step`, nothing allocated) and
walks the compiled module from its entry computation: a collective is blocking, an async `-start` is a start
and its `-done` the wait for it, a `while` loop repeats its body's collectives by its known trip count (the
scanned layers of a model run their collectives once per layer), calls and async wrappers are followed.
Bytes follow nccl-tests' convention (microbench.train.comm_fingerprint's): all-gather the output,
reduce-scatter the input, the rest the buffer; elements are counted in bf16, the proxy's default buffer type.
Replica groups (device positions in the compiled program's device assignment) become communicators of ranks.

Compute has no per-op model here: the step's model FLOPs at the GPU's bf16 peak (100% MFU, like the study's
compute-bound roofline), split evenly between the gaps around the collectives.

A pipelined step's tick loop is read tick by tick with its schedule table (`PipelineTicks`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from microbench.meshes import parallelism as par
from microbench.hlo import parse as hlo
from microbench.aot import gpu_compile
from microbench.study import presets
from microbench.study import rank_programs as sch
from microbench.study import workloads as wl

OPS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
       "all-to-all": "all_to_all", "collective-permute": "permute"}


@dataclasses.dataclass(frozen=True)
class Event:
  """One collective event of the step, in program order: `kind` is blocking, start or done."""
  kind: str
  op: str  # schedule op name
  nbytes: int  # per device, nccl-tests' S
  groups: tuple[tuple[int, ...], ...]  # device positions (a permute: its connected sets of devices)
  name: str  # the instruction (links a start to its done)
  pairs: tuple[tuple[int, int], ...] = ()  # a permute's (source, target) device positions


_DONES = {f"{op}-done" for op in (*OPS, "async")}


def computations(text: str) -> tuple[dict[str, list[str]], str]:
  """{name: instruction lines} of an HLO module's text (hlo.computations), and the entry computation's name."""
  comps = hlo.computations(text)
  entry = next((c.name for c in comps.values() if c.entry), "")
  if not entry:
    raise ValueError("no ENTRY computation in the HLO text")
  return {c.name: [ln for ln in c.lines if ln.strip()] for c in comps.values()}, entry


@dataclasses.dataclass(frozen=True)
class _Line:
  """One instruction line parsed once (the pipeline's tick loop walks its body once per tick)."""
  ins: hlo.Instr
  collective: hlo.Instruction | None
  callees: tuple[tuple[str, str], ...]


def _nbytes(ins: hlo.Instruction, group: int) -> int:
  """Per-device bytes in nccl-tests' convention (as microbench.train.comm_fingerprint counts them)."""
  size = sum(b for _, b in hlo.moved_parts(ins))
  return size * group if ins.op == "reduce-scatter" else size


def _components(pairs: Sequence[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
  parent: dict[int, int] = {}

  def find(x: int) -> int:
    while parent.setdefault(x, x) != x:
      x = parent[x]
    return x
  for a, b in pairs:
    parent[find(a)] = find(b)
  comps: dict[int, list[int]] = {}
  for d in list(parent):
    comps.setdefault(find(d), []).append(d)
  return tuple(tuple(sorted(c)) for c in comps.values())


@dataclasses.dataclass(frozen=True)
class PipelineTicks:
  """How to read a pipelined step: its schedule table and the stage of each device position. The tick loop
  (a `while` whose trip count is the table's ticks; its top-level conditionals are the tick's forward and
  backward, forward first, and the two transfers) is unrolled tick by tick: a collective inside the forward or
  backward is kept only for the stages that run it at that tick (the table says which), a transfer only on the
  ticks it runs; the head's conditional inside the forward runs on the last stage when it runs the last
  chunk."""
  table: np.ndarray  # [ticks, stages, columns] (microbench.models.pipeline_schedule)
  sends: np.ndarray  # [ticks, 2]: a transfer forward / back runs after the tick (pipeline_schedule.sends)
  stage_of: tuple[int, ...]  # stage of each device position
  virtual: int

  @property
  def ticks(self) -> int:
    return int(self.table.shape[0])


def events(text: str, devices: int, pipeline: PipelineTicks | None = None) -> tuple[list[Event], dict]:
  """The step's collective events in program order (loops unrolled by their trip counts), and notes
  (each loop with collectives, and how many loops had no known trip count and were counted once).

  Outside a pipeline's tick loop one branch of a conditional stands for all (the first with collectives);
  inside it, `pipeline` says which stages run which branch at each tick."""
  lines, entry = computations(text)
  walker = _Walker(text, lines, devices, pipeline)
  return walker.walk(entry, 0), walker.notes


class _Walker:
  """Walks an HLO module's computations from the entry, one method per kind of instruction that holds
  collectives (a while loop, an async wrapper, a call, a conditional), collecting events and notes."""

  def __init__(self, text: str, lines: dict[str, list[str]], devices: int, pipeline: PipelineTicks | None) -> None:
    self.devices, self.pipeline = devices, pipeline
    self.comps: dict[str, list[_Line]] = {}
    for name, comp_lines in lines.items():
      self.comps[name] = []
      for line in comp_lines:
        ins = hlo.parse_instruction(line)
        if ins is not None:
          self.comps[name].append(_Line(ins, next(iter(hlo.instructions(line)), None), tuple(hlo.callees(ins))))
    self.notes: dict = {"loops": [], "unknown_trip_counts": 0}
    # each loop's trip count: XLA's annotation, or (XLA:TPU drops it) read from the loop's counter
    self.trips = {loop.body: loop.trip_count for loop in hlo.while_loops(text)}
    self.s_count = 0 if pipeline is None else int(pipeline.table.shape[1])

  def collective(self, ins: hlo.Instruction, name: str) -> Event:
    pairs: tuple[tuple[int, int], ...] = ()
    if ins.op == "collective-permute":
      pairs = tuple((a, b) for a, b in hlo.source_target_pairs(ins.rest))
      groups = _components(pairs)
    else:
      groups = hlo.replica_groups(ins.rest) or (tuple(range(self.devices)),)
    return Event("start" if ins.async_start else "blocking", OPS[ins.op], _nbytes(ins, len(groups[0])), groups,
                 name, pairs)

  def only(self, evts: list[Event], stages: set[int]) -> list[Event]:
    """The events as run by the devices of `stages` only (a stage-local collective's groups lie in one stage)."""
    out = []
    for e in evts:
      groups = tuple(g for g in e.groups if self.pipeline.stage_of[g[0]] in stages)
      if groups or e.kind == "done":
        out.append(dataclasses.replace(e, groups=groups) if e.kind != "done" else e)
    return out

  @staticmethod
  def called(ln: _Line, *kinds: str) -> list[str]:
    """The callees of the given kinds, in the order of `kinds`."""
    return [c for kind in kinds for k, c in ln.callees if k == kind]

  def walk(self, comp: str, depth: int, tick: int | None = None, role: str | None = None, note: bool = True
           ) -> list[Event]:
    """The events of computation `comp`; inside the pipeline's tick loop, as run at `tick`, inside the
    tick's forward or backward (`role`); `note`: record the loops met (once, not per tick)."""
    if depth > 50:
      raise ValueError("HLO call graph too deep")
    out: list[Event] = []
    top_conditionals = 0  # the tick body's compute branches so far: the forward first, then the backward
    for ln in self.comps.get(comp, []):
      name, opcode = ln.ins.name, ln.ins.opcode
      if ln.collective is not None and ln.collective.op in OPS:
        out.append(self.collective(ln.collective, name))
      elif opcode in _DONES:
        out.append(Event("done", "", 0, (), re.match(r"\s*%?([\w.\-]+)", ln.ins.rest).group(1)))
      elif opcode == "while":
        out += self.loop(ln, depth, tick, role, note)
      elif opcode == "async-start":  # a wrapped async collective: its callee's ops start here
        for callee in self.called(ln, "calls")[:1]:
          for e in self.walk(callee, depth + 1, tick, role, note):
            out.append(dataclasses.replace(e, kind="start", name=name) if e.kind == "blocking" else e)
      elif opcode == "call":
        for callee in self.called(ln, "to_apply"):
          out += self.walk(callee, depth + 1, tick, role, note)
      elif opcode == "conditional":
        if tick is not None and role is None:  # the tick body's own conditionals
          evts, compute = self.tick_conditional(ln, depth, tick, top_conditionals, note)
          top_conditionals += compute
          out += evts
        else:
          out += self.conditional(ln, depth, tick, role, note)
    return out

  def loop(self, ln: _Line, depth: int, tick: int | None, role: str | None, note: bool) -> list[Event]:
    """A while loop's events repeated by its trip count; the pipeline's tick loop unrolled tick by tick."""
    body = next(iter(self.called(ln, "body")), None)
    count = self.trips.get(body, hlo.trip_count(ln.ins))
    pipeline = self.pipeline
    if (pipeline is not None and tick is None and body and count == pipeline.ticks
            and sum(1 for b in self.comps.get(body, []) if b.ins.opcode == "conditional") >= 2):
      per_tick = [self.walk(body, depth + 1, t, note=t == 0) for t in range(count)]
      inner = [e for evts in per_tick for e in evts]
      if inner:
        self.notes["loops"].append({"body": body, "trip_count": count, "pipeline_ticks": True,
                                    "collectives": sum(1 for e in inner if e.kind != "done")})
      return inner
    inner = self.walk(body, depth + 1, tick, role, note) if body else []
    if inner and note:  # a loop inside the pipeline's ticks: noted for the first tick only
      self.notes["loops"].append({"body": body, "trip_count": count,
                                  "collectives": sum(1 for e in inner if e.kind != "done")})
      self.notes["unknown_trip_counts"] += 0 if count is not None else 1
    return inner * (count or 1)

  @staticmethod
  def branches(ln: _Line) -> list[str]:
    """A conditional's branches. `lax.cond(pred, op, skip)`: the op is the true branch, printed last as
    `branch_computations={skip, op}` (XLA:CPU) or first as `true_computation=op, false_computation=skip`
    (XLA:GPU); names[-1] is it."""
    return _Walker.called(ln, "false_computation", "branch_computations", "true_computation")

  def tick_conditional(self, ln: _Line, depth: int, tick: int, top_conditionals: int, note: bool
                       ) -> tuple[list[Event], int]:
    """A conditional of the tick body, `lax.cond(run, op, skip)` (the op last): a transfer, kept on the ticks
    it runs, or the tick's forward (the first compute branch) or backward (the second), kept for the stages
    that run it. Returns the events and 1 for a compute branch (0 for a transfer)."""
    from microbench.models import pipeline_schedule as ps  # pylint: disable=g-import-not-at-top
    pipeline, names = self.pipeline, self.branches(ln)
    op = self.walk(names[-1], depth + 1, note=False)
    if op and all(e.op == "permute" for e in op if e.kind != "done"):
      # A transfer: forward if it sends to the next stage; on the ticks where some stage sends.
      a, b = next(e for e in op if e.kind != "done").pairs[0]
      s = pipeline.table.shape[1]
      forward = pipeline.stage_of[b] == (pipeline.stage_of[a] + 1) % s
      return (op if pipeline.sends[tick, 0 if forward else 1] else []), 0
    role = ("forward", "backward")[min(top_conditionals, 1)]
    col = ps.F_CHUNK if role == "forward" else ps.B_CHUNK
    stages = {d for d in range(self.s_count) if pipeline.table[tick, d, col] >= 0}
    return self.only(self.walk(names[-1], depth + 1, tick, role, note), stages), 1

  def conditional(self, ln: _Line, depth: int, tick: int | None, role: str | None, note: bool) -> list[Event]:
    """A conditional outside the tick body's top level: the head inside the tick's forward, or (anywhere
    else) the first branch with collectives standing for all (one branch runs)."""
    names = self.branches(ln)
    if tick is not None and role == "forward":  # the head, inside the forward: the last chunk's last stage
      from microbench.models import pipeline_schedule as ps  # pylint: disable=g-import-not-at-top
      pipeline = self.pipeline
      last = pipeline.table.shape[1] - 1
      runs = pipeline.table[tick, last, ps.F_CHUNK] == pipeline.virtual - 1
      return self.only(self.walk(names[-1], depth + 1, tick, role, note), {last} if runs else set())
    for callee in names:
      inner = self.walk(callee, depth + 1, tick, role, note)
      if inner:
        return inner
    return []


def _axes_of(group: Sequence[int], mesh_shape: tuple[int, ...], names: Sequence[str]) -> str:
  coords = np.array([np.unravel_index(d, mesh_shape) for d in group])
  varying = [names[i] for i in range(len(mesh_shape)) if len(set(coords[:, i])) > 1]
  return "+".join(varying) or "self"


def _comm(e: Event, group: tuple[int, ...], ranks_of_positions: Sequence[int], mesh_shape: tuple[int, ...],
          axis_names: Sequence[str], element_bytes: int) -> sch.Comm:
  """The schedule's collective for event `e` over one of its groups of device positions."""
  kind = _axes_of(group, mesh_shape, axis_names)
  ranks_in = tuple(ranks_of_positions[d] for d in group)
  pairs: tuple[tuple[int, int], ...] = ()
  if e.op == "permute":  # pairs of device positions -> positions within this group
    idx = {d: i for i, d in enumerate(group)}
    pairs = tuple(sorted((idx[a], idx[b]) for a, b in e.pairs if a in idx and b in idx))
  elements = max(1, e.nbytes // element_bytes)
  if e.op in ("all_gather", "reduce_scatter", "all_to_all"):
    elements = max(len(group), elements // len(group) * len(group))
  return sch.Comm(e.op, elements, sch.Group(kind, ranks_in), kind, pairs)


def schedule_from_events(evts: Sequence[Event], ranks_of_positions: Sequence[int], compute_s: float, name: str,
                         samples: int, mesh_shape: tuple[int, ...], axis_names: Sequence[str],
                         element_bytes: int = wl.BF16_BYTES, meta: dict | None = None) -> sch.JobSchedule:
  """Every rank's steps: compute split evenly around the collective events, each event over the rank's group."""
  gpus = len(ranks_of_positions)
  n_slots = sum(1 for e in evts if e.kind != "done") + 1
  per_slot = compute_s / n_slots
  ranks: list[tuple[sch.Step, ...]] = [()] * gpus
  # Each event's group of each device position, made once (looking it up per position was quadratic in ranks).
  group_of = [{d: g for g in e.groups for d in g} for e in evts]
  comms: dict[tuple[int, tuple[int, ...]], sch.Comm] = {}
  for pos in range(gpus):
    b: list[sch.Step] = []
    handles: dict[str, int] = {}
    counter = 0
    for e, where in zip(evts, group_of):
      if e.kind == "done":
        if e.name in handles:
          b.append(sch.Wait((handles.pop(e.name),), "wait"))
        continue
      group = where.get(pos)
      if group is None or len(group) < 2:
        continue
      key = (id(e), group)
      comm = comms.get(key)
      if comm is None:  # one Comm per event and group, shared by the group's members
        comm = comms[key] = _comm(e, group, ranks_of_positions, mesh_shape, axis_names, element_bytes)
      b.append(sch.Compute(per_slot, "step"))
      if e.kind == "start":
        counter += 1
        handles[e.name] = counter
        b.append(sch.Start(comm, counter))
      else:
        b.append(sch.Blocking(comm))
    b.append(sch.Compute(per_slot, "step"))
    if handles:
      b.append(sch.Wait(tuple(handles.values()), "end"))
    ranks[ranks_of_positions[pos]] = tuple(b)
  return sch.JobSchedule(name, gpus, samples, tuple(ranks), meta or {})


def parse_proxy_from(text: str) -> tuple[str, str | None, str]:
  """'llama3-8b,fsdp' -> ('llama3', '8b', 'fsdp'); ValueError with one line if malformed."""
  model, comma, strategy = text.partition(",")
  if not comma:
    raise ValueError(f"--proxy_from={text!r}: want MODEL,STRATEGY, e.g. llama3-8b,fsdp or gpt2-tiny,dp")
  family, _, size = model.strip().partition("-")
  return family, size or None, wl.strategy(strategy).name


def training_parallelism(strategy: str, gpus: int) -> str:
  """The study's degrees for `strategy` as a microbench-train --parallelism string."""
  return presets.parallelism(strategy, gpus)


@dataclasses.dataclass
class CompiledStep:
  """The training step of a derived proxy, compiled: its HLO text and what the schedule needs around it."""
  text: str
  proxy_from: str
  strategy: str
  parallelism: str
  batch: int
  spec: object  # models.ModelSpec
  mesh: object  # jax.sharding.Mesh
  axis_order: tuple[str, ...]
  params: int
  devices: list
  pipeline: PipelineTicks | None = None


def compile_step(proxy_from: str, gpus: int, *, batch: int | None = None, seq_len: int | None = None,
                 layers: int | None = None, devices: Sequence | None = None, compiler_options: dict | None = None,
                 dtype: str = "bfloat16") -> CompiledStep:
  """microbench-train's step for `proxy_from` ('MODEL,STRATEGY') laid out on `gpus` devices (default: every
  device, one per rank in process order), compiled ahead of time; ValueError (one line) on bad input."""
  import jax  # pylint: disable=g-import-not-at-top
  from microbench import train  # pylint: disable=g-import-not-at-top
  from microbench.models.optimizer import AdamWConfig, adamw  # pylint: disable=g-import-not-at-top
  from microbench.models.train_step import Trainer  # pylint: disable=g-import-not-at-top

  family, size, strategy = parse_proxy_from(proxy_from)
  parallelism = training_parallelism(strategy, gpus)
  devices = list(devices) if devices is not None else sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if len(devices) != gpus:
    raise ValueError(f"--proxy_from needs {gpus} devices to lay out the step, found {len(devices)}")
  global_batch = batch or wl.samples_per_iteration(strategy, gpus)
  pipelined = par.parse_parallelism(parallelism).degree("pp") > 1
  cfg = train.TrainConfig(model=family, size=size, layers=layers, parallelism=parallelism, batch=global_batch,
                          seq_len=seq_len, dtype=dtype, steps=2, warmup_steps=1, write=False, verbose=False,
                          compiler_options=compiler_options,
                          microbatches=wl.MICROBATCHES if pipelined else None,
                          schedule=presets.SCHEDULE if pipelined else None)
  try:
    p = train.plan(cfg, devices=devices)
  except train.ConfigError as e:
    raise ValueError(f"--proxy_from={proxy_from}: {e}") from None
  trainer = Trainer(p.spec, p.mesh, train.config.DTYPES[dtype], adamw(AdamWConfig()), global_batch, 0,
                    execution=p.execution())
  try:
    compiled, _ = gpu_compile.compile_for_target(trainer.compile_step, compiler_options)  # deviceless GEMM tiling
  except Exception as e:  # pylint: disable=broad-except
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    # XLA:TPU refuses a program larger than the chip's HBM (XLA:GPU compiles it and the fit says no)
    raise ValueError(f"--proxy_from={proxy_from}: XLA:TPU does not compile a step larger than the chip's memory"
                     f" ({str(e).strip().splitlines()[0][:200]}); derive the schedule from fewer --layers (the"
                     " per-layer collectives are the same) or a smaller --batch") from None
  text = compiled.as_text()
  ticks = None
  if p.stages > 1:
    from microbench.models import pipeline, pipeline_schedule  # pylint: disable=g-import-not-at-top
    sched = pipeline.schedule(p.schedule, p.stages, p.microbatches, cfg.virtual_stages)
    names = list(p.mesh.axis_names)
    shape = tuple(int(p.mesh.shape[a]) for a in names)
    stage_of = tuple(int(np.unravel_index(i, shape)[names.index("stage")]) for i in range(p.mesh.size))
    ticks = PipelineTicks(sched.table, pipeline_schedule.sends(sched), stage_of, sched.virtual)
  return CompiledStep(text, proxy_from, strategy, parallelism, global_batch, p.spec, p.mesh, p.axis_order,
                      trainer.num_params, devices, ticks)


def from_step(step: CompiledStep, gpu: str = "A100") -> sch.JobSchedule:
  """The derived schedule of a compiled step (see the module docstring)."""
  gpus = len(step.devices)
  evts, notes = events(step.text, gpus, step.pipeline)
  position_rank = [step.devices.index(d) for d in step.mesh.devices.flat]
  flops = step.spec.step_flops(step.batch)
  meta = {"strategy": step.strategy, "proxy_from": step.proxy_from, "model": f"{step.spec.family}-{step.spec.size}",
          "parallelism": step.parallelism, "batch": step.batch,
          "pipeline": None if step.pipeline is None else {"schedule": presets.SCHEDULE, "ticks": step.pipeline.ticks,
                                                          "microbatches": wl.MICROBATCHES}, "seq_len": step.spec.seq_len, "params": step.params,
          "step_flops": flops, "gpu": wl.gpu(gpu).name, "platform": step.devices[0].platform,
          "events": sum(1 for e in evts if e.kind != "done"), "hlo_notes": notes,
          "mesh": {a: int(step.mesh.shape[a]) for a in step.axis_order}}
  return schedule_from_events(evts, position_rank, flops / gpus / wl.gpu(gpu).peak_flops, f"derived {step.proxy_from}",
                              step.batch, tuple(int(step.mesh.shape[a]) for a in step.mesh.axis_names),
                              list(step.mesh.axis_names), meta=meta)


def derive(proxy_from: str, gpus: int, *, gpu: str = "A100", batch: int | None = None, seq_len: int | None = None,
           layers: int | None = None, devices: Sequence | None = None, compiler_options: dict | None = None,
           dtype: str = "bfloat16") -> sch.JobSchedule:
  """The derived schedule of `proxy_from` ('MODEL,STRATEGY') on `gpus` ranks; ValueError on bad input."""
  return from_step(compile_step(proxy_from, gpus, batch=batch, seq_len=seq_len, layers=layers, devices=devices,
                                compiler_options=compiler_options, dtype=dtype), gpu)


def compare(hand: sch.JobSchedule, derived: sch.JobSchedule) -> dict:
  """Bytes per iteration and rank (rank 0 and the largest over ranks) of the two schedules, by op."""
  def per_op(job: sch.JobSchedule, rank: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in job.comms(rank):
      out[c.op] = out.get(c.op, 0) + sch.sent_bytes(c, rank)
    return out
  h0, d0 = per_op(hand, 0), per_op(derived, 0)
  th, td = sum(h0.values()), sum(d0.values())
  return {"hand": {"schedule": hand.name, "bytes_rank0": h0, "total_rank0": th},
          "derived": {"schedule": derived.name, "bytes_rank0": d0, "total_rank0": td, "meta": derived.meta},
          "difference_bytes": td - th, "ratio": (td / th) if th else None}
