"""The report's tables, as rows (for tests and CSV) and as Markdown: average busbw with the share of the
link peak, points that were skipped, wrong or straggling, run-to-run ratios, and training runs side by
side. No plotting here."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from microbench.output import table

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
                   "peak (GB/s)", "max busbw % of peak", "expected there (GB/s)", "measured / expected there",
                   "LOW points", "what the platform's form of the op adds")


def summary_rows(records: Iterable[dict[str, Any]]) -> list[tuple[Any, ...]]:
  """nccl-tests' "Avg bus bandwidth" per series, with the best busbw, its share of the link peak and what the
  fabric model expected at that size (empty where the run had no expectation), the series' LOW points, and
  what the platform's form of the op adds to what was timed (XLA:TPU's all-reduce standing in for an
  all-gather, message-sized re-tilings: table.form_text; at the best point, or each distinct one)."""
  rows = []
  for (c, s, d, n), recs in by_series(ok(records)).items():
    bw = [r["busbw_gbps"] for r in recs]
    best = max(recs, key=lambda r: r["busbw_gbps"])
    has = any("vs_expected" in r for r in recs)
    forms = list(dict.fromkeys(table.form_text(r.get("form")) for r in recs if r.get("form")))
    rows.append((c, s, d, n, len(recs), sum(bw) / len(bw), best["busbw_gbps"], best.get("peak_gbps"),
                 best.get("busbw_pct_of_peak"), best.get("expected_busbw_gbps"), best.get("vs_expected"),
                 sum(bool(r.get("low")) for r in recs) if has else None, " / ".join(forms) or None))
  return rows


def problem_rows(records: Iterable[dict[str, Any]]) -> dict[str, list[tuple[Any, ...]]]:
  """Points a reader must not miss: not measured (skipped, failed HLO check), wrong, stragglers."""
  out: dict[str, list[tuple[Any, ...]]] = {"not measured": [], "wrong": [], "stragglers": [],
                                           "far below the fabric model (LOW)": []}
  for r in records:
    where = (r["collective"], r["scope"], r["dtype"], size_text(r.get("bytes") or r.get("requested_bytes") or 0))
    if r.get("status") != "ok":
      out["not measured"].append((*where, r.get("status"), r.get("reason", "")))
    elif (r.get("wrong") or 0) > 0:
      out["wrong"].append((*where, r["wrong"], ""))
    elif r.get("straggler"):
      out["stragglers"].append((*where, r.get("slowest_rank"), f"spread {100 * (r.get('time_spread') or 0):.0f}%"))
    if r.get("status") == "ok" and r.get("low"):
      out["far below the fabric model (LOW)"].append(
          (*where, f"{r['vs_expected']:.2f} x expected", f"{r['busbw_gbps']:.4g} of {r['expected_busbw_gbps']:.4g}"
           f" GB/s busbw, {r.get('expected_algorithm')}, {r.get('expected_bound')}-bound"))
  return out


# --- two sweeps ------------------------------------------------------------------------------------

RATIO_HEADERS = ("collective", "scope", "dtype", "n", "bytes", "time A (us)", "time B (us)", "time B/A",
                 "busbw A (GB/s)", "busbw B (GB/s)", "busbw B/A", "time B/A low", "time B/A high", "changed",
                 "runs A", "runs B", "interval from")
BOOTSTRAP = 2000  # resamples per point at least: the percentiles move by under 1% between seeds at this count
CONFIDENCE = 0.95  # for all intervals of one comparison together (simultaneous), not for each on its own
SEED = 0  # fixed, so the same two runs always give the same report
RUNS = "runs"  # interval from the spread of the run medians (several runs on a side): includes run-to-run drift
SAMPLES = "samples"  # from the samples within one run per side only: blind to drift between runs

Side = Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]]  # one run's records, or several runs'


def _runs(side: Side) -> list[list[dict[str, Any]]]:
  """A side of a comparison as a list of runs (each a list of records); one run's records are one run."""
  side = list(side)
  if not side or isinstance(side[0], dict):
    return [side]  # type: ignore[list-item]
  return [list(r) for r in side]


def _tail(points: int) -> float:
  """The one-sided tail per interval: Bonferroni over the comparison's `points` intervals, so that with two
  runs from one distribution no point at all is marked changed in CONFIDENCE of comparisons (per-point 95%
  intervals would mark about 1 in 20 points of every identical pair)."""
  return (1 - CONFIDENCE) / (2 * max(1, points))


