"""The benchmark's HLO check: the compiled program runs the intended collective, on the intended data, the
intended number of times, back to back on the device, and nothing else.

XLA drops degenerate collectives, merges small ones, promotes types and may rewrite others; a wrong
PartitionSpec silently measures something else; a loop whose trip count is only known at run time makes
XLA's GPU runtime copy the loop condition to the host and synchronise on every repetition; a loop carry
that holds an output twice adds a copy of the whole buffer to every repetition. So every program is
checked against what it must be:

- the op is present over exactly the scope's groups (or ring pairs), in group-rank order where the output
  order depends on it (all-gather, reduce-scatter, all-to-all, collective-broadcast), and no other
  collective is;
- its element type is the dtype's, or on CPU a wider one XLA runs it in (16-bit collectives as float32):
  that is reported as the wire dtype, never passed silently; on GPUs the dtype must stay as asked;
- its per-device element count is the collective's output count;
- it executes exactly the intended number of times per call, counted through while loops by their
  `known_trip_count` (a loop without one fails), and, in a timed loop program, inside the loop;
- no instruction besides the collective writes a buffer of the message's size in a timed program (judged by
  the bytes each instruction writes, not by its opcode: a copy, or a slice, concatenate, convert or reverse
  fusion; an in-place dynamic-update-slice writes only its update); what the loop body writes besides the
  collective is reported;
- in place (nccl-tests' in-place columns), the program's result takes its donated input's buffer
  (`input_output_alias`), and where XLA runs the op itself out of place, the copy of the message back into
  that buffer is counted (`copies`), not hidden: it is what an in-place call costs in XLA;
- with `--command_buffer` on a GPU, the collective (and the timed loop) runs inside a command buffer when one
  was asked and outside when not (`verify_command_buffer`, read from XLA:GPU's thunk sequence, not the HLO).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from microbench.hlo import parse, thunks
from microbench.hlo.parse import HloCollective, find_collectives

HLO_TYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32", "float8_e4m3fn": "f8e4m3fn",
            "float8_e5m2": "f8e5m2"}
DTYPE_OF = {v: k for k, v in HLO_TYPE.items()}
WIDER = {"bf16": ("f32",), "f16": ("f32",), "f8e4m3fn": ("f16", "f32"), "f8e5m2": ("f16", "f32")}  # XLA:CPU widens


def _bits_of(hlo_type: str) -> str:
  """The unsigned integer type of an HLO type's width (`f8e5m2` -> `u8`, `bf16` -> `u16`, `s32` -> `u32`)."""
  return "u" + re.match(r"[a-z]+(\d+)", hlo_type).group(1)


class HloMismatch(RuntimeError):
  """The compiled program does not run the collective the benchmark intends to time."""


@dataclasses.dataclass(frozen=True)
class Expectation:
  """What one compiled program must contain."""
  op: str                  # HLO opcode
  groups: np.ndarray       # [num_groups, n] device ids in group-rank order
  ordered: bool            # compare each group's order, not only its members
  dtype: str               # the benchmark's dtype name
  elements: int            # result elements per device of one op
  executions: int          # op executions per call
  in_loop: bool = False    # the executions must come from a while loop with a known trip count
  outside_max: int = 0     # executions allowed outside loops (a peeled repetition) when in_loop
  copy_limit: int | None = None  # fail on any copy of at least this many elements
  widen_ok: bool = True    # the platform may run 16-bit collectives in float32 (XLA:CPU); never on GPUs
  bits_ok: bool = False    # an emulation moving the dtype's bits: the op may run on unsigned integers of its width
  # The platform's form of the op writes the message besides the collective (XLA:CPU's tuple all-to-all:
  # slices and a concatenate; the masked all-reduce standing in for a broadcast: a select; float32 converts
  # around a widened 16-bit collective): there only copies fail; the writes are still reported.
  writes_are_the_op: bool = False
  # False for a program that is never timed (a checked twin: the same repetitions with every output digested):
  # its writes are reported (Verified.body_writes), none fails; the op, groups, dtype and executions are checked.
  strict_writes: bool = True
  # In place: the first result must take the first parameter's buffer (donated, `input_output_alias`), and
  # message-sized copies (an op XLA runs out of place, its output copied back into that buffer) are counted
  # in Verified.copies instead of failing.
  aliased: bool = False
  # XLA:TPU: its memory-space assignment stages operands and results in the chip's on-chip memory (VMEM, memory
  # space S(1)), and around the timed loop it re-tiles buffers (copies, reshapes, transposes) and, for small
  # all-to-alls, reduces an expanded form of the op's result: counted (Verified.staged), not failed, where they
  # write into on-chip memory or happen once per call outside the loop (the difference of the short and long
  # timed programs cancels them). A message-sized write into HBM on every repetition still fails.
  onchip_staging: bool = False
  # Other forms the platform writes the op in, (opcode, elements per device): XLA:TPU writes an all-gather as an
  # all-reduce of a zero-padded buffer and a reduce-scatter as an all-reduce and a slice. Checked as that op over
  # the same groups, and said (Verified.written_as).
  rewrites: tuple[tuple[str, int], ...] = ()
  # The ragged all-to-all's size and offset tables (XLA:GPU's ragged-all-to-all takes four of n entries each,
  # converted to s64): writes of exactly this many index elements made from nothing larger are the op's operands
  # (a message below n elements is smaller than them). None: no tables.
  tables: int | None = None
  # Several TPU slices (multislice): chips per slice. XLA:TPU compiles one slice's program, its groups in
  # slice-local ids; a scope inside a slice is checked on slice 0's groups, one across slices as Megascale (DCN)
  # transfers (`verify_dcn`). None: one slice, or not a TPU.
  slice_devices: int | None = None


