"""The report's tables, as rows (for tests and CSV) and as Markdown: average busbw with the share of the
link peak, points that were skipped, wrong or straggling, run-to-run ratios, and training runs side by
side. No plotting here."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

SeriesKey = tuple[str, str, str, int]  # collective, scope, dtype, group size
PointKey = tuple[str, str, str, int, int]  # ... and bytes


def series_key(r: dict[str, Any]) -> SeriesKey:
  return (r["collective"], r["scope"], r["dtype"], int(r.get("group_size") or 0))


def point_key(r: dict[str, Any]) -> PointKey:
  return (*series_key(r), int(r.get("bytes") or r.get("requested_bytes") or 0))


def ok(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
  return [r for r in records if r.get("status") == "ok"]


def by_series(records: Iterable[dict[str, Any]]) -> dict[SeriesKey, list[dict[str, Any]]]:
  out: dict[SeriesKey, list[dict[str, Any]]] = {}
  for r in records:
    out.setdefault(series_key(r), []).append(r)
  return {k: sorted(v, key=lambda r: r["bytes"]) for k, v in out.items()}


def fmt(v: Any, digits: int = 3) -> str:
  if v is None:
    return "–"
  if isinstance(v, float):
    if not math.isfinite(v):
      return "–"
    return f"{v:.{digits}g}" if abs(v) >= 1e8 or (v and abs(v) < 1e-3) else f"{v:.{digits}f}"
  return str(v)


def size_text(n: float) -> str:
  """Binary units as the flags take them: 1K, 64K, 16M, 1G."""
  for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
    if n >= scale:
      return f"{n / scale:.3g}{unit}"
  return f"{int(n)}"


def markdown(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
  lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
  lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


# --- one sweep -------------------------------------------------------------------------------------

SUMMARY_HEADERS = ("collective", "scope", "dtype", "n", "points", "avg busbw (GB/s)", "max busbw (GB/s)",
                   "peak (GB/s)", "max busbw % of peak")


def summary_rows(records: Iterable[dict[str, Any]]) -> list[tuple[Any, ...]]:
  """nccl-tests' "Avg bus bandwidth" per series, with the best busbw and its share of the link peak."""
  rows = []
  for (c, s, d, n), recs in by_series(ok(records)).items():
    bw = [r["busbw_gbps"] for r in recs]
    best = max(recs, key=lambda r: r["busbw_gbps"])
    rows.append((c, s, d, n, len(recs), sum(bw) / len(bw), best["busbw_gbps"], best.get("peak_gbps"),
                 best.get("busbw_pct_of_peak")))
  return rows


def problem_rows(records: Iterable[dict[str, Any]]) -> dict[str, list[tuple[Any, ...]]]:
  """Points a reader must not miss: not measured (skipped, failed HLO check), wrong, stragglers."""
  out: dict[str, list[tuple[Any, ...]]] = {"not measured": [], "wrong": [], "stragglers": []}
  for r in records:
    where = (r["collective"], r["scope"], r["dtype"], size_text(r.get("bytes") or r.get("requested_bytes") or 0))
    if r.get("status") != "ok":
      out["not measured"].append((*where, r.get("status"), r.get("reason", "")))
    elif (r.get("wrong") or 0) > 0:
      out["wrong"].append((*where, r["wrong"], ""))
    elif r.get("straggler"):
      out["stragglers"].append((*where, r.get("slowest_rank"), f"spread {100 * (r.get('time_spread') or 0):.0f}%"))
  return out


# --- two sweeps ------------------------------------------------------------------------------------

RATIO_HEADERS = ("collective", "scope", "dtype", "n", "bytes", "time A (us)", "time B (us)", "time B/A",
                 "busbw A (GB/s)", "busbw B (GB/s)", "busbw B/A")


def ratio_rows(a: Iterable[dict[str, Any]], b: Iterable[dict[str, Any]]) -> dict[str, list[tuple[Any, ...]]]:
  """Points measured in both runs (matched on collective, scope, dtype, group size and bytes) with run B
  over run A for time and busbw; and the points only one of them has (with their status)."""
  a_by = {point_key(r): r for r in a}
  b_by = {point_key(r): r for r in b}
  both, only_a, only_b = [], [], []
  for k, ra in a_by.items():
    rb = b_by.get(k)
    if rb is not None and ra.get("status") == "ok" and rb.get("status") == "ok":
      both.append((*k, ra["time_us"], rb["time_us"], rb["time_us"] / ra["time_us"], ra["busbw_gbps"],
                   rb["busbw_gbps"], rb["busbw_gbps"] / ra["busbw_gbps"] if ra["busbw_gbps"] else None))
    else:
      only_a.append((*k, ra.get("status"), None if rb is None else rb.get("status")))
  for k, rb in b_by.items():
    if k not in a_by:
      only_b.append((*k, None, rb.get("status")))
  return {"both": both, "only_a": only_a, "only_b": only_b}


RATIO_SUMMARY_HEADERS = ("collective", "scope", "dtype", "n", "points", "time B/A geomean", "time B/A min",
                         "time B/A max", "busbw B/A geomean")


def ratio_summary(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
  """Per series: the geometric mean (and range) of the per-point ratios."""
  groups: dict[SeriesKey, list[tuple[Any, ...]]] = {}
  for r in rows:
    groups.setdefault(r[:4], []).append(r)

  def geo(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

  return [(*k, len(v), geo([r[7] for r in v]), min(r[7] for r in v), max(r[7] for r in v), geo([r[10] for r in v]))
          for k, v in groups.items()]


# --- training runs ---------------------------------------------------------------------------------

TRAIN_HEADERS = ("run", "model", "parallelism", "devices", "batch x seq", "dtype", "step (ms)", "items/s",
                 "items/s/device", "TFLOP/s/device", "MFU %", "memory/device (MiB)", "compile (s)")


def train_row(label: str, config: dict[str, Any], summary: dict[str, Any] | None) -> tuple[Any, ...]:
  """One training run's figures; read with .get so runs from other versions still line up."""
  s = summary or {}
  c = config or {}
  item = s.get("item") or ("images" if c.get("model") in ("vit", "resnet") else "tokens")
  model = f"{s.get('model', c.get('model'))}-{s.get('size', c.get('size'))} ({s.get('layers', c.get('layers'))} L)"
  step = s.get("median_step_time_s")
  mem = s.get("memory_per_device_bytes")
  mfu = s.get("mfu")
  return (label, model, s.get("parallelism", c.get("parallelism")), s.get("devices", c.get("devices")),
          f"{s.get('batch', c.get('batch'))} x {s.get('seq_len', c.get('seq_len'))}", s.get("dtype", c.get("dtype")),
          None if step is None else 1e3 * step, s.get(f"{item}_per_s"), s.get(f"{item}_per_s_per_device"),
          s.get("tflops_per_device"), None if mfu is None else 100 * mfu,
          None if mem is None else mem / 2**20, s.get("compile_time_s"))
