"""A training step's communication fingerprint: count and bytes per collective type, read from the
compiled (partitioned, per-device) HLO text.

Bytes follow the nccl-tests size convention per device, so they compare with the collective sweep:
all-reduce the buffer, all-gather the output, reduce-scatter the input (output x group size),
all-to-all and collective-permute the buffer. Tuple results (XLA-combined collectives) add up their
parts. Async `-start` forms count once, `-done` not at all. A collective inside a while loop (scanned
layers, gradient-accumulation microbatches) counts once per iteration: XLA's known trip count multiplies
it, and `loops` lists each loop's per-iteration collectives with its trip count (a loop whose count XLA
does not know is counted once and listed with `trip_count: null`).
"""

from __future__ import annotations

from typing import Any

from microbench.hlo import parse as hlo

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


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


def comm_report(hlo_text: str, num_devices: int) -> dict[str, Any]:
  """{"ops": {op: {count, bytes, dtypes}} per step, "loops": [{body, trip_count, times, ops}]}."""
  placed, loops = hlo.placed_lines(hlo_text)
  total: dict[str, dict[str, Any]] = {}
  per_loop: dict[str, dict[str, dict[str, Any]]] = {}
  for p in placed:
    for ins in hlo.instructions(p.line):
      if ins.op not in OPS or p.runs == 0:
        continue
      parts = _parts(ins, num_devices)
      _add(total, ins.op, p.runs, parts)
      if p.loop is not None:
        loop = next(lp for lp in loops if lp.body == p.loop)
        _add(per_loop.setdefault(p.loop, {}), ins.op, p.runs // ((loop.trip_count or 1) * max(loop.times, 1)),
             parts)
  loop_rows = [{"body": lp.body, "trip_count": lp.trip_count, "times": lp.times, "ops": _ordered(per_loop[lp.body])}
               for lp in loops if lp.body in per_loop]
  return {"ops": _ordered(total), "loops": loop_rows}


def comm_fingerprint(hlo_text: str, num_devices: int) -> dict[str, dict[str, Any]]:
  """{op: {"count", "bytes", "dtypes"}} per step for every collective type in the program (absent: none)."""
  return comm_report(hlo_text, num_devices)["ops"]