@dataclasses.dataclass(frozen=True)
class Verified:
  match: HloCollective
  wire_dtype: str          # the dtype the op runs in on this platform
  executions: int
  trip_counts: tuple[int, ...]  # of the loops the op runs in
  in_loop: int = 0         # executions per call that run inside loops with a known trip count
  emitted: tuple[str, ...] = ()  # the op's opcodes as compiled (`all-reduce-start` ...)
  sync_starts: int = 0     # async starts XLA:GPU marked to run synchronously
  body_writes: int | None = None  # elements the loop body writes besides the collective, per trip
  copies: int | None = None  # in place: message-sized copies per call (0: the op itself ran in place)
  staged: int | None = None  # XLA:TPU: message-sized staging copies (on-chip memory, once per call) per call
  # elements per call the platform's form of the op writes besides the collective (XLA:TPU's re-tiling of its
  # operand or result in HBM, a split op's merge, XLA:CPU's tuple all-to-all and widening converts, the padded
  # buffer of an all-gather written as an all-reduce): part of what the point measures (sweep.form)
  form_writes: int | None = None
  written_as: str | None = None  # the platform's own form of the op (`rewrites`), e.g. "all-gather as all-reduce"
  packed_in: str | None = None  # XLA:TPU: an 8- or 16-bit reduction's elements travel packed in this word type
  unaliased: bool = False  # in place asked, but XLA:TPU gave the result a buffer of its own (out of place)
  dcn: dict | None = None  # across TPU slices: the Megascale transfers per call and the ICI collectives beside them
  # XLA:GPU's command buffers as compiled (verify_command_buffer): asked, and how many of the collectives and
  # loops run inside one; None where the thunk sequence was not read
  command_buffer: dict | None = None

  def facts(self) -> dict:
    """The record's view: what ran, as compiled."""
    return {"op_emitted": sorted(set(self.emitted)), "executions": self.executions,
            "executions_in_loop": self.in_loop, "trip_counts": sorted(set(self.trip_counts)),
            "sync_starts": self.sync_starts, "wire_dtype": self.wire_dtype, "body_writes": self.body_writes,
            **({"inplace_copies": self.copies} if self.copies is not None else {}),
            **({"staging_copies": self.staged} if self.staged is not None else {}),
            **({"form_writes": self.form_writes} if self.form_writes else {}),
            **({"written_as": self.written_as} if self.written_as else {}),
            **({"packed_in": self.packed_in} if self.packed_in else {}),
            **({"inplace_unaliased": True} if self.unaliased else {}),
            **({"dcn": self.dcn} if self.dcn else {}),
            **({"algorithm": algo} if (algo := parse.algorithm_config(self.match.text)) else {}),
            **({"command_buffer": self.command_buffer} if self.command_buffer is not None else {})}


def expected_groups(op: str, groups: np.ndarray, ordered: bool = False) -> frozenset:
  """Canonical form of what `op` over `groups` ([num_groups, n] of device ids) must show in HLO."""
  if op == "collective-permute":
    n = groups.shape[1]
    return frozenset((int(g[i]), int(g[(i + 1) % n])) for g in groups for i in range(n))
  if ordered:
    return frozenset(tuple(int(v) for v in g) for g in groups)
  return frozenset(frozenset(int(v) for v in g) for g in groups)


def _canonical(c: HloCollective, ordered: bool) -> frozenset:
  if c.op == "collective-permute":
    return frozenset(tuple(p) for p in c.groups)
  if ordered:
    return frozenset(tuple(g) for g in c.groups)
  return frozenset(frozenset(g) for g in c.groups)


def _describe(cs: list[HloCollective]) -> str:
  return "; ".join(f"{c.op} groups={list(map(list, c.groups))}" for c in cs) or "no collective at all"


def _decomposed_permute(found: list[HloCollective], want: frozenset) -> list[HloCollective]:
  """XLA:GPU's cycle decomposition splits a cyclic collective-permute into pieces (the back edge apart from the
  rest), each with a subset of the pairs: pieces in one computation whose disjoint pairs add up to `want`
  stand for the op (every piece of a repetition then counts as one k-th of it). [] when there are none."""
  by_comp: dict[str, list[HloCollective]] = {}
  for c in found:
    pairs = _canonical(c, False) if c.op == "collective-permute" else None
    if pairs and pairs <= want:
      by_comp.setdefault(c.computation, []).append(c)
  out = []
  for pieces in by_comp.values():
    union = [p for c in pieces for p in c.groups]
    if len(union) % len(want) == 0 and set(map(tuple, union)) == set(want):
      out += pieces
  return out


