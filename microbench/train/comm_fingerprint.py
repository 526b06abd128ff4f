"""A training step's communication fingerprint: count and bytes per collective type, read from the
compiled (partitioned, per-device) HLO text.

Bytes follow the nccl-tests size convention per device, so they compare with the collective sweep:
all-reduce the buffer, all-gather the output, reduce-scatter the input (output x group size),
all-to-all and collective-permute the buffer. Tuple results (XLA-combined collectives) add up their
parts. Async `-start` forms count once, `-done` not at all. A collective inside a while loop (scanned
layers, gradient-accumulation microbatches) counts once per iteration: XLA's known trip count multiplies
it, and `loops` lists each loop's per-iteration collectives with its trip count (a loop whose count XLA
does not know is counted once and listed with `trip_count: null`).

XLA:TPU writes some collectives in other forms, and each is counted as the collective it performs, so a TPU
fingerprint compares with a GPU one and with the sweep (`forms` says how many of each op were compiled so):
- an FSDP weight gather as a sum all-reduce of a zero-padded buffer (each chip's shard written into zeros):
  an all-gather of that buffer (the all-reduce's result is the gathered output; on the wire an all-reduce
  moves up to twice a ring all-gather's bytes);
- a gradient reduce-scatter as its all-reduce-scatter fusion (an all-reduce whose result the fusion slices
  to this chip's shard, run by a fused reduce-scatter emitter): a reduce-scatter of the all-reduce's input;
- a collective across slices as a Megascale host transfer over DCN (a `send`/`recv` pair whose attributes
  name the collective): that collective, its bytes from what the transfer carries (the send; the recv, the
  output, for an all-gather), and listed again under `dcn`. Everything else in `ops` runs over ICI.
An all-reduce whose result the program slices outside a fusion stays an all-reduce: that is what runs.
"""

from __future__ import annotations

import re
from typing import Any

from microbench.hlo import parse as hlo

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
ZERO_PADDED = "all-reduce of a zero-padded buffer"  # XLA:TPU's all-gather
SCATTER_FUSION = "all-reduce-scatter fusion"        # XLA:TPU's fused reduce-scatter
DCN = "Megascale host transfer (DCN)"               # a collective across slices

_PASS_THROUGH = ("copy", "copy-start", "copy-done", "bitcast", "convert", "reshape")  # keep zeros zeros, a result a result
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]*)"')


def _add(table: dict[str, dict[str, Any]], op: str, times: int, parts: list[tuple[str, int]]) -> None:
  entry = table.setdefault(op, {"count": 0, "bytes": 0, "dtypes": {}})
  entry["count"] += times
  for dtype, size in parts:
    entry["bytes"] += times * size
    entry["dtypes"][dtype] = entry["dtypes"].get(dtype, 0) + times * size


