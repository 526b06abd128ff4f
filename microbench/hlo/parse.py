"""Reading compiled HLO text: collective instructions (opcode, result type, replica groups), the
computations they sit in, while loops with their trip counts, and how often each computation runs.

Shared by the benchmark's HLO check (microbench.bench.hlo_check) and the training step's communication
fingerprint (microbench.train.comm_fingerprint): both must see what XLA really compiled, not what the
program asked for.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from microbench.fabric import torus

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
        "collective-broadcast", "ragged-all-to-all")
OPS = _OPS  # the collective opcodes this reader knows (without -start/-done)
# `%name = type op(` and the async `op-start(` forms; the type may be a tuple with spaces and comments.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s(?P<op>" + "|".join(_OPS) +
                    r")(?P<start>-start)?\((?P<rest>.*)$")


@dataclasses.dataclass(frozen=True)
class HloCollective:
  op: str
  groups: tuple[tuple[int, ...], ...]  # replica groups, or source->target pairs for collective-permute
  text: str
  element_types: tuple[str, ...] = ()  # of the result (outputs only, for async -start forms)
  elements: int = 0                    # result elements per device, summed over tuple parts
  computation: str = ""                # the computation the instruction sits in
  emitted: str = ""                    # the opcode as compiled: `all-reduce-start` on GPU, `all-reduce` on CPU
  sync: bool | None = None             # an async start XLA:GPU runs synchronously (`"is_sync":true`); None: no say


def _parse_list_of_lists(text: str) -> tuple[tuple[int, ...], ...]:
  return tuple(tuple(int(v) for v in g.split(",") if v.strip()) for g in re.findall(r"\{([\d,\s]*)\}", text))


def parse_iota_groups(text: str) -> tuple[tuple[int, ...], ...]:
  """Expands XLA's iota replica-group form `[G,S]<=[d0,d1,...]T(p0,p1,...)`."""
  m = re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
  if not m:
    raise ValueError(f"unrecognised replica groups {text!r}")
  g, s = int(m.group(1)), int(m.group(2))
  dims = [int(d) for d in m.group(3).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(4):
    ids = ids.transpose([int(p) for p in m.group(4).split(",")])
  return tuple(tuple(int(v) for v in row) for row in ids.reshape(g, s))


_DEVICE_IDS = r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
_MESH_GROUPS = re.compile(r"mesh\[([^\]]*)\]" + _DEVICE_IDS + r"\s*\{([^}]*)\}")


def parse_mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
  """Expands the named-mesh replica-group form `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`: device ids laid out
  row-major over the mesh (or as its `device_ids=([dims]T(perm))` iota says), one group per combination of the
  other axes, members along the named axes."""
  m = _MESH_GROUPS.fullmatch(text.strip())
  if not m:
    raise ValueError(f"unrecognised replica groups {text!r}")
  sizes = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
  names = [k for k, _ in sizes]
  grouped = re.findall(r"'([^']+)'", m.group(4))
  if not sizes or any(g not in names for g in grouped):
    raise ValueError(f"unrecognised replica groups {text!r}")
  ids = np.arange(int(np.prod([v for _, v in sizes])))
  if m.group(2):
    dims = [int(d) for d in m.group(2).split(",")]
    if int(np.prod(dims)) != ids.size:
      raise ValueError(f"unrecognised replica groups {text!r}")
    ids = ids.reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(p) for p in m.group(3).split(",")])
  ids = ids.reshape([v for _, v in sizes])
  order = [i for i, k in enumerate(names) if k not in grouped] + [names.index(g) for g in grouped]
  size = int(np.prod([dict(sizes)[g] for g in grouped])) if grouped else 1
  return tuple(tuple(int(v) for v in row) for row in ids.transpose(order).reshape(-1, size))


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One collective instruction line: its opcode (without `-start`), result type and operand text."""
  op: str
  type_text: str
  async_start: bool
  rest: str
  line: str


def instructions(hlo_text: str) -> list[Instruction]:
  """Every collective instruction of an HLO module (async `-start` forms once, `-done` not at all)."""
  out = []
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if m:
      out.append(Instruction(m.group("op"), m.group("type"), bool(m.group("start")), m.group("rest"), line))
  return out


def module_devices(hlo_text: str) -> int | None:
  """Devices the module runs on, from its header (`num_partitions=16`), None when the text has no header."""
  found = [int(v) for v in re.findall(r"\b(?:num_partitions|replica_count)=(\d+)", hlo_text.split("\n", 1)[0])]
  return max(found) if found and hlo_text.startswith("HloModule") else None


def output_aliases(hlo_text: str) -> dict[tuple[int, ...], int]:
  """The module's `input_output_alias`: output index (() for a single result, (i,) for tuple element i) -> the
  parameter number whose buffer it takes (donation XLA honoured)."""
  m = re.search(r"input_output_alias=\{(.*?)\}\s*(?:,\s*\w+=|$)", hlo_text.split("\n", 1)[0])
  if not m:
    return {}
  out = {}
  for index, param in re.findall(r"\{([\d,\s]*)\}:\s*\((\d+),", m.group(1)):
    out[tuple(int(v) for v in index.split(",") if v.strip())] = int(param)
  return out


def find_collectives(hlo_text: str) -> list[HloCollective]:
  """Every collective instruction with its groups; `replica_groups={}` (XLA's "all devices") is expanded to
  the module's devices when its header says how many there are."""
  out = []
  where = {}
  for comp in computations(hlo_text).values():
    for line in comp.lines:
      where[line] = comp.name
  everyone = module_devices(hlo_text)
  for ins in instructions(hlo_text):
    op, rest, line = ins.op, ins.rest, ins.line
    if op == "collective-permute":
      groups = source_target_pairs(rest)
    else:
      groups = replica_groups(rest)
      if not groups and everyone:
        groups = (tuple(range(everyone)),)
    types, elements = result_arrays(ins.type_text, op if ins.async_start else None)
    sync = re.search(r'"is_sync"\s*:\s*(true|false)', rest)
    out.append(HloCollective(op, groups, line.strip(), tuple(types), elements, where.get(line, ""),
                             op + ("-start" if ins.async_start else ""),
                             None if sync is None else sync.group(1) == "true"))
  return out


# What an async `-start` returns, as XLA:GPU prints it: all-reduce-start its outputs only (`bf16[N]`, or a
# tuple of outputs when combined); every other start a tuple whose element 1 holds the outputs:
# all-gather `(operand, output)`, collective-permute `(operand, output, u32[], u32[])`, reduce-scatter,
# all-to-all and collective-broadcast `((operands), output)`, combined ones `((operands...), (outputs...))`;
# copy-start `(destination, source, u32[])` (element 0).
_OUTPUTS_WHOLE = ("all-reduce",)


def source_target_pairs(rest: str) -> tuple[tuple[int, ...], ...]:
  """A collective-permute's (source, target) pairs (the text after its opcode)."""
  pm = re.search(r"source_target_pairs=(\{(?:\{[\d,\s]*\},?)*\})", rest)
  return _parse_list_of_lists(pm.group(1)) if pm else ()


def replica_groups(rest: str) -> tuple[tuple[int, ...], ...]:
  """The replica groups of an instruction (the text after its opcode), in any of XLA's printed forms
  (explicit, iota, named mesh); () when it has none (`{}`: all devices)."""
  gm = re.search(r"replica_groups=(\{(?:\{[\d,\s]*\},?)*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|"
                 r"mesh\[[^\]]*\](?:,\s*device_ids=\(\[[\d,]+\](?:T\([\d,]+\))?\))?\s*\{[^}]*\})", rest)
  if not gm:
    return ()
  if gm.group(1).startswith("mesh"):
    return parse_mesh_groups(gm.group(1))
  if gm.group(1).startswith("["):
    return parse_iota_groups(gm.group(1))
  return tuple(g for g in _parse_list_of_lists(gm.group(1)) if g)  # `{}`: no groups (all devices)


def split_tuple(type_text: str) -> list[str] | None:
  """The top-level elements of a tuple type `(a, (b, c), d[])`, None when the text is not a tuple."""
  text = type_text.strip()
  if not text.startswith("("):
    return None
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0:
        parts.append(text[start:i])
        break
    elif ch == "," and depth == 1:
      parts.append(text[start:i])
      start = i + 1
  return [q.strip() for q in parts if q.strip()]


def _result(type_text: str, async_op: str | None) -> list[tuple[str, str]]:
  """(element type, dims) of each array of a result type; `async_op`: the opcode (without `-start`) of an
  async start, of whose result only the outputs count (see _OUTPUTS_WHOLE above)."""
  if async_op and async_op not in _OUTPUTS_WHOLE:
    parts = split_tuple(type_text)
    if parts and len(parts) >= 2:
      type_text = parts[0] if async_op == "copy" else parts[1]
  return _ARRAY.findall(type_text)


def _count(dims: str) -> int:
  return int(np.prod([int(d) for d in dims.split(",") if d] or [1]))


def result_arrays(type_text: str, async_op: str | None = None) -> tuple[list[str], int]:
  """Element types and total element count of an instruction's result; `async_op`: the opcode of an async
  start (`all-gather` for `all-gather-start`), of whose result only the outputs count."""
  arrays = _result(type_text, async_op)
  return [dt for dt, _ in arrays], sum(_count(dims) for _, dims in arrays)


def moved_parts(ins: Instruction) -> list[tuple[str, int]]:
  """(element type, bytes) of each array a collective delivers per device: its result, outputs only for the
  async starts that also return their operands (the one convention the fingerprint and the derived proxies
  count bytes by)."""
  arrays = _result(ins.type_text, ins.op if ins.async_start else None)
  return [(dt, _BYTES[dt] * _count(dims)) for dt, dims in arrays if dt in _BYTES]


@dataclasses.dataclass(frozen=True)
class Computation:
  name: str
  lines: tuple[str, ...]
  entry: bool


_COMP_HEAD = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\))?\s*->\s*.*\{\s*$")


def computations(hlo_text: str) -> dict[str, Computation]:
  """Every computation of a module, by name, with its instruction lines."""
  out: dict[str, Computation] = {}
  current, entry, lines = None, False, []
  for line in hlo_text.splitlines():
    if current is None:
      m = _COMP_HEAD.match(line)
      if m:
        current, entry, lines = m.group("name"), bool(m.group("entry")), []
    elif line.strip().startswith("}"):  # `}` or `}, execution_thread="..."`
      out[current] = Computation(current, tuple(lines), entry)
      current = None
    else:
      lines.append(line)
  return out


_INSTR_ANY = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s"
                        r"(?P<opcode>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_CALLEE = re.compile(r"\b(calls|body|condition|true_computation|false_computation|to_apply)=%?([\w.\-]+)")
_CALLEES = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Instr:
  """Any instruction line: name, opcode, result type text, the rest of the line."""
  name: str
  opcode: str
  type_text: str
  rest: str
  line: str


def parse_instruction(line: str) -> Instr | None:
  m = _INSTR_ANY.match(line)
  if not m:
    return None
  return Instr(m.group("name"), m.group("opcode"), m.group("type"), m.group("rest"), line)


@dataclasses.dataclass(frozen=True)
class WhileLoop:
  computation: str  # where the while instruction is
  body: str
  condition: str
  trip_count: int | None  # XLA's known_trip_count, None when the loop has none
  line: str


def while_loops(hlo_text: str, comps: dict[str, Computation] | None = None) -> list[WhileLoop]:
  comps = comps if comps is not None else computations(hlo_text)
  out = []
  for comp in comps.values():
    for line in comp.lines:
      ins = parse_instruction(line)
      if ins is None or ins.opcode != "while":
        continue
      called = dict(_CALLEE.findall(ins.rest))
      out.append(WhileLoop(comp.name, called.get("body", ""), called.get("condition", ""),
                           loop_trip_count(ins, comp, comps), line.strip()))
  return out


def _defs(comp: Computation) -> dict[str, Instr]:
  out = {}
  for line in comp.lines:
    ins = parse_instruction(line)
    if ins is not None:
      out[ins.name] = ins
  return out


def operands(ins: Instr) -> list[str]:
  """The instruction's operand names, in order (the `%name`s before its attributes)."""
  depth, end = 0, len(ins.rest)
  for i, ch in enumerate(ins.rest):  # the operand list ends at the `)` matching the opcode's `(`
    depth += ch == "("
    if ch == ")":
      if depth == 0:
        end = i
        break
      depth -= 1
  return re.findall(r"%([\w.\-]+)", ins.rest[:end])


def _constant(name: str, defs: dict[str, Instr]) -> int | None:
  """The integer a scalar resolves to through copies and bitcasts, None when it is not a constant."""
  for _ in range(8):
    ins = defs.get(name)
    if ins is None:
      return None
    if ins.opcode == "constant":
      m = re.match(r"\s*(-?\d+)\)", ins.rest)
      return int(m.group(1)) if m else None
    if ins.opcode not in ("copy", "bitcast", "convert") or not operands(ins):
      return None
    name = operands(ins)[0]
  return None


def _induction(comp: Computation, index: int) -> int | None:
  """The step a loop body adds to tuple element `index` (add(gte(param, index), constant)), else None."""
  defs = _defs(comp)
  root = next((parse_instruction(l) for l in comp.lines if l.strip().startswith("ROOT")), None)
  ops = operands(root) if root is not None and root.opcode == "tuple" else []
  if index >= len(ops) or ops[index] not in defs or defs[ops[index]].opcode != "add":
    return None
  a, b = (operands(defs[ops[index]]) + [None, None])[:2]
  for x, y in ((a, b), (b, a)):
    g = defs.get(x)
    for _ in range(8):  # XLA:TPU may copy the counter (into another memory space) before stepping it
      if g is None or g.opcode not in ("copy", "bitcast") or not operands(g):
        break
      g = defs.get(operands(g)[0])
    if g is not None and g.opcode == "get-tuple-element" and f"index={index}" in g.rest:
      return _constant(y, defs)
  return None


def loop_trip_count(ins: Instr, caller: Computation, comps: dict[str, Computation]) -> int | None:
  """A while loop's trip count: XLA's known_trip_count where the compiler kept it (XLA:CPU, XLA:GPU), else
  read from the loop itself (XLA:TPU's optimised HLO drops the annotation): a condition `i < N` on a tuple
  element that starts at a constant and that the body steps by a constant. None when neither says."""
  known = trip_count(ins)
  if known is not None:
    return known
  called = dict(_CALLEE.findall(ins.rest))
  cond = comps.get(called.get("condition", ""))
  body = comps.get(called.get("body", ""))
  if cond is None or body is None:
    return None
  cdefs = _defs(cond)
  root = next((parse_instruction(l) for l in cond.lines if l.strip().startswith("ROOT")), None)
  if root is None or root.opcode != "compare" or "direction=LT" not in root.rest:
    return None
  lhs, rhs = (operands(root) + [None, None])[:2]
  gte, limit = cdefs.get(lhs), _constant(rhs, cdefs)
  m = re.search(r"index=(\d+)", gte.rest) if gte is not None and gte.opcode == "get-tuple-element" else None
  if m is None or limit is None:
    return None
  index = int(m.group(1))
  init = _defs(caller).get((operands(ins) or [""])[0])
  start = _constant(operands(init)[index], _defs(caller)) if init is not None and init.opcode == "tuple" and len(
      operands(init)) > index else None
  step = _induction(body, index)
  if start is None or not step or step < 0:
    return None
  return max(0, -(-(limit - start) // step))


def trip_count(ins: Instr) -> int | None:
  """A while instruction's known trip count (XLA's WhileLoopTripCountAnnotator), None when it has none."""
  trip = _TRIP.search(ins.rest)
  return int(trip.group(1)) if trip else None


def callees(ins: Instr) -> list[tuple[str, str]]:
  """(kind, computation) pairs this instruction runs; reductions' `to_apply` (a `call`'s or an async
  `call-start`'s is its callee) and
  async -done/-update (which name the computation their -start already runs) are left out."""
  if ins.opcode.endswith("-done") or ins.opcode.endswith("-update"):
    return []
  out = [(k, c) for k, c in _CALLEE.findall(ins.rest) if k != "to_apply" or ins.opcode in ("call", "call-start")]
  for k, names in _CALLEES.findall(ins.rest):
    out += [(k, c.strip().lstrip("%")) for c in names.split(",") if c.strip()]
  return out


_BRANCHES = ("branch_computations", "true_computation", "false_computation")


def _calls(comps: dict[str, Computation]) -> list[tuple[str, str, str, int | None]]:
  """(caller, kind, callee, trip count of a while body, else None) for every call between computations,
  loop conditions left out: the one walk both views of loop counts below share."""
  out = []
  for comp in comps.values():
    for line in comp.lines:
      ins = parse_instruction(line)
      if ins is None:
        continue
      trip = loop_trip_count(ins, comp, comps) if ins.opcode == "while" else None
      for kind, callee in callees(ins):
        if kind != "condition":
          out.append((comp.name, kind, callee, trip if kind == "body" else None))
  return out


def execution_counts(hlo_text: str, comps: dict[str, Computation] | None = None) -> dict[str, int | None]:
  """How many times each computation runs per execution of the module, following while bodies (times the
  loop's known trip count), fusions, calls and async computations from the entry. None: unknown (a while
  without known trip count, or a conditional branch, on the way). `comps`: the module's computations, when
  the caller has them already."""
  comps = comps if comps is not None else computations(hlo_text)
  calls: dict[str, list[tuple[str, str, int | None]]] = {}
  for caller, kind, callee, trip in _calls(comps):
    calls.setdefault(caller, []).append((kind, callee, trip))
  counts: dict[str, int | None] = {}

  def visit(name: str, times: int | None, depth: int = 0) -> None:
    if name not in comps or depth > 64:
      return
    prev = counts.get(name, 0)
    counts[name] = None if prev is None or times is None else prev + times
    for kind, callee, trip in calls.get(name, []):
      factor = trip if kind == "body" else None if kind in _BRANCHES else 1
      visit(callee, None if times is None or factor is None else times * factor, depth + 1)

  for comp in comps.values():
    if comp.entry:
      visit(comp.name, 1)
  return counts


def reachable(hlo_text: str, root: str, comps: dict[str, Computation] | None = None) -> set[str]:
  """Computations run from `root` (itself included), reductions' `to_apply` left out."""
  comps = comps if comps is not None else computations(hlo_text)
  seen, todo = set(), [root]
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for line in comps[name].lines:
      ins = parse_instruction(line)
      if ins is not None:
        todo += [c for _, c in callees(ins)]
  return seen


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")


def group_size(rest: str, num_devices: int) -> int:
  """Devices per replica group, from any of XLA's printed forms (`{}` means all devices)."""
  try:
    groups = replica_groups(rest)
  except ValueError:  # a form this parser doesn't know: the whole program's devices
    return num_devices
  return len(groups[0]) if groups and groups[0] else num_devices


# ---------------------------------------------------------------------------------------------------------
# Instruction lines placed in their loops: the communication fingerprint's view, which takes a loop without a
# known trip count (and a conditional branch) once and flags the loop, where `execution_counts` says None.

@dataclasses.dataclass(frozen=True)
class Loop:
  """A while loop: its body computation and XLA's known trip count (None: not known at compile time)."""
  body: str
  trip_count: int | None
  times: int  # how many times the loop itself runs per module execution (1 unless nested)


@dataclasses.dataclass(frozen=True)
class Placed:
  """An instruction line with its computation and how many times it runs per module execution."""
  line: str
  computation: str
  runs: int
  loop: str | None  # innermost while body it sits in (directly or through calls), None at top level


def placed_lines(hlo_text: str) -> tuple[list[Placed], list[Loop]]:
  """Every instruction line with its run count per execution of the module, and the module's loops.

  A while body runs `known_trip_count` times per run of its while (XLA's WhileLoopTripCountAnnotator);
  a loop without a known count is taken once and reported with `trip_count=None`. Called computations
  (fusions, async wrappers, conditional branches) run once per call. Text without computation
  headers (a fragment) counts every line once.
  """
  comps = computations(hlo_text)
  if not comps:
    return [Placed(line, "", 1, None) for line in hlo_text.splitlines()], []
  entry = next((c.name for c in comps.values() if c.entry), None)
  callers: dict[str, list[tuple[str, int, bool]]] = {}  # callee -> [(caller, factor, is_loop_body)]
  trips: dict[str, int | None] = {}
  for caller, kind, callee, trip in _calls(comps):
    if kind == "body":
      trips[callee] = trip
    callers.setdefault(callee, []).append((caller, (trip or 1) if kind == "body" else 1, kind == "body"))

  runs: dict[str, int] = {}
  loop_of: dict[str, str | None] = {}

  def visit(name: str, stack: tuple[str, ...] = ()) -> int:
    if name in runs:
      return runs[name]
    if name == entry or name not in callers or name in stack:
      runs[name], loop_of[name] = (1 if name == entry else 0), None
      return runs[name]
    total, loop = 0, None
    for caller, factor, is_body in callers[name]:
      total += visit(caller, stack + (name,)) * factor
      loop = loop or (name if is_body else loop_of.get(caller))
    runs[name], loop_of[name] = total, loop
    return total

  placed = []
  for name, comp in comps.items():
    n = visit(name)
    placed.extend(Placed(line, name, n, loop_of[name]) for line in comp.lines)
  loops = [Loop(body, trip, visit(body) // (trip or 1)) for body, trip in trips.items() if body in comps]
  return placed, loops


# A collective across TPU slices is not an HLO collective: XLA:TPU sends it to the Megascale runtime, which
# moves it over the data-center network, as a host-transfer `send` (and its `recv`) whose frontend attributes
# name the collective (`_xla_megascale_transfer_type`) and its reduction.
MEGASCALE_OPS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
                 "ALL_TO_ALL": "all-to-all", "ONE_TO_ONE": "collective-permute"}
_MEGASCALE_SEND = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\ssend\((?P<rest>.*)$")


@dataclasses.dataclass(frozen=True)
class DcnTransfer:
  """One collective across slices as XLA:TPU hands it to the Megascale runtime (its `send`; the `recv` pairs)."""
  transfer: str          # ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, ONE_TO_ONE (or what libtpu says)
  op: str                # the HLO collective it stands for ("" when the transfer type is not one of those)
  reduction: str | None  # SUM, MAX ... for reductions
  elements: int          # elements the send carries per device
  element_types: tuple[str, ...]
  computation: str
  line: str


def megascale_transfers(hlo_text: str) -> list[DcnTransfer]:
  """Every Megascale (DCN) collective of a module: host-transfer sends handled by `xla_megascale_runtime`."""
  out = []
  for comp in computations(hlo_text).values():
    for line in comp.lines:
      m = _MEGASCALE_SEND.match(line)
      if not m or "xla_megascale_runtime" not in m.group("rest"):
        continue
      kind = re.search(r'_xla_megascale_transfer_type="?(\w+)', m.group("rest"))
      red = re.search(r'_xla_megascale_reduce_operation="?(\w+)', m.group("rest"))
      parts = split_tuple(m.group("type")) or [m.group("type")]
      types, elements = result_arrays(parts[0])
      transfer = kind.group(1) if kind else "UNKNOWN"
      out.append(DcnTransfer(transfer, MEGASCALE_OPS.get(transfer, ""), red.group(1) if red else None, elements,
                             tuple(types), comp.name, line.strip()))
  return out


def algorithm_config(line: str) -> dict[str, object] | None:
  """The algorithm XLA:TPU chose for a collective, from its backend_config's `collective_algorithm_config`: the
  emitter (`RotatedPincerShortEmitter`, `1DAllGatherOnMajorDim` ...), the strategy (`StrategyND`) and, where its
  debug text says, the torus dimension sizes it runs over (`dim_sizes`), which it uses (`active_dims`, a digit
  per dimension) and its colours (microbench.fabric.torus reads the text). None on XLA:GPU and XLA:CPU."""
  alg = torus.parse_xla_algorithm(line)
  if alg is not None:
    out = {"emitter": alg.emitter, "strategy": alg.strategy, "dim_sizes": list(alg.dim_sizes),
           "active_dims": alg.active_dims, "colors": alg.colors}
    return {k: v for k, v in out.items() if v not in (None, "", [])}
  m = re.search(r'"collective_algorithm_config"\s*:\s*\{([^{}]*)\}', line)  # a config without debug text
  if not m:
    return None
  out = {k: v.group(1) for k in ("emitter", "strategy") if (v := re.search(rf'"{k}"\s*:\s*"([^"]*)"', m.group(1)))}
  return out or None