def median_ratio_draws(a_us: Sequence[float] | None, b_us: Sequence[float] | None,
                       rng: np.random.Generator, draws: int = BOOTSTRAP) -> np.ndarray | None:
  """Bootstrap draws of median(B) / median(A), each run's samples resampled on their own.

  Why a bootstrap: the two sample sets are independent and of any size (a point stops after a few pairs),
  a ratio of medians has no closed-form interval, and the percentile bootstrap needs no distribution; the
  draws also give the series' geometric-mean interval by combining points draw by draw. None without
  samples in both runs (older run folders): no interval rather than a false one."""
  if not a_us or not b_us or len(a_us) < 2 or len(b_us) < 2:
    return None
  a = np.asarray(a_us, np.float64)
  b = np.asarray(b_us, np.float64)
  ma = np.median(a[rng.integers(0, a.size, (draws, a.size))], axis=1)
  mb = np.median(b[rng.integers(0, b.size, (draws, b.size))], axis=1)
  if (ma <= 0).any() or (mb <= 0).any():  # a time by difference that can come out <= 0 is not resolved
    return None
  return mb / ma


def interval(draws: np.ndarray | None, tail: float = (1 - CONFIDENCE) / 2) -> tuple[float | None, float | None]:
  if draws is None:
    return None, None
  lo, hi = np.percentile(draws, [100 * tail, 100 * (1 - tail)])
  return float(lo), float(hi)


def _t(tail: float, df: float) -> float:
  """Student's t quantile with `df` degrees of freedom, upper `tail` (scipy comes with jax)."""
  from scipy import special  # pylint: disable=g-import-not-at-top
  return float(special.stdtrit(df, 1 - tail))


def change(lo: float | None, hi: float | None) -> str:
  """A point changed only when its interval excludes 1: "slower" (B takes longer), "faster", "no", or
  "unknown" without an interval."""
  if lo is None or hi is None:
    return "unknown"
  return "slower" if lo > 1 else "faster" if hi < 1 else "no"


def _by_point(runs: list[list[dict[str, Any]]]) -> dict[PointKey, list[dict[str, Any]]]:
  out: dict[PointKey, list[dict[str, Any]]] = {}
  for recs in runs:
    for r in recs:
      out.setdefault(point_key(r), []).append(r)
  return out


def _log_times(recs: list[dict[str, Any]]) -> np.ndarray:
  return np.log(np.asarray([r["time_us"] for r in recs], np.float64))


_Matched = tuple[PointKey, list[dict[str, Any]], list[dict[str, Any]]]  # a point, its ok records on A and on B


def _match(a_by: dict[PointKey, list[dict[str, Any]]],
           b_by: dict[PointKey, list[dict[str, Any]]]) -> tuple[list[_Matched], list[tuple], list[tuple]]:
  """The points both sides resolved (ok, with a time > 0), and those only one side has, with their status."""
  matched: list[_Matched] = []
  only_a, only_b = [], []
  for k, ras in a_by.items():
    oka = [r for r in ok(ras) if (r.get("time_us") or 0) > 0]  # a time <= 0 (by difference) is not resolved
    okb = [r for r in ok(b_by.get(k, [])) if (r.get("time_us") or 0) > 0]
    if oka and okb:
      matched.append((k, oka, okb))
    else:
      rbs = b_by.get(k)
      only_a.append((*k, "ok" if oka else ras[0].get("status"),
                     None if not rbs else "ok" if okb else rbs[0].get("status")))
  for k, rbs in b_by.items():
    if k not in a_by:
      only_b.append((*k, None, rbs[0].get("status")))
  return matched, only_a, only_b


def _pooled_spread(matched: list[_Matched]) -> dict[SeriesKey, list[float]]:
  """The spread between runs, pooled per series: sum of squares of log run medians about their side's mean,
  and its degrees of freedom."""
  pooled: dict[SeriesKey, list[float]] = {}
  for k, ras, rbs in matched:
    acc = pooled.setdefault(k[:4], [0.0, 0.0])
    for recs in (ras, rbs):
      x = _log_times(recs)
      acc[0] += float(np.sum((x - x.mean()) ** 2))
      acc[1] += x.size - 1
  return pooled


