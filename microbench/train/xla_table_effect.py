"""What a collective performance table changed in a compiled training step (`microbench-train --xla_perf_table`).

The step is compiled with the table and again with the baseline (XLA's built-in table, or another table), and
the two schedules' async windows compared (hlo/schedule_diff.py). Why compile twice: XLA says nothing when it
does not read a table (a wrong key, an unreadable file), so "the table was used" must be seen in the program it
compiled; identical schedules where collectives inside a node exist say that XLA fell back, or that the table
agrees with what XLA assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from microbench.aot import gpu_compile
from microbench.hlo import schedule_diff

OPTION = "xla_gpu_experimental_collective_perf_table_path"
BUILTIN = "builtin"


def options_with(base: dict[str, Any] | None, table: str | None) -> dict[str, Any]:
  """The compile options with XLA reading `table` (None or BUILTIN: its built-in table)."""
  out = dict(base or {})
  out.pop(OPTION, None)
  if table and table != BUILTIN:
    out[OPTION] = table
  return out


def effect(compile_step: Callable[[dict[str, Any]], Any], base_options: dict[str, Any] | None, table: str,
           baseline: str | None, ours: dict[str, dict[str, int]]) -> dict[str, Any]:
  """The step's windows under `table` (`ours`, read from its compiled program) against `baseline`'s (compiled
  here)."""
  other, _ = gpu_compile.compile_for_target(compile_step, options_with(base_options, baseline))
  theirs = schedule_diff.windows_by_op(other.as_text())
  rows = schedule_diff.compare(theirs, ours)
  name = baseline or BUILTIN
  return {"table": table, "baseline": name, "windows": ours, "baseline_windows": theirs, "rows": rows,
          "same_schedule": not any(r["changed"] for r in rows),
          "lines": schedule_diff.lines(rows, f"{name} table" if name == BUILTIN else name, table)}
