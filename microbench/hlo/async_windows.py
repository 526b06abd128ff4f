"""Reading a scheduled XLA module's order: the async collectives' start-done windows and what runs inside them.

XLA prints a scheduled module (`HloModule ..., is_scheduled=true`) with each computation's instructions in
the order its schedule runs them. On XLA:GPU a collective is an async pair, `all-reduce-start` ...
`all-reduce-done` (or `async-start`/`async-done` around one); the latency-hiding scheduler moves independent
work between the two, which is what lets the collective's transfer hide behind it. So a window is the
instructions strictly between a start and its done in one computation, and "is X overlapped" is "is X in a
window". XLA:CPU runs collectives synchronously (a plain `all-reduce`): it has no windows.
"""

from __future__ import annotations

import dataclasses
import re

from microbench.hlo import parse

_OPERAND = re.compile(r"%([\w.\-]+)")
_STARTS = {f"{op}-start" for op in parse.OPS}


@dataclasses.dataclass(frozen=True)
class Window:
  """One async collective's start and done in a computation, and the instructions scheduled between them."""
  computation: str
  start: parse.Instr
  done: parse.Instr
  between: tuple[parse.Instr, ...]

  @property
  def op(self) -> str:
    return self.start.opcode.removesuffix("-start")


def is_scheduled(hlo_text: str) -> bool:
  """Whether the text's instruction order is a schedule (XLA marks a scheduled module in its header)."""
  return "is_scheduled=true" in hlo_text.split("\n", 1)[0]


def _wraps_collective(ins: parse.Instr, comps: dict[str, parse.Computation]) -> bool:
  """An `async-start` whose called computation holds a collective (not any async work)."""
  for _, callee in parse.callees(ins):
    comp = comps.get(callee)
    if comp and any(parse.instructions("\n".join(comp.lines))):
      return True
  return False


def windows(hlo_text: str, comps: dict[str, parse.Computation] | None = None) -> list[Window]:
  """Every async collective's window, in every computation, in schedule order. A start whose done is in
  another computation (a pipelined collective) has no window here."""
  comps = comps if comps is not None else parse.computations(hlo_text)
  out = []
  for comp in comps.values():
    order = [ins for ins in map(parse.parse_instruction, comp.lines) if ins is not None]
    opened: dict[str, int] = {}
    for i, ins in enumerate(order):
      if ins.opcode in _STARTS or ins.opcode == "async-start" and _wraps_collective(ins, comps):
        opened[ins.name] = i
      elif ins.opcode.endswith("-done"):
        first = _OPERAND.search(ins.rest)
        if first and first.group(1) in opened:
          j = opened.pop(first.group(1))
          out.append(Window(comp.name, order[j], ins, tuple(order[j + 1:i])))
  return out


def runs_dot(ins: parse.Instr, comps: dict[str, parse.Computation], depth: int = 0) -> bool:
  """Whether an instruction is a matrix multiplication as compiled: a `dot`/`convolution`, a cuBLAS or
  cuDNN GEMM custom-call, or a fusion (Triton GEMM fusions included) whose computation holds one."""
  if ins.opcode in ("dot", "convolution"):
    return True
  if ins.opcode == "custom-call":
    target = re.search(r'custom_call_target="([^"]*)"', ins.rest)
    return bool(target and re.search(r"gemm|matmul|cublas|conv", target.group(1), re.I))
  if ins.opcode != "fusion" or depth > 8:
    return False
  for kind, callee in parse.callees(ins):
    comp = comps.get(callee)
    if kind == "calls" and comp is not None:
      for line in comp.lines:
        sub = parse.parse_instruction(line)
        if sub is not None and runs_dot(sub, comps, depth + 1):
          return True
  return False
