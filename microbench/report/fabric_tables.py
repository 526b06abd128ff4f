"""Predictions on a described fabric as tables: a collective's time and busbw for chosen group shapes and
sizes, and busbw against GPU count (how a collective scales on a machine before anyone runs it there)."""

from __future__ import annotations

from collections.abc import Sequence

from microbench.fabric import collective_model as fc
from microbench.fabric.description import Fabric
from microbench.report import tables

HEADERS = ["collective", "ranks", "shape", "size", "algorithm", "time_us", "busbw_gbps", "bottleneck"]


def prediction_rows(fab: Fabric, collectives: Sequence[str], shapes: Sequence[fc.Shape], sizes: Sequence[float],
                    algorithm: str = "auto") -> list[list[str]]:
  rows = []
  for coll in collectives:
    for shape in shapes:
      for size in sizes:
        p = fc.predict(fab, coll, size, shape, algorithm)
        rows.append([coll, str(p.ranks), p.shape, tables.size_text(int(size)), p.algorithm, f"{p.time_us:.4g}",
                     f"{p.busbw_gbps:.4g}", p.bottleneck])
  return rows


def assumptions(fab: Fabric, collectives: Sequence[str], shapes: Sequence[fc.Shape], size: float,
                algorithm: str = "auto") -> list[str]:
  """What the table's predictions assumed, each once (the shape lines are in the table itself)."""
  seen: dict[str, None] = {}
  for coll in collectives:
    for shape in shapes:
      for a in fc.predict(fab, coll, size, shape, algorithm).assumed:
        if not a.startswith("ranks spread"):
          seen[a] = None
  return list(seen)


def scaling_rows(fab: Fabric, collective: str, size: float, gpu_counts: Sequence[int],
                 algorithm: str = "auto") -> list[list[str]]:
  """busbw against GPU count, the ranks filling nodes, leaves and groups in order."""
  rows = []
  for g in gpu_counts:
    p = fc.predict(fab, collective, size, fc.dense_shape(fab, g), algorithm)
    rows.append([str(g), p.shape, p.algorithm, f"{p.busbw_gbps:.4g}", p.bottleneck])
  return rows


SCALING_HEADERS = ["GPUs", "shape", "algorithm", "busbw_gbps", "bottleneck"]