def _mean_busbw(recs: list[dict[str, Any]]) -> float | None:
  """The geometric mean of the runs' busbw, or None where a run has none."""
  if not all(r.get("busbw_gbps") for r in recs):
    return None
  return math.exp(float(np.mean(np.log([r["busbw_gbps"] for r in recs]))))


def _point_row(k: PointKey, ras: list[dict[str, Any]], rbs: list[dict[str, Any]], spread: list[float],
               tail: float, rng: np.random.Generator,
               draw_count: int) -> tuple[tuple[Any, ...], str | np.ndarray | None]:
  """One matched point's row, and what its series' interval is made of: RUNS (Student's t on the spread
  between runs) or the point's bootstrap draws of the samples within one run per side."""
  xa, xb = _log_times(ras), _log_times(rbs)
  d = float(xb.mean() - xa.mean())
  ss, df = spread
  part: str | np.ndarray | None
  if df > 0:
    own_df = xa.size + xb.size - 2
    own = (float(np.sum((xa - xa.mean()) ** 2) + np.sum((xb - xb.mean()) ** 2)) / own_df) if own_df else 0.0
    se = math.sqrt(max(ss / df, own) * (1 / xa.size + 1 / xb.size))
    q = _t(tail, df)
    lo, hi, how = math.exp(d - q * se), math.exp(d + q * se), RUNS
    part = RUNS
  else:
    draws = median_ratio_draws(ras[0].get("samples_us"), rbs[0].get("samples_us"), rng, draw_count)
    (lo, hi), how = interval(draws, tail), SAMPLES if draws is not None else None
    part = draws
  bwa, bwb = _mean_busbw(ras), _mean_busbw(rbs)
  row = (*k, math.exp(float(xa.mean())), math.exp(float(xb.mean())), math.exp(d), bwa, bwb,
         bwb / bwa if bwa and bwb else None, lo, hi, change(lo, hi), xa.size, xb.size, how)
  return row, part


def _series_intervals(series_parts: dict[SeriesKey, list[str | np.ndarray | None]], matched: list[_Matched],
                      ka: int, kb: int, tail: float) -> dict[SeriesKey, tuple[float | None, float | None]]:
  """Each series' interval on its geometric-mean ratio: from the runs where every point has several per
  side, from the points' bootstrap draws combined draw by draw where none has, else none."""
  series_interval: dict[SeriesKey, tuple[float | None, float | None]] = {}
  for s, parts in series_parts.items():
    if all(isinstance(p, str) for p in parts):  # RUNS
      series_interval[s] = _series_t([(ras, rbs) for k, ras, rbs in matched if k[:4] == s], ka, kb, tail)
    elif all(isinstance(p, np.ndarray) for p in parts):  # bootstrap draws combined draw by draw
      series_interval[s] = interval(np.exp(np.mean(np.log(np.stack(parts)), axis=0)), tail)
    else:
      series_interval[s] = (None, None)
  return series_interval


def ratio_of(row: tuple[Any, ...]) -> tuple[PointKey, float, float | None, float | None]:
  """A `ratio_rows` row's point, time ratio B/A and its interval (RATIO_HEADERS gives every column)."""
  return row[:5], row[7], row[11], row[12]


def ratio_rows(a: Side, b: Side) -> dict[str, Any]:
  """Run(s) B against run(s) A per point (matched on collective, scope, dtype, group size and bytes): each
  side's time is the geometric mean of its runs' median times (busbw likewise), with an interval on the time
  ratio and whether it changed; the points only one side has (with their status); and "series_interval":
  the interval of each series' geometric-mean ratio.

  The interval must hold what moves between two runs of the same thing. With several runs on a side
  ("interval from" = runs) it is Student's t on the difference of mean log run medians, the variance pooled
  over the series' points (a point whose own spread is larger keeps its own): each run's median already
  carries that run's sampling noise, and the spread between runs adds the drift between them (other jobs,
  clocks, placement), which on a shared machine is the larger part. With one run on each side there is no
  spread between runs to measure: the interval is a bootstrap of the samples within each run (as before
  runs could be grouped), and the report says it cannot see drift. Every interval of one comparison is
  simultaneous at CONFIDENCE (Bonferroni over its points; the series' intervals over its series, from the
  runs' mean over the series, as `_series_t` says)."""
  a_runs, b_runs = _runs(a), _runs(b)
  matched, only_a, only_b = _match(_by_point(a_runs), _by_point(b_runs))
  pooled = _pooled_spread(matched)
  tail = _tail(len(matched))
  draw_count = max(BOOTSTRAP, int(math.ceil(20 / tail)))  # 20 draws beyond each bound at least
  rng = np.random.default_rng(SEED)
  both = []
  series_parts: dict[SeriesKey, list[str | np.ndarray | None]] = {}  # RUNS, or the point's bootstrap draws
  for k, ras, rbs in matched:
    row, part = _point_row(k, ras, rbs, pooled[k[:4]], tail, rng, draw_count)
    both.append(row)
    series_parts.setdefault(k[:4], []).append(part)
  series_interval = _series_intervals(series_parts, matched, len(a_runs), len(b_runs), _tail(len(pooled)))
  return {"both": both, "only_a": only_a, "only_b": only_b, "series_interval": series_interval,
          "runs": (len(a_runs), len(b_runs))}


