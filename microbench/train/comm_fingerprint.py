"""A training step's communication fingerprint: count and bytes per collective type, read from the
compiled (partitioned, per-device) HLO text.

Bytes follow the nccl-tests size convention per device, so they compare with the collective sweep:
all-reduce the buffer, all-gather the output, reduce-scatter the input (output x group size),
all-to-all and collective-permute the buffer. Tuple results (XLA-combined collectives) add up their
parts. Async `-start` forms count once, `-done` not at all. A collective inside a loop body counts once
(the models here unroll their layers, so nothing is hidden that way).
"""

from __future__ import annotations

from microbench.hlo import parse as hlo

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def comm_fingerprint(hlo_text: str, num_devices: int) -> dict[str, dict[str, int]]:
  """{op: {"count", "bytes"}} for every collective type in the compiled program (absent: none)."""
  out: dict[str, dict[str, int]] = {}
  for ins in hlo.instructions(hlo_text):
    op, parts = ins.op, hlo.array_bytes(ins.type_text)
    if op not in OPS:
      continue
    if ins.async_start and op == "all-gather" and len(parts) >= 2:
      parts = parts[len(parts) // 2:]  # all-gather-start returns (inputs, outputs)
    size = sum(parts)
    if op == "reduce-scatter":
      size *= hlo.group_size(ins.rest, num_devices)
    entry = out.setdefault(op, {"count": 0, "bytes": 0})
    entry["count"] += 1
    entry["bytes"] += size
  return {op: out[op] for op in OPS if op in out}
