"""Reading XLA:GPU's thunk sequence: what the GPU runtime launches, and which of it runs inside a command
buffer (a CUDA graph).

In this jaxlib XLA:GPU forms command buffers after the HLO, on the thunk sequence
(`CommandBufferConversionPass`, `xla_gpu_experimental_enable_command_buffer_on_thunks`): the optimised HLO
(`as_text()`) is the same with or without them. The only place a compiled program says what runs inside one is
the thunk sequence XLA dumps (`xla_dump_to`: `*.thunk_sequence_after_thunk_passes.txt` when a pass changed it,
else `*.thunk_sequence.txt`), one thunk a line, nested thunks indented below their parent:

    000: kCommandBuffer [source | sink]
        001: kCopy  [source       | next=002 (1)] kCopy
        002: kWhile [prev=001 (1) | sink        ]
    condition:
            003: kCustomKernel [source | sink] loop_compare_fusion ...
          body:
            004: kAllReduce    [source       | next=006 (1)] kAllReduce
            006: kAsyncStart   [prev=004 (1) | sink        ] stream=communication_stream[0], async_id=6
                005: kAllReduce [source | sink] kAllReduce
"""

from __future__ import annotations

import dataclasses
import re

# Thunk kinds that run a collective (XLA's Thunk::Kind names); an async collective is its kind nested in a
# kAsyncStart.
COLLECTIVE_KINDS = frozenset({
    "kAllReduce", "kAllGather", "kReduceScatter", "kAllToAll", "kRaggedAllToAll", "kCollectivePermute",
    "kCollectiveBroadcast", "kSend", "kRecv", "kGroup"})
COMMAND_BUFFER = "kCommandBuffer"
WHILE = "kWhile"

_LINE = re.compile(r"^(?P<indent>\s*)(?P<id>\d+):\s+(?P<kind>k\w+)\b")


@dataclasses.dataclass(frozen=True)
class Thunk:
  kind: str                   # `kAllReduce`, `kWhile`, `kCommandBuffer` ...
  line: str
  ancestors: tuple[str, ...]  # kinds of the thunks it is nested in, outermost first

  @property
  def in_command_buffer(self) -> bool:
    return COMMAND_BUFFER in self.ancestors


def parse(text: str) -> list[Thunk]:
  """Every thunk of a dumped thunk sequence with the kinds it is nested in (by indentation; the `condition:`
  and `body:` labels of a while are not thunks)."""
  out: list[Thunk] = []
  stack: list[tuple[int, str]] = []  # (indent, kind) of the open parents
  for line in text.splitlines():
    m = _LINE.match(line)
    if not m:
      continue
    indent = len(m.group("indent"))
    while stack and stack[-1][0] >= indent:
      stack.pop()
    out.append(Thunk(m.group("kind"), line.strip(), tuple(k for _, k in stack)))
    stack.append((indent, m.group("kind")))
  return out


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a program's collectives and loops run: inside a command buffer or launched one by one."""
  command_buffers: int     # kCommandBuffer thunks (nested ones included)
  collectives: int         # collective thunks
  collectives_inside: int  # ... of them inside a command buffer
  loops: int               # while thunks
  loops_inside: int        # ... of them inside a command buffer
  outside: tuple[str, ...]  # the collective and loop lines that are not inside one

  def facts(self) -> dict:
    return {"command_buffers": self.command_buffers, "collectives": self.collectives,
            "collectives_inside": self.collectives_inside, "loops": self.loops, "loops_inside": self.loops_inside}


def placement(text: str) -> Placement:
  thunks = parse(text)
  colls = [t for t in thunks if t.kind in COLLECTIVE_KINDS]
  loops = [t for t in thunks if t.kind == WHILE]
  return Placement(sum(t.kind == COMMAND_BUFFER for t in thunks), len(colls),
                   sum(t.in_command_buffer for t in colls), len(loops), sum(t.in_command_buffer for t in loops),
                   tuple(t.line for t in colls + loops if not t.in_command_buffer))