def _ordered(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
  return {op: {**table[op], "dtypes": dict(sorted(table[op]["dtypes"].items()))} for op in OPS if op in table}


def _parts(ins: hlo.Instruction, num_devices: int) -> list[tuple[str, int]]:
  """(dtype, bytes) of each array the collective moves, in the nccl-tests convention."""
  parts = hlo.moved_parts(ins)
  if ins.op == "reduce-scatter":
    g = hlo.group_size(ins.rest, num_devices)
    parts = [(dt, b * g) for dt, b in parts]
  return parts


class _Module:
  """The module's computations and their instructions by name: what the TPU forms are recognised from."""

  def __init__(self, hlo_text: str):
    self.comps = hlo.computations(hlo_text)
    self._defs: dict[str, dict[str, hlo.Instr]] = {}
    self.recvs: dict[str, str] = {}  # Megascale rendezvous -> the recv's result type
    for comp in self.comps.values():
      for line in comp.lines:
        ins = hlo.parse_instruction(line)
        if ins is not None and ins.opcode == "recv" and (rz := _RENDEZVOUS.search(ins.rest)):
          self.recvs[rz.group(1)] = ins.type_text

  def defs(self, comp: str) -> dict[str, hlo.Instr]:
    if comp not in self._defs:
      found = (hlo.parse_instruction(line) for line in self.comps[comp].lines) if comp in self.comps else ()
      self._defs[comp] = {ins.name: ins for ins in found if ins is not None}
    return self._defs[comp]

  def root(self, comp: str) -> hlo.Instr | None:
    line = next((l for l in self.comps[comp].lines if l.strip().startswith("ROOT")), None) if comp in self.comps \
        else None
    return hlo.parse_instruction(line) if line else None

  def through(self, name: str, comp: str) -> hlo.Instr | None:
    """The instruction `name` stands for once copies, bitcasts, converts and reshapes are looked through."""
    defs = self.defs(comp)
    ins = defs.get(name)
    for _ in range(16):
      if ins is None or ins.opcode not in _PASS_THROUGH or not hlo.operands(ins):
        return ins
      ins = defs.get(hlo.operands(ins)[0])
    return ins

  def is_zero(self, name: str, comp: str) -> bool:
    """Whether `name` is a zero constant or a broadcast of one."""
    ins = self.through(name, comp)
    if ins is not None and ins.opcode == "broadcast" and hlo.operands(ins):
      ins = self.through(hlo.operands(ins)[0], comp)
    return ins is not None and ins.opcode == "constant" and re.match(r"\s*-?0(\.0*)?(e[+-]?\d+)?\)", ins.rest) is not None

  def zero_padded(self, name: str, comp: str) -> bool:
    """Whether `name` is a dynamic-update-slice of something into zeros (directly or as a fusion's root)."""
    ins = self.through(name, comp)
    if ins is not None and ins.opcode == "fusion":
      callee = re.search(r"\bcalls=%?([\w.\-]+)", ins.rest)
      root = self.root(callee.group(1)) if callee else None
      if root is None or root.opcode != "dynamic-update-slice":
        return False
      inner = callee.group(1)
      base = self.through(hlo.operands(root)[0], inner)
      if base is not None and base.opcode == "parameter":  # the zeros come from outside the fusion
        k = int(re.match(r"\s*(\d+)", base.rest).group(1))
        outer = hlo.operands(ins)
        return k < len(outer) and self.is_zero(outer[k], comp)
      return base is not None and self.is_zero(base.name, inner)
    return ins is not None and ins.opcode == "dynamic-update-slice" and bool(hlo.operands(ins)) and \
        self.is_zero(hlo.operands(ins)[0], comp)

  def sums(self, ins: hlo.Instruction) -> bool:
    """Whether an all-reduce adds (or ORs) what it reduces: a zero-padded buffer then reads as a gather."""
    m = re.search(r"\bto_apply=%?([\w.\-]+)", ins.rest)
    root = self.root(m.group(1)) if m else None
    return root is not None and root.opcode in ("add", "or")

  def scattered(self, name: str, comp: str) -> set[int]:
    """Which parts of the all-reduce `name` leave the computation it sits in only as a dynamic-slice (an
    all-reduce-scatter fusion's body returns this chip's slice of each reduced array): their indices."""
    root = self.root(comp)
    outs = hlo.operands(root) if root is not None and root.opcode == "tuple" else [root.name] if root else []
    found = set()
    for out in outs:
      ins = self.through(out, comp)
      if ins is None or ins.opcode != "dynamic-slice" or not hlo.operands(ins):
        continue
      src = self.through(hlo.operands(ins)[0], comp)
      if src is not None and src.name == name:
        found.add(0)
      elif src is not None and src.opcode == "get-tuple-element" and hlo.operands(src) == [name]:
        found.add(int(re.search(r"index=(\d+)", src.rest).group(1)))
    return found


def classify(line: str, comp: str, module: _Module, num_devices: int) -> list[tuple[str, str | None, tuple[str, int]]]:
  """(op, form, (dtype, bytes)) for each array one instruction line moves as a collective; [] for a line that
  is none. `form`: None for a native collective, else how XLA:TPU wrote it (ZERO_PADDED, SCATTER_FUSION, DCN)."""
  dcn = _megascale(line, module)
  if dcn is not None:
    return dcn
  found = hlo.instructions(line)
  if not found or found[0].op not in OPS:
    return []
  ins = found[0]
  parts = _parts(ins, num_devices)
  if ins.op != "all-reduce":
    return [(ins.op, None, p) for p in parts]
  me = hlo.parse_instruction(line)
  operands = hlo.operands(me)
  sliced = module.scattered(me.name, comp)
  summed = len(operands) == len(parts) and module.sums(ins)
  out = []
  for i, part in enumerate(parts):
    if i in sliced:
      out.append(("reduce-scatter", SCATTER_FUSION, part))
    elif summed and module.zero_padded(operands[i], comp):
      out.append(("all-gather", ZERO_PADDED, part))
    else:
      out.append(("all-reduce", None, part))
  return out


def _megascale(line: str, module: _Module) -> list[tuple[str, str | None, tuple[str, int]]] | None:
  """A Megascale transfer's collective (counted at its send; an all-gather at its recv, whose result is the
  gathered output); [] for the other half of the pair; None for a line that is no Megascale transfer."""
  ins = hlo.parse_instruction(line)
  if ins is None or ins.opcode not in ("send", "recv") or "xla_megascale_runtime" not in ins.rest:
    return None
  kind = re.search(r'_xla_megascale_transfer_type="?(\w+)', ins.rest)
  op = hlo.MEGASCALE_OPS.get(kind.group(1) if kind else "", "")
  if not op:
    return None  # a host transfer that is not a collective: not communication between chips
  if ins.opcode != ("recv" if op == "all-gather" else "send"):
    return []
  data = (hlo.split_tuple(ins.type_text) or [ins.type_text])[0]
  parts = hlo.moved_parts(hlo.Instruction(op, data, False, ins.rest, line))
  return [(op, DCN, p) for p in parts]


def comm_report(hlo_text: str, num_devices: int) -> dict[str, Any]:
  """{"ops": {op: {count, bytes, dtypes}} per step, "loops": [{body, trip_count, times, ops}], "dcn": the part
  of "ops" that crosses slices, "forms": {op: {form: count}} for collectives XLA:TPU wrote in another form}."""
  placed, loops = hlo.placed_lines(hlo_text)
  module = _Module(hlo_text)
  total: dict[str, dict[str, Any]] = {}
  dcn: dict[str, dict[str, Any]] = {}
  forms: dict[str, dict[str, int]] = {}
  per_loop: dict[str, dict[str, dict[str, Any]]] = {}
  for p in placed:
    if p.runs == 0:
      continue
    moved = classify(p.line, p.computation, module, num_devices)
    # One instruction is one collective per op it stands for (a combined tuple of gathers and reductions: one each).
    for op in dict.fromkeys(op for op, _, _ in moved):
      parts = [part for o, _, part in moved if o == op]
      form = next(f for o, f, _ in moved if o == op)
      _add(total, op, p.runs, parts)
      if form is not None:
        forms.setdefault(op, {})[form] = forms.get(op, {}).get(form, 0) + p.runs
      if form == DCN:
        _add(dcn, op, p.runs, parts)
      if p.loop is not None:
        loop = next(lp for lp in loops if lp.body == p.loop)
        _add(per_loop.setdefault(p.loop, {}), op, p.runs // ((loop.trip_count or 1) * max(loop.times, 1)), parts)
  loop_rows = [{"body": lp.body, "trip_count": lp.trip_count, "times": lp.times, "ops": _ordered(per_loop[lp.body])}
               for lp in loops if lp.body in per_loop]
  return {"ops": _ordered(total), "loops": loop_rows, "dcn": _ordered(dcn),
          "forms": {op: dict(sorted(forms[op].items())) for op in OPS if op in forms}}


def comm_fingerprint(hlo_text: str, num_devices: int) -> dict[str, dict[str, Any]]:
  """{op: {"count", "bytes", "dtypes"}} per step for every collective type in the program (absent: none)."""
  return comm_report(hlo_text, num_devices)["ops"]