def verify_groups(hlo_text: str, op: str, groups: np.ndarray, ordered: bool = False,
                  want: frozenset | None = None) -> list[HloCollective]:
  """Asserts `op` appears over exactly `groups` (or the given canonical `want`) and no other collective
  does; returns the matching instructions."""
  found = find_collectives(hlo_text)
  want = want if want is not None else expected_groups(op, groups, ordered)
  matches = [c for c in found if c.op == op and _canonical(c, ordered) == want]
  if not matches and op == "collective-permute":
    matches = _decomposed_permute(found, want)
  others = [c for c in found if c not in matches]
  if not matches:
    order = " in this order" if ordered else ""
    raise HloMismatch(f"expected {op} over groups {groups.tolist()}{order}, compiled program has: {_describe(found)}")
  if others:
    raise HloMismatch(f"compiled program has unexpected collectives besides {op}: {_describe(others)}")
  p2p = re.search(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s(send|recv)(?:-done)?\(", hlo_text, re.M)
  if p2p:
    raise HloMismatch(f"compiled program has point-to-point {p2p.group(1)} besides {op}: {p2p.group(0).strip()[:160]}")
  return matches


def _as_rewrite(hlo_text: str, exp: Expectation) -> Verified | None:
  """Where the program lacks `exp.op` but has one of the forms XLA rewrites it to, that form verified in its
  place; None where no rewrite applies."""
  ops = {c.op for c in find_collectives(hlo_text)}
  for op, elements in exp.rewrites if exp.op not in ops else ():
    if op in ops:
      # the zero-padded buffer an all-gather is summed in, and the slice a reduce-scatter keeps, are the form's
      # own writes: as for writes_are_the_op, only copies of the message fail
      v = verify(hlo_text, dataclasses.replace(exp, op=op, elements=elements, ordered=False, rewrites=(),
                                               writes_are_the_op=True))
      return dataclasses.replace(v, written_as=f"{exp.op} as {op}")
  return None


def _wire_types(hlo_text: str, exp: Expectation, matches: list[HloCollective]) -> tuple[set[str], bool]:
  """The element types the matches move (the asked one, or a wider one where allowed) and whether XLA:TPU
  packed 8-bit data into u32 words; raises where a type or an element count is not the asked one."""
  asked = HLO_TYPE[exp.dtype]
  wire, packed = set(), False
  for c in matches:
    if exp.onchip_staging and _packed_words(hlo_text, c, asked, exp.elements):
      packed = True  # XLA:TPU's 8-bit reduction: the same bytes, four to a u32 word, unpacked by its reducer
      continue
    for t in c.element_types:
      if t != asked and not (exp.widen_ok and t in WIDER.get(asked, ())) and not (exp.bits_ok and t == _bits_of(asked)):
        raise HloMismatch(f"{exp.op} runs on {t} data, the benchmark asked for {exp.dtype} ({asked}): {c.text[:200]}")
      wire.add(t)
    if c.elements != exp.elements:
      raise HloMismatch(f"{exp.op} moves {c.elements} elements per device, expected {exp.elements}: {c.text[:200]}")
  if len(wire) > 1:
    raise HloMismatch(f"{exp.op} runs in several types {sorted(wire)}")
  return wire, packed


def _executions(exp: Expectation, matches: list[HloCollective], counts: dict[str, int | None],
                in_loops: dict[str, WhileTrip], want: frozenset | None) -> tuple[int, int, list[int | None]]:
  """How often the op runs per call, how often inside a loop with a known trip count, and those loops' trip
  counts; raises where a count is unknown or not the expected one."""
  # A decomposed permute's pieces are parts of one operation: each piece counts 1/k of an execution.
  pieces = sum(len(c.groups) for c in matches) // max(1, len(want if want is not None else
                                                          expected_groups(exp.op, exp.groups, exp.ordered)))
  share = len(matches) // pieces if exp.op == "collective-permute" and pieces and len(matches) > pieces else 1
  total, inside, trips = 0, 0, []
  for c in matches:
    times = counts.get(c.computation)
    if times is None:
      where = in_loops.get(c.computation)
      why = f"the loop has no known trip count ({where.line[:160]})" if where else "a conditional or unknown caller"
      raise HloMismatch(f"can't count how often {exp.op} runs: {why}")
    total += times
    if c.computation in in_loops:
      inside += times
      trips.append(in_loops[c.computation].trip_count)
  total, inside = total // share, inside // share
  if total != exp.executions:
    raise HloMismatch(f"{exp.op} runs {total} times per call, expected {exp.executions}")
  if exp.in_loop and (inside == 0 or total - inside > exp.outside_max):
    raise HloMismatch(f"{exp.op} runs {total - inside} of its {total} times outside a loop with a known trip count")
  return total, inside, trips


