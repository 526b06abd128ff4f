"""What a sweep leaves behind: results.jsonl (flushed per point), results.csv (the same records, flat, for
spreadsheets), meta.json and TensorBoard events.

Only process 0 writes; other processes get a writer that does nothing, so callers need no rank checks.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from microbench.output import jsonl
from microbench.output.tensorboard import TensorBoardLog

RESULTS = "results.jsonl"
RESULTS_CSV = "results.csv"
META = "meta.json"
# Columns a reader looks for first; every other field follows in name order.
CSV_LEAD = ("collective", "scope", "dtype", "bytes", "requested_bytes", "count", "group_size", "num_groups",
            "time_us", "algbw_gbps", "busbw_gbps", "peak_gbps", "busbw_pct_of_peak", "peak_algorithm", "wrong", "status",
            "reason")


def default_name(*parts: str) -> str:
  """A new run folder's name: the parts, the UTC time to the second, and the testbed job's number where one
  runs (MICROBENCH_JOB): jobs that `microbench-testbed run` starts in the same second get folders of their own."""
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
  job = os.environ.get("MICROBENCH_JOB")
  return "_".join((*parts, stamp)) + (f"-job{job}" if job else "")


def _size_name(nbytes: int) -> str:
  for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
    if nbytes >= 1 << shift:
      return f"{nbytes >> shift} {unit}"
  return f"{nbytes} B"


def _size_step_text() -> str:
  """The run's `x_axis` text: the rule in one sentence, then every power of two as a table (row = the step's
  hundreds, column = the rest), which TensorBoard's Text tab renders as a grid."""
  head = "| step | " + " | ".join(f"+{d}" for d in range(0, 100, 10)) + " |"
  rows = [f"| **{h}** | " + " | ".join(_size_name(1 << (h + d) // 10) for d in range(0, 100, 10)) + " |"
          for h in (0, 100, 200, 300)]
  return ("Collective sweeps put each size at **step = round(10 x log2(bytes))**: every doubling is 10 steps,"
          " so 200 = 1 MiB and 230 = 8 MiB. Sizes between powers of two fall between (216 = 3 MiB); exact sizes"
          " are in results.jsonl.\n\n" + head + "\n|---|" + "---|" * 10 + "\n" + "\n".join(rows) +
          "\n\nSet smoothing to 0: a size sweep is not a noisy time series.")


# TensorBoard's x axis is the step, linear: with bytes as the step every size below the last few is crushed
# against zero. The step is ten times log2 of the size, so every doubling is 10 steps (sweeps with a step
# factor down to 1.07 keep distinct steps) and the exact bytes stay in the records.
SIZE_STEP_TEXT = _size_step_text()
_BY_COLLECTIVE = "per collective: a line per scope/dtype; step = 10 log2(bytes)"
_BY_SCOPE = "per scope: a line per collective/dtype; step = 10 log2(bytes)"
METRICS = (("busbw_gbps", "busbw (GB/s)"), ("time_us", "time (us)"), ("busbw_pct_of_peak", "busbw % of peak"))
PEAK_ONLY = ("busbw_pct_of_peak",)  # written only where the record's link peak is known


# Consecutive sizes a factor f apart are 10 x log2(f) steps apart: below 2^0.1 two sizes could round to one step.
MIN_STEP_FACTOR = 2 ** 0.1
# Each scalar tag's description (TensorBoard shows it beside the chart), so the x axis is explained where it is read.
STEP_NOTE = ("x = step = round(10 x log2(bytes)): 100 = 1 KiB, 200 = 1 MiB, 230 = 8 MiB, 300 = 1 GiB;"
             " exact sizes in results.jsonl.")
DESCRIPTIONS = {
    "busbw_gbps": "Bus bandwidth (GB/s) per size.",
    "time_us": "Median time per operation (us) per size.",
    "time_spread": "Slowest over fastest sample's time (time_us_max / time_us_min; 1 = no spread) per size.",
    "wrong": "Wrong elements found by the check at this size (0 expected).",
    "busbw_avg_gbps": ("Average busbw over the series' measured sizes (nccl-tests' 'Avg bus bandwidth'), written"
                       " once, at the series' largest size, when the run closes."),
}


def size_step(nbytes: int) -> int:
  return round(10 * math.log2(nbytes))


def sweep_layout(collectives: Sequence[str], scopes: Sequence[str],
                 peaked: Sequence[tuple[str, str]] = ()) -> list[tuple[str, list[tuple[str, list[str]]]]]:
  """Custom Scalars: per metric, one chart per collective (a line per scope and dtype) and one chart per scope
  (a line per collective and dtype). Titles are the same in every run, so TensorBoard merges runs' charts.

  `busbw % of peak` only exists where a record's link peak is known: its charts are drawn only for the
  collectives and scopes of `peaked` ((collective, scope) pairs with a known peak), and its categories not
  at all when none is (every CPU run), so the default view has no empty charts."""
  have_c, have_s = {c for c, _ in peaked}, {s for _, s in peaked}
  cats = []
  for tag, name in METRICS:
    charts = [(f"{c}: {name}", [f"^{tag}/{c}/"]) for c in collectives if tag not in PEAK_ONLY or c in have_c]
    if charts:
      cats.append((f"{name} {_BY_COLLECTIVE}", charts))
  for tag, name in METRICS:
    charts = [(f"{s}: {name}", [f"^{tag}/[^/]+/{s}/"]) for s in scopes if tag not in PEAK_ONLY or s in have_s]
    if charts:
      cats.append((f"{name} {_BY_SCOPE}", charts))
  return cats


def peaked_series(records: Sequence[dict[str, Any]]) -> set[tuple[str, str]]:
  """(collective, scope) of the measured records whose busbw has a known link peak."""
  return {(r["collective"], r["scope"]) for r in records
          if r.get("status") == "ok" and r.get("busbw_pct_of_peak") is not None}


def point_key(rec: dict[str, Any]) -> tuple:
  return (rec["collective"], rec["scope"], rec["dtype"], rec["requested_bytes"])


def point_keys(rec: dict[str, Any]) -> list[tuple]:
  """The requested points a record answers (several requested sizes may round to one count, measured once)."""
  return [(rec["collective"], rec["scope"], rec["dtype"], b)
          for b in [rec["requested_bytes"], *rec.get("also_requested", [])]]


def latest(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """One record per point, the last one written (a resumed run may re-measure skipped points)."""
  return list({point_key(r): r for r in records}.values())


def flatten(rec: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  """One level of columns: nested objects become `outer.inner`; lists stay one cell (JSON text)."""
  out: dict[str, Any] = {}
  for k, v in rec.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _cell(v: Any) -> str:
  if v is None:
    return ""
  if isinstance(v, (bool, list)):
    return json.dumps(v)  # true/false and [..] as in the JSONL
  return repr(v) if isinstance(v, float) else str(v)


def write_csv(path: str, records: list[dict[str, Any]]) -> list[str]:
  """All records as one table (the union of their fields), replaced atomically so a reader never sees
  half a file; a field a record lacks is an empty cell. Returns the columns (the header) written."""
  rows = [flatten(r) for r in records]
  names = {k for row in rows for k in row}
  columns = [c for c in CSV_LEAD if c in names] + sorted(names - set(CSV_LEAD))
  tmp = path + ".tmp"
  with open(tmp, "w", newline="", encoding="utf-8") as f:
    w = csv.writer(f)
    w.writerow(columns)
    for row in rows:
      w.writerow([_cell(row.get(c)) for c in columns])
  os.replace(tmp, path)
  return columns


def read_results(outdir: str) -> list[dict[str, Any]]:
  """Every complete JSON line of a run's results (a torn last line from a crash is ignored)."""
  return jsonl.read(os.path.join(outdir, RESULTS))


def read_meta(outdir: str) -> dict[str, Any] | None:
  """A run's meta.json (None when it has none); ValueError naming the file when it isn't JSON."""
  path = os.path.join(outdir, META)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    try:
      return json.load(f)
    except ValueError as e:
      raise ValueError(f"{path}: not JSON ({e})") from None


class RunOutputs:
  """Writes a run folder: one JSON line, the CSV and TensorBoard points per finished point, as it finishes."""

  def __init__(self, outdir: str, enabled: bool = True, stream: TextIO | None = None):
    self.outdir = outdir
    self.enabled = enabled
    self.stream = stream  # None: whatever sys.stdout is when a line is printed
    self._results: TextIO | None = None
    self._tb: TensorBoardLog | None = None
    if enabled:
      os.makedirs(outdir, exist_ok=True)
      jsonl.end_torn_line(os.path.join(outdir, RESULTS))
      self._rows = read_results(outdir)  # a resumed run's CSV keeps the earlier points
      self._csv_columns: list[str] | None = None  # the CSV's header as written (None: not written yet)
      self._results = open(os.path.join(outdir, RESULTS), "a")
      self._tb = TensorBoardLog(outdir)
    self._layout_of: tuple[list[str], list[str]] | None = None  # (collectives, scopes) once layout() ran
    self._peaked: set[tuple[str, str]] = set()

  def print(self, text: str = "") -> None:
    if self.enabled:
      print(text, file=self.stream or sys.stdout, flush=True)

  def write_meta(self, meta: dict[str, Any]) -> None:
    if not self.enabled:
      return
    tmp = os.path.join(self.outdir, META + ".tmp")
    with open(tmp, "w") as f:
      json.dump(meta, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, os.path.join(self.outdir, META))

  def text(self, tag: str, text: str) -> None:
    if self._tb:
      self._tb.text(tag, text)

  def layout(self, collectives: Sequence[str], scopes: Sequence[str]) -> None:
    """The Custom Scalars layout of this sweep and the x axis explained (the run's `x_axis` text). The layout
    is written again (at the step of the record that brings it) when a point's link peak first makes a
    `busbw % of peak` chart non-empty; TensorBoard reads a tag's last value, so it shows the newest layout."""
    if self._tb:
      self._layout_of = (list(collectives), list(scopes))
      self._peaked = peaked_series(self._rows)  # a resumed run's earlier points count
      self._tb.custom_scalars(sweep_layout(collectives, scopes, sorted(self._peaked)))
      self._tb.text("x_axis", SIZE_STEP_TEXT)

  def record(self, rec: dict[str, Any]) -> None:
    if not self.enabled:
      return
    self._results.write(json.dumps(rec, sort_keys=True) + "\n")
    self._results.flush()
    os.fsync(self._results.fileno())
    self._rows.append(rec)
    self._write_csv_row(rec)
    if rec["status"] == "ok" and self._tb:
      base, step = f"{rec['collective']}/{rec['scope']}/{rec['dtype']}", size_step(rec["bytes"])
      values = {tag: rec[tag] for tag, _ in METRICS if rec.get(tag) is not None}  # % of peak: None if unknown
      if rec.get("wrong") is not None:
        values["wrong"] = rec["wrong"]
      if rec.get("time_us_min") and rec.get("time_us_max") is not None:
        values["time_spread"] = rec["time_us_max"] / rec["time_us_min"]
      for tag, v in values.items():
        self._scalar(tag, base, v, step)
      self._grow_layout(rec, step)

  def _grow_layout(self, rec: dict[str, Any], step: int) -> None:
    """After the record's points (so the layout's step is not behind them, which TensorBoard would read as a
    restart): the layout again if this record is the first with a peak for its collective or scope."""
    if self._layout_of is None or rec.get("busbw_pct_of_peak") is None:
      return
    key = (rec["collective"], rec["scope"])
    known_c, known_s = {c for c, _ in self._peaked}, {s for _, s in self._peaked}
    self._peaked.add(key)
    if key[0] not in known_c or key[1] not in known_s:
      self._tb.custom_scalars(sweep_layout(*self._layout_of, sorted(self._peaked)), step=step)

  def _scalar(self, tag: str, base: str, value: float, step: int) -> None:
    desc = DESCRIPTIONS.get(tag, dict(METRICS).get(tag, tag)) + " " + STEP_NOTE
    self._tb.scalar(f"{tag}/{base}", value, step, description=desc)

  def _write_averages(self) -> None:
    """Each series' average busbw (this session's and any resumed points, latest per point) at its largest step."""
    series: dict[str, list[dict[str, Any]]] = {}
    for r in latest(self._rows):
      if r.get("status") == "ok" and r.get("busbw_gbps") is not None:
        series.setdefault(f"{r['collective']}/{r['scope']}/{r['dtype']}", []).append(r)
    for base, recs in series.items():
      self._scalar("busbw_avg_gbps", base, sum(r["busbw_gbps"] for r in recs) / len(recs),
                   size_step(max(r["bytes"] for r in recs)))

  def _write_csv_row(self, rec: dict[str, Any]) -> None:
    """Appends the record's row; the whole table is written again only when a record brings a new column
    (a long sweep would otherwise rewrite its CSV once per point: quadratic)."""
    path = os.path.join(self.outdir, RESULTS_CSV)
    row = flatten(rec)
    columns = self._csv_columns
    if columns is None or not set(row) <= set(columns) or not os.path.exists(path):
      self._csv_columns = write_csv(path, self._rows)
      return
    with open(path, "a", newline="", encoding="utf-8") as f:
      csv.writer(f).writerow([_cell(row.get(c)) for c in columns])

  def close(self) -> None:
    """Idempotent (a watchdog may close before the sweep's own exit path does)."""
    if self._results:
      self._results.close()
    if self._tb:
      self._write_averages()
      self._tb.close()
      self._tb = None