def _series_t(points: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]], ka: int, kb: int,
              tail: float) -> tuple[float | None, float | None]:
  """The series' geometric-mean ratio from each run's mean log time over the points every run (ka on A, kb
  on B) has: drift often moves all points of a run together (a busy minute), so the runs, not the points,
  are the independent draws; Student's t over ka + kb - 2 degrees of freedom."""
  full = [(ras, rbs) for ras, rbs in points if len(ras) == ka and len(rbs) == kb]  # in run order
  if ka + kb < 3 or not full:
    return None, None
  xa = np.mean([_log_times(ras) for ras, _ in full], axis=0)  # per run of A: its mean log time
  xb = np.mean([_log_times(rbs) for _, rbs in full], axis=0)
  ss = float(np.sum((xa - xa.mean()) ** 2) + np.sum((xb - xb.mean()) ** 2))
  df = ka + kb - 2
  d = float(xb.mean() - xa.mean())
  se = math.sqrt(ss / df * (1 / ka + 1 / kb))
  q = _t(tail, df)
  return math.exp(d - q * se), math.exp(d + q * se)


RATIO_SUMMARY_HEADERS = ("collective", "scope", "dtype", "n", "points", "slower", "faster", "unchanged",
                         "no interval", "time B/A geomean", "geomean low", "geomean high", "time B/A min",
                         "time B/A max", "busbw B/A geomean")


def _geo(xs: Iterable[float]) -> float | None:
  xs = [x for x in xs if x and x > 0]
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def ratio_summary(rows: list[tuple[Any, ...]],
                  series_interval: dict[SeriesKey, tuple[float | None, float | None]] | None = None
                  ) -> list[tuple[Any, ...]]:
  """Per series: how many points changed and which way, and the geometric mean of the per-point ratios
  with its interval (ratio_rows' "series_interval")."""
  groups: dict[SeriesKey, list[tuple[Any, ...]]] = {}
  for r in rows:
    groups.setdefault(r[:4], []).append(r)
  out = []
  for k, v in groups.items():
    lo, hi = (series_interval or {}).get(k, (None, None))
    count = {c: sum(1 for r in v if r[13] == c) for c in ("slower", "faster", "no", "unknown")}
    out.append((*k, len(v), count["slower"], count["faster"], count["no"], count["unknown"],
                _geo([r[7] for r in v]), lo, hi, min(r[7] for r in v), max(r[7] for r in v),
                _geo([r[10] for r in v])))
  return out


def changed_text(summary: list[tuple[Any, ...]], runs: tuple[int, int] = (1, 1)) -> str:
  """One line a reader sees before the tables: how many points changed, in which direction, and what noise
  the intervals cover (`runs`: how many runs on side A and side B)."""
  n = sum(s[4] for s in summary)
  slower, faster, same, unknown = (sum(s[i] for s in summary) for i in (5, 6, 7, 8))
  text = (f"{slower + faster} of {n} point(s) changed ({slower} slower, {faster} faster, {same} unchanged): the"
          f" time ratio's interval excludes 1, all {n} intervals holding together at {100 * CONFIDENCE:.0f}%")
  if max(runs) > 1:
    text += f", from the spread between runs ({runs[0]} run(s) A, {runs[1]} run(s) B: drift between runs included)"
  else:
    text += (", from the samples within each run only: drift between runs is not in it, and on a shared"
             " machine it is larger; give several runs per side (`A1 A2 vs B1 B2`)")
  return text + (f"; {unknown} without an interval (no samples, or a time not resolved)" if unknown else "") + "."


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