def verify(hlo_text: str, exp: Expectation, want: frozenset | None = None) -> Verified:
  """Checks every property in the module docstring; raises HloMismatch naming the first one that fails."""
  if exp.slice_devices:
    chips = exp.slice_devices
    within = all(len({int(v) // chips for v in g}) == 1 for g in exp.groups)
    if not within:
      return verify_dcn(hlo_text, exp)
    local = np.asarray([g for g in exp.groups if int(g[0]) < chips])
    return verify(hlo_text, dataclasses.replace(exp, groups=local, slice_devices=None), want)
  if exp.rewrites and (rewritten := _as_rewrite(hlo_text, exp)) is not None:
    return rewritten
  matches = verify_groups(hlo_text, exp.op, exp.groups, exp.ordered, want)
  asked = HLO_TYPE[exp.dtype]
  wire, packed = _wire_types(hlo_text, exp, matches)
  comps, counts, in_loops = _loops(hlo_text)
  total, inside, trips = _executions(exp, matches, counts, in_loops, want)
  unaliased = exp.aliased and parse.output_aliases(hlo_text).get(_first_output(hlo_text)) != 0
  if unaliased and not exp.onchip_staging:
    raise HloMismatch("in place asked, but the program's result does not take its input's buffer (no"
                      f" input_output_alias of the result to parameter 0): {hlo_text.split(chr(10), 1)[0][:240]}")
  writes, copies, staged, form_writes = None, None, None, None
  if exp.copy_limit is not None:
    writes, copies, staged, form_writes = _no_big_writes(
        hlo_text, comps, exp.copy_limit if exp.strict_writes else None, in_loops, op_writes=exp.writes_are_the_op,
        count_copies=counts if exp.aliased else None, staging=counts if exp.onchip_staging else None,
        executions=counts, tables=exp.tables)
  v = Verified(matches[0], DTYPE_OF.get(wire.pop() if wire else asked, exp.dtype), total,
                  tuple(t for t in trips if t is not None), inside, tuple(c.emitted for c in matches),
                  sum(1 for c in matches if c.sync), writes, copies, staged=staged, form_writes=form_writes)
  # XLA:TPU keeps some small donated buffers (a few 8-bit elements) out of place: said, as a copy would be
  return dataclasses.replace(v, packed_in="u32" if packed else None, unaliased=bool(unaliased))


_TILE_WORDS, _MIN_ROWS = 128, 8  # XLA:TPU pads a packed buffer to whole rows of 128 words, and at least 8 rows


_PER_WORD = {"f8e4m3fn": 4, "f8e5m2": 4, "bf16": 2, "f16": 2}  # elements of a 32-bit word


def _packed_words(hlo_text: str, c: HloCollective, asked: str, elements: int) -> bool:
  """XLA:TPU's form of an 8- or 16-bit reduction: the op runs on u32 words each holding 4 (or 2) of the dtype's
  elements, its reduction computation unpacking them into the asked type, its words the message's bytes
  padded to whole rows of 128 (at least 8 rows, and at most a row more per rank). Not a widening: the same
  bytes cross the links."""
  if list(c.element_types) != ["u32"] or asked not in _PER_WORD:
    return False
  reducer = re.search(r"to_apply=%?([\w.\-]+)", c.text)
  comps = parse.computations(hlo_text)
  body = comps.get(reducer.group(1)) if reducer else None
  if body is None or not any(f" {asked}[]" in line for line in body.lines):
    return False
  words = -(-elements // _PER_WORD[asked])
  ranks = max((len(g) for g in c.groups), default=1)  # an all-gather's padded buffer: a row's padding per rank
  return words <= c.elements <= max(-(-words // _TILE_WORDS) + ranks, _MIN_ROWS) * _TILE_WORDS


def verify_dcn(hlo_text: str, exp: Expectation) -> Verified:
  """A collective across TPU slices, as XLA:TPU compiles it: Megascale transfers over the data-center network.

  One chip per slice in each group (the `dcn` scope): the program's only collectives must be DCN transfers of
  the op's own type (ALL_REDUCE for an all-reduce ...), `exp.executions` of them per call, counted through
  loops like any collective. Groups spanning chips of several slices: XLA:TPU splits the op into ICI collectives
  inside each slice and DCN transfers between slices; every ICI group must stay in its slice and the DCN
  transfers per call must be a whole multiple of the executions. The write check does not apply: the transfers
  go through host buffers the runtime owns. The write check applies as on ICI (`_no_big_writes`): staging and
  re-tiling around the transfers are counted, anything else message-sized on every repetition fails."""
  chips = exp.slice_devices or 1
  transfers = parse.megascale_transfers(hlo_text)
  ici = find_collectives(hlo_text)
  one_each = all(len({int(v) // chips for v in g}) == len(g) for g in exp.groups)
  if not transfers:
    raise HloMismatch(f"expected {exp.op} across slices as Megascale (DCN) transfers, compiled program has none"
                      f" ({_describe(ici)})")
  want = exp.op
  if one_each:
    other = [t for t in transfers if t.op != want]
    if other or ici:
      seen = sorted({t.transfer for t in other}) + [c.op for c in ici]
      raise HloMismatch(f"{exp.op} over one chip per slice must be one DCN {want} transfer; the program also has:"
                        f" {', '.join(seen)}")
  bad = [c for c in ici if any(v >= chips for g in c.groups for v in g)]
  if bad:
    raise HloMismatch(f"an ICI collective leaves its slice: {_describe(bad)}")
  comps, counts, in_loops = _loops(hlo_text)
  total, inside, trips = 0, 0, []
  for t in transfers:
    times = counts.get(t.computation)
    if times is None:
      raise HloMismatch(f"can't count how often the DCN {t.transfer} transfer runs (a loop without a trip count)")
    total += times
    if t.computation in in_loops:
      inside += times
      trips.append(in_loops[t.computation].trip_count)
  if (total != exp.executions) if one_each else (total < exp.executions or total % exp.executions):
    raise HloMismatch(f"DCN transfers run {total} times per call, expected {exp.executions}"
                      f"{'' if one_each else ' or a whole multiple of it'}")
  per_op = total // exp.executions
  if exp.in_loop and (inside == 0 or (total - inside) // per_op > exp.outside_max):
    raise HloMismatch(f"{exp.op} runs {total - inside} of its {total} DCN transfers outside a loop with a known trip"
                      " count")
  writes, staged, form_writes = None, None, None
  if exp.copy_limit is not None:
    # an all-gather or reduce-scatter across slices: XLA:TPU's forms inside each slice (a zero-padded all-reduce
    # and its crop, an all-reduce and its slice) write the message as part of the op, as verify's rewrites do
    writes, _, staged, form_writes = _no_big_writes(hlo_text, comps, exp.copy_limit if exp.strict_writes else None, in_loops,
                                               op_writes=exp.writes_are_the_op or bool(exp.rewrites), staging=counts)
  first = transfers[0]
  match = HloCollective(exp.op, (), first.line, first.element_types, first.elements, first.computation,
                        f"megascale-{first.transfer.lower().replace('_', '-')}")
  wire = DTYPE_OF.get(first.element_types[0], exp.dtype) if first.element_types else exp.dtype
  dcn = {"transfers_per_op": per_op, "types": sorted({t.transfer for t in transfers}),
         "ici_collectives_per_call": sum(counts.get(c.computation) or 0 for c in ici), "ici_ops": sorted({c.op for c in ici})}
  return Verified(match, wire, exp.executions, tuple(t for t in trips if t is not None), inside // per_op,
                  tuple(f"megascale-{t.transfer.lower().replace('_', '-')}" for t in transfers), dcn=dcn,
                  body_writes=writes, staged=staged, form_writes=form_writes)


def _loops(hlo_text: str) -> tuple[dict[str, parse.Computation], dict[str, int | None], dict[str, "WhileTrip"]]:
  """The module's computations, each one's executions per call, and the while loop each loop-run one sits in."""
  comps = parse.computations(hlo_text)
  counts = parse.execution_counts(hlo_text, comps)
  in_loops: dict[str, WhileTrip] = {}
  for loop in parse.while_loops(hlo_text, comps):
    for name in parse.reachable(hlo_text, loop.body, comps):
      in_loops.setdefault(name, WhileTrip(loop.trip_count, loop.line))
  return comps, counts, in_loops


def _first_output(hlo_text: str) -> tuple[int, ...]:
  """The alias index of the program's first result: () for a single array, (0,) for a tuple."""
  layout = re.search(r"entry_computation_layout=\{\(.*?\)->(\(?)", hlo_text.split("\n", 1)[0])
  return (0,) if layout and layout.group(1) else ()


@dataclasses.dataclass(frozen=True)
class WhileTrip:
  trip_count: int | None
  line: str


# Instructions that write no buffer of their own (views, tuples, control, constants) or are the collective
# itself (its -start, -done and async wrappers); every other instruction outside a fused computation writes
# its result.
_NO_WRITE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
             "after-all", "partition-id", "replica-id", "async-start", "async-update", "async-done",
             "copy-done", "call-start", "call-done"}
# the collectives, and the sends and receives XLA:TPU writes a Megascale (DCN) transfer as (an ICI program with one
# fails verify_groups)
_COLLECTIVE_OPS = {f"{op}{sfx}" for op in parse.OPS for sfx in ("", "-start", "-done")} | {
    "send", "recv", "send-done", "recv-done"}


def _written(ins: parse.Instr, fused: dict[str, parse.Computation], defs: dict[str, parse.Instr] | None = None) -> int:
  """Elements an instruction writes: its result's arrays, but only the update of a dynamic-update-slice, on its
  own or as a fusion's root (the timed loop's one-element feedback). A dynamic-update-slice always runs in
  place after XLA's copy insertion, which adds an explicit `copy` of the operand wherever the operand's buffer
  is still needed (that copy is an instruction of its own, and counted); `defs` (the computation's
  instructions by name) gives the update's shape."""
  if ins.opcode == "dynamic-update-slice":
    update = (parse.operands(ins) or [None, None])[1:2]
    if update and defs and update[0] in defs:
      return parse.result_arrays(defs[update[0]].type_text)[1]
  callee = next((c for k, c in parse.callees(ins) if k == "calls"), None) if ins.opcode == "fusion" else None
  comp = fused.get(callee) if callee else None
  if comp is not None:
    types = {}
    root = None
    for line in comp.lines:
      sub = parse.parse_instruction(line)
      if sub is None:
        continue
      types[sub.name] = sub.type_text
      if line.strip().startswith("ROOT"):
        root = sub
    if root is not None and root.opcode == "dynamic-update-slice":
      operands = re.findall(r"%([\w.\-]+)", root.rest)
      if len(operands) >= 2 and operands[1] in types:
        return parse.result_arrays(types[operands[1]])[1]
  shaped = "(" + ", ".join(re.findall(r"\b[a-z]+[0-9a-z]*\[[\d,]+\]", ins.type_text)) + ")"
  # async starts: copy-start's result is element 0, slice-start's (XLA:TPU) element 1 (0 holds its operand)
  start = {"copy-start": "copy", "slice-start": "slice"}.get(ins.opcode)
  return parse.result_arrays(shaped, start)[1]


def body_writes(hlo_text: str, comps: dict[str, parse.Computation] | None = None) -> dict[str, list[tuple[int, parse.Instr]]]:
  """{computation: [(elements written, instruction)]} for every instruction that writes a buffer besides the
  collectives, in every computation run from the entry that is not fused into another instruction (a
  fusion's writes are its result, counted once)."""
  comps = comps if comps is not None else parse.computations(hlo_text)
  fused_names = set()
  for comp in comps.values():
    for line in comp.lines:
      ins = parse.parse_instruction(line)
      if ins is not None and ins.opcode == "fusion":
        fused_names |= {c for k, c in parse.callees(ins) if k == "calls"}
  fused = {n: comps[n] for n in fused_names if n in comps}
  entry = next((c.name for c in comps.values() if c.entry), None)
  run = parse.reachable(hlo_text, entry, comps) if entry else set(comps)
  out: dict[str, list[tuple[int, str]]] = {}
  for name in sorted(run - fused_names):
    instrs = [ins for ins in map(parse.parse_instruction, comps[name].lines) if ins is not None]
    defs = {ins.name: ins for ins in instrs}
    for ins in instrs:
      if ins.opcode in _NO_WRITE or ins.opcode in _COLLECTIVE_OPS:
        continue
      elements = _written(ins, fused, defs)
      if elements:
        out.setdefault(name, []).append((elements, ins))
  return out


_ONCHIP = re.compile(r"\bS\(1\)")  # a layout's memory space 1: XLA:TPU's on-chip vector memory (VMEM)


def _staging_copy(ins: parse.Instr) -> bool:
  """An instruction whose result lives in on-chip memory: XLA:TPU staging a buffer between HBM and VMEM
  (copies, async slices, its `ConcatBitcast` of staged pieces; a copy out of VMEM is `_from_onchip`). VMEM is not the HBM traffic the
  write check guards against; these writes are counted and reported instead."""
  return bool(_ONCHIP.search(ins.type_text))


def _from_onchip(ins: parse.Instr, defs: dict[str, parse.Instr]) -> bool:
  """A copy out of on-chip memory: its operand (`defs`: its computation's instructions by name) lives in VMEM
  (S(1)), the copy writes it back to HBM in another tiling: XLA:TPU's staging, the other way."""
  if ins.opcode not in ("copy", "copy-start"):
    return False
  src = defs.get((parse.operands(ins) or [""])[0])
  return src is not None and bool(_ONCHIP.search(src.type_text))


_LAYOUT_OPS = ("copy", "copy-start", "copy-done", "reshape", "transpose", "bitcast")
_LAYOUT = re.compile(r"\{[^{}]*\}\s*$")


def _layout_of(type_text: str) -> str:
  """An array type's layout without its memory space (`{1,0:T(4,128)(2,1)}` of `bf16[4,128]{1,0:T(4,128)(2,1)S(1)}`)."""
  m = _LAYOUT.search(type_text.strip())
  return re.sub(r"S\(\d+\)", "", m.group(0)) if m else ""


def _unit_reduce(ins: parse.Instr, defs: dict[str, parse.Instr]) -> bool:
  """A reduce over dimensions of size 1 only: a change of shape and tiling, no arithmetic (XLA:TPU's way of
  re-tiling [n, 1, c] into [n, c])."""
  dims = re.search(r"dimensions=\{([\d,]*)\}", ins.rest)
  src = defs.get((parse.operands(ins) or [""])[0])
  shape = re.search(r"\[([\d,]*)\]", src.type_text) if src is not None else None
  if not dims or not shape:
    return False
  extents = [int(v) for v in shape.group(1).split(",") if v]
  return all(int(d) < len(extents) and extents[int(d)] == 1 for d in dims.group(1).split(",") if d)


def _layout_only(ins: parse.Instr, defs: dict[str, parse.Instr], comps: dict[str, parse.Computation]) -> bool:
  """An instruction that only moves its operand into another shape or tiling: a copy that changes the layout,
  a reshape, transpose or bitcast, a reduce over unit dimensions, or a fusion of nothing else."""
  if ins.opcode == "copy":
    src = defs.get((parse.operands(ins) or [""])[0])
    return src is not None and _layout_of(src.type_text) != _layout_of(ins.type_text)
  if ins.opcode in _LAYOUT_OPS:
    return True
  if ins.opcode == "reduce":
    return _unit_reduce(ins, defs)
  if ins.opcode == "fusion":
    callee = next((c for k, c in parse.callees(ins) if k == "calls"), None)
    if callee not in comps:
      return False
    inner = {d.name: d for d in map(parse.parse_instruction, comps[callee].lines) if d is not None}
    return all(d.opcode in ("parameter", "constant", *_LAYOUT_OPS) or d.opcode == "reduce" and _unit_reduce(d, inner)
               for d in inner.values())
  return False


_MERGE_OPS = ("parameter", "constant", "broadcast", "select", "compare", "bitcast", "reshape")


def _merge(ins: parse.Instr, comps: dict[str, parse.Computation]) -> bool:
  """A select between parts of one operation (fed only by collectives' results and scalars): how XLA:TPU joins
  an op it split between ICI and a Megascale (DCN) transfer (a ring across slices: each rank takes its
  neighbour's data from the ICI permute or from the DCN receive)."""
  if ins.opcode == "select":
    return True
  callee = next((c for k, c in parse.callees(ins) if k == "calls"), None) if ins.opcode == "fusion" else None
  if callee not in comps:
    return False
  inner = [d for d in map(parse.parse_instruction, comps[callee].lines) if d is not None]
  return any(d.opcode == "select" for d in inner) and all(d.opcode in _MERGE_OPS for d in inner)


def relayouts(comp: parse.Computation, comps: dict[str, parse.Computation]) -> set[str]:
  """The instructions of `comp` that re-tile a collective's operand or result (XLA:TPU's form of a flat
  collective: its buffers change tiling on the way in and out), or join the parts of an op it split (`_merge`):
  every chain of layout-only instructions (`_layout_only`) that ends in a collective's operand or starts at its
  result, and selects whose every array operand is such a result; an unaligned operand's copies into the padded
  buffer XLA:TPU zeroes the tail of (`_zero_crop`). Nothing that computes is in a chain, and
  each writes the elements it reads, so what they write is the op's own form."""
  instrs = [d for d in map(parse.parse_instruction, comp.lines) if d is not None]
  defs = {d.name: d for d in instrs}
  ops = [d for d in instrs if d.opcode in _COLLECTIVE_OPS]
  seen = {d.name for d in ops}
  out: set[str] = set()
  grew = True
  while grew:  # forward from each collective's result, to a fixed point (a merge needs all its parts)
    grew = False
    for u in instrs:
      if u.name in out or u.name in seen:
        continue
      data = [o for o in parse.operands(u) if o in defs and parse.result_arrays(defs[o].type_text)[1] > 1]
      if not data or not all(o in seen or o in out for o in data):
        continue
      if u.opcode == "get-tuple-element" or _layout_only(u, defs, comps) or len(data) > 1 and _merge(u, comps):
        out.add(u.name)
        grew = True
  todo = [(o, False) for d in ops for o in parse.operands(d)]
  while todo:  # backward from each collective's operands
    name, padded = todo.pop()
    d = defs.get(name)
    if d is None or d.name in out:
      continue
    pad = _zero_crop(d)  # XLA:TPU zeroing the tile padding of an unaligned operand: copied in first, any layout
    if pad or _layout_only(d, defs, comps) or padded and d.opcode in ("copy", "copy-start", "copy-done"):
      out.add(d.name)
      todo.extend((o, padded or pad) for o in parse.operands(d)[:1])
  return out


def _zero_crop(ins: parse.Instr) -> bool:
  """XLA:TPU's `ZeroCrop`: a buffer whose length is no whole number of tiles, its padding zeroed in place
  before a collective reads it (the operand was copied into the padded buffer just before)."""
  return ins.opcode == "custom-call" and 'custom_call_target="ZeroCrop"' in ins.rest


def _index_table(ins: parse.Instr, elements: int, tables: int, defs: dict[str, parse.Instr]) -> bool:
  """An op's index table: exactly `tables` integer elements, computed from constants (the whole size table) and
  nothing else larger (the device's index), so no message data flows into it."""
  types, _ = parse.result_arrays(ins.type_text)
  small = all(defs[o].opcode == "constant" or parse.result_arrays(defs[o].type_text)[1] <= tables
              for o in parse.operands(ins) if o in defs)
  return elements == tables and set(types) <= {"s32", "s64", "u32", "u64"} and small


def _no_big_writes(hlo_text: str, comps: dict[str, parse.Computation], limit: int | None, in_loops: dict,
                   op_writes: bool = False,
                   count_copies: dict[str, int | None] | None = None,
                   staging: dict[str, int | None] | None = None,
                   executions: dict[str, int | None] | None = None,
                   tables: int | None = None) -> tuple[int, int | None, int | None, int]:
  """Fails on any instruction besides the collective that writes `limit` elements or more (a copy, or a
  slice, concatenate, convert or reverse fusion that moves the message) anywhere in a timed program; with
  `op_writes` (the platform's form of the op writes the message itself: XLA:CPU) only copies fail; with `limit`
  None (a program never timed) nothing fails and the loop body's writes are still counted. With
  `count_copies` (in place: each computation's executions per call) message-sized copies are counted instead.
  With `staging` (XLA:TPU), message-sized copies to or from on-chip memory, and writes outside the loop (once
  per call: the two arms' difference cancels them), are counted, not failed; and so are the re-tilings of a
  collective's operand or result in HBM inside the loop (`relayouts`), which are the op's own form there and
  are what the point measures with it. The writes `op_writes` excuses and these re-tilings are the form's
  writes: their elements per call (`executions`: each computation's executions per call) are returned so the
  record can say what the op costs there. Returns the elements the loop body writes besides the collective,
  per trip, the copies and the staging copies per call, and the form's writes per call."""
  body, copies, staged = 0, None if count_copies is None else 0, None if staging is None else 0
  form_writes, executions = 0, executions or staging or count_copies or {}
  chains = {name: relayouts(comps[name], comps) for name in in_loops} if staging is not None else {}
  defs: dict[str, dict[str, parse.Instr]] = {}

  def defs_of(name: str) -> dict[str, parse.Instr]:  # a computation's instructions by name, parsed once
    if name not in defs:
      defs[name] = {d.name: d for d in map(parse.parse_instruction, comps[name].lines) if d is not None}
    return defs[name]

  for name, writes in body_writes(hlo_text, comps).items():
    for elements, ins in writes:
      if name in in_loops:
        body += elements
      if limit is None or tables and _index_table(ins, elements, tables, defs_of(name)):
        continue
      if staging is not None and elements >= limit:
        if _staging_copy(ins) or name not in in_loops or _from_onchip(ins, defs_of(name)):
          staged += staging.get(name) or 1
          continue
        if ins.name in chains.get(name, ()):  # XLA:TPU re-tiling the op's operand or result in HBM
          form_writes += elements * (staging.get(name) or 1)
          continue
      if count_copies is not None and elements >= limit and ins.opcode in ("copy", "copy-start"):
        copies += count_copies.get(name) or 1
        continue
      if elements >= limit and op_writes and ins.opcode not in ("copy", "copy-start"):
        form_writes += elements * (executions.get(name) or 1)  # the platform's form of the op writes the message
        continue
      if elements >= limit:
        where = "the loop body" if name in in_loops else "the program"
        raise HloMismatch(f"{where} writes {elements} elements besides the collective (a buffer of the message's"
                          f" size) on every {'repetition' if name in in_loops else 'call'}: {ins.line.strip()[:200]}")
  return body, copies, staged, form_writes


def verify_command_buffer(verified: Verified, thunk_text: str | None, on: bool, loop: bool) -> Verified:
  """Where XLA:GPU runs the program's collectives (and, with `loop`, its timed while loop): inside a command
  buffer when `on` was asked, launched on their own when it was not; raises HloMismatch otherwise. Read from
  XLA's thunk sequence (microbench.hlo.thunks): XLA:GPU forms command buffers after the HLO."""
  asked = "yes" if on else "no"
  if thunk_text is None:
    raise HloMismatch("can't tell whether the collective runs inside a command buffer: XLA:GPU dumped no thunk"
                      " sequence (a hit in JAX's persistent compilation cache compiles nothing)")
  found = thunks.placement(thunk_text)
  if found.collectives == 0:
    raise HloMismatch(f"XLA:GPU's thunk sequence has no collective thunk for {verified.match.op}:"
                      f" {thunk_text.strip().splitlines()[:3]}")
  if loop and found.loops == 0:
    raise HloMismatch("XLA:GPU's thunk sequence has no while loop for the timed repetitions")
  if on and found.outside:
    raise HloMismatch(
        f"--command_buffer=yes, but XLA:GPU launches {found.collectives - found.collectives_inside} of"
        f" {found.collectives} collective thunks and {found.loops - found.loops_inside} of {found.loops} loops"
        f" outside any command buffer (XLA leaves collectives and loops out when the CUDA driver or runtime is"
        f" older than 12.3): {found.outside[0][:160]}")
  if not on and found.command_buffers:
    raise HloMismatch(f"--command_buffer=no, but XLA:GPU formed {found.command_buffers} command buffer(s): the"
                      " option xla_gpu_enable_command_buffer='' was not honoured")
  return dataclasses.replace(verified, command_buffer={"asked": asked, **found.facts()})
