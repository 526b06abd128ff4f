"""The report's tables, as rows (for tests and CSV) and as Markdown: average busbw with the share of the
link peak, points that were skipped, wrong or straggling, run-to-run ratios, and training runs side by
side. No plotting here."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

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
                 "busbw A (GB/s)", "busbw B (GB/s)", "busbw B/A", "time B/A low", "time B/A high", "changed")
BOOTSTRAP = 2000  # resamples per point: the 2.5/97.5 percentiles move by under 1% between seeds at this count
CONFIDENCE = 0.95
SEED = 0  # fixed, so the same two runs always give the same report


def median_ratio_draws(a_us: Sequence[float] | None, b_us: Sequence[float] | None,
                       rng: np.random.Generator) -> np.ndarray | None:
  """Bootstrap draws of median(B) / median(A), each run's samples resampled on their own.

  Why a bootstrap: the two sample sets are independent and of any size (a point stops after a few pairs),
  a ratio of medians has no closed-form interval, and the percentile bootstrap needs no distribution; the
  draws also give the series' geometric-mean interval by combining points draw by draw. None without
  samples in both runs (older run folders): no interval rather than a false one."""
  if not a_us or not b_us or len(a_us) < 2 or len(b_us) < 2:
    return None
  a = np.asarray(a_us, np.float64)
  b = np.asarray(b_us, np.float64)
  ma = np.median(a[rng.integers(0, a.size, (BOOTSTRAP, a.size))], axis=1)
  mb = np.median(b[rng.integers(0, b.size, (BOOTSTRAP, b.size))], axis=1)
  return mb / ma


def interval(draws: np.ndarray | None) -> tuple[float | None, float | None]:
  if draws is None:
    return None, None
  tail = 100 * (1 - CONFIDENCE) / 2
  lo, hi = np.percentile(draws, [tail, 100 - tail])
  return float(lo), float(hi)


def change(lo: float | None, hi: float | None) -> str:
  """A point changed only when its interval excludes 1: "slower" (B takes longer), "faster", "no", or
  "unknown" without samples."""
  if lo is None or hi is None:
    return "unknown"
  return "slower" if lo > 1 else "faster" if hi < 1 else "no"


def ratio_rows(a: Iterable[dict[str, Any]], b: Iterable[dict[str, Any]]) -> dict[str, Any]:
  """Points measured in both runs (matched on collective, scope, dtype, group size and bytes) with run B
  over run A for time and busbw, the time ratio's bootstrap interval and whether it changed; the points
  only one of them has (with their status); and "draws": the bootstrap draws per matched point."""
  a_by = {point_key(r): r for r in a}
  b_by = {point_key(r): r for r in b}
  rng = np.random.default_rng(SEED)
  both, only_a, only_b, draws = [], [], [], {}
  for k, ra in a_by.items():
    rb = b_by.get(k)
    if rb is not None and ra.get("status") == "ok" and rb.get("status") == "ok":
      d = median_ratio_draws(ra.get("samples_us"), rb.get("samples_us"), rng)
      lo, hi = interval(d)
      draws[k] = d
      both.append((*k, ra["time_us"], rb["time_us"], rb["time_us"] / ra["time_us"], ra["busbw_gbps"],
                   rb["busbw_gbps"], rb["busbw_gbps"] / ra["busbw_gbps"] if ra["busbw_gbps"] else None,
                   lo, hi, change(lo, hi)))
    else:
      only_a.append((*k, ra.get("status"), None if rb is None else rb.get("status")))
  for k, rb in b_by.items():
    if k not in a_by:
      only_b.append((*k, None, rb.get("status")))
  return {"both": both, "only_a": only_a, "only_b": only_b, "draws": draws}


RATIO_SUMMARY_HEADERS = ("collective", "scope", "dtype", "n", "points", "slower", "faster", "unchanged",
                         "no samples", "time B/A geomean", "geomean low", "geomean high", "time B/A min",
                         "time B/A max", "busbw B/A geomean")


def _geo(xs: Iterable[float]) -> float | None:
  xs = [x for x in xs if x and x > 0]
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def ratio_summary(rows: list[tuple[Any, ...]],
                  draws: dict[PointKey, np.ndarray | None] | None = None) -> list[tuple[Any, ...]]:
  """Per series: how many points changed and which way, and the geometric mean of the per-point ratios
  with an interval from the points' bootstrap draws combined draw by draw (only when every point has them)."""
  groups: dict[SeriesKey, list[tuple[Any, ...]]] = {}
  for r in rows:
    groups.setdefault(r[:4], []).append(r)
  out = []
  for k, v in groups.items():
    ds = [(draws or {}).get(tuple(r[:5])) for r in v]
    lo = hi = None
    if ds and all(d is not None for d in ds):
      lo, hi = interval(np.exp(np.mean(np.log(np.stack(ds)), axis=0)))
    count = {c: sum(1 for r in v if r[13] == c) for c in ("slower", "faster", "no", "unknown")}
    out.append((*k, len(v), count["slower"], count["faster"], count["no"], count["unknown"],
                _geo([r[7] for r in v]), lo, hi, min(r[7] for r in v), max(r[7] for r in v),
                _geo([r[10] for r in v])))
  return out


def changed_text(summary: list[tuple[Any, ...]]) -> str:
  """One line a reader sees before the tables: how many points changed, in which direction."""
  n = sum(s[4] for s in summary)
  slower, faster, same, unknown = (sum(s[i] for s in summary) for i in (5, 6, 7, 8))
  text = (f"{slower + faster} of {n} point(s) changed ({slower} slower, {faster} faster, {same} unchanged) by a"
          f" {100 * CONFIDENCE:.0f}% bootstrap interval of the median-time ratio that excludes 1")
  return text + (f"; {unknown} without samples in both runs" if unknown else "") + "."


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
