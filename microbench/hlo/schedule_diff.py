"""Two schedules of one program compared by what runs inside each kind of collective's async window.

XLA:GPU's latency-hiding scheduler moves independent work between a collective's start and done as far as its
cost model says the transfer lasts: a collective it believes slower gets more work put beside it. So a change
of cost model (a measured performance table, SoL options) shows in the compiled program as windows that hold
more or fewer instructions, and a table XLA did not read shows as no change at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from microbench.hlo import async_windows, parse


def windows_by_op(hlo_text: str) -> dict[str, dict[str, int]]:
  """Per collective kind: its async windows, the instructions scheduled inside them, and of those the matrix
  multiplications (the compute that hides a transfer)."""
  comps = parse.computations(hlo_text)
  out: dict[str, dict[str, int]] = {}
  for w in async_windows.windows(hlo_text, comps):
    row = out.setdefault(w.op, {"windows": 0, "inside": 0, "dots_inside": 0})
    row["windows"] += 1
    row["inside"] += len(w.between)
    row["dots_inside"] += sum(async_windows.runs_dot(i, comps) for i in w.between)
  return dict(sorted(out.items()))


def compare(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
  """One row per collective kind of either schedule: the counts in A and B and the change in instructions
  inside its windows (B against A, None where A has none)."""
  rows = []
  for op in sorted(set(a) | set(b)):
    ra, rb = a.get(op, {}), b.get(op, {})
    ia, ib = ra.get("inside", 0), rb.get("inside", 0)
    rows.append({"op": op, "windows": (ra.get("windows", 0), rb.get("windows", 0)), "inside": (ia, ib),
                 "dots_inside": (ra.get("dots_inside", 0), rb.get("dots_inside", 0)),
                 "change": (ib - ia) / ia if ia else None, "changed": ra != rb})
  return rows


def lines(rows: Sequence[dict[str, Any]], a_name: str, b_name: str) -> list[str]:
  """The comparison as lines, the changed kinds first; one line when nothing changed."""
  changed = [r for r in rows if r["changed"]]
  if not changed:
    return [f"the schedule is the same under {b_name} as under {a_name}: no collective's window changed"]
  out = []
  for r in changed:
    pct = f" ({r['change']:+.0%})" if r["change"] is not None else ""
    out.append(f"{r['op']}: {r['windows'][0]} -> {r['windows'][1]} windows, {r['inside'][0]} -> {r['inside'][1]}"
               f" instructions inside{pct}, {r['dots_inside'][0]} -> {r['dots_inside'][1]} matrix multiplications"
               f" ({a_name} -> {b_name})")
  return out
