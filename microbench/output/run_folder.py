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
NCCL_SETTINGS = "nccl_settings.json"  # a sweep run once per NCCL setting (microbench --nccl_env): its runs, by setting
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
# The fabric model's expectation is a run of its own (RUN/expected) writing the measured run's tag names: every
# chart of a measured series (Time Series and Scalars cards are one tag each) then holds expected beside
# measured, told apart by run name and colour, as nccl-tests' run does for its busbw.
EXPECTED_RUN = "expected"
_CHARTS_NOTE = "a chart per collective and scope, the run's line beside its `<run>/expected` line where a fabric" \
               " model applies; x = step = 10 log2(bytes)"
# Tag prefixes in the order TensorBoard sorts them (Time Series and Scalars group cards by the prefix and open
# the first two groups): the size sweep first, the per-point checks (`time_us_spread`, `wrong`) last.
METRICS = (("busbw_gbps", "busbw (GB/s)"), ("busbw_pct_of_peak", "busbw % of peak"), ("time_us", "time (us)"),
           ("vs_expected", "measured / expected busbw"))
PEAK_ONLY = ("busbw_pct_of_peak",)  # written only where the record's link peak is known
EXPECTED_ONLY = ("vs_expected",)  # written only where the record carries the fabric model's expectation
EXPECTED_TAGS = ("busbw_gbps", "time_us")  # what RUN/expected writes


# Consecutive sizes a factor f apart are 10 x log2(f) steps apart: below 2^0.1 two sizes could round to one step.
MIN_STEP_FACTOR = 2 ** 0.1
# Each scalar tag's description (TensorBoard shows it beside the chart), so the x axis is explained where it is read.
STEP_NOTE = ("x = step = round(10 x log2(bytes)): 100 = 1 KiB, 200 = 1 MiB, 230 = 8 MiB, 300 = 1 GiB;"
             " exact sizes in results.jsonl.")
DESCRIPTIONS = {
    "busbw_gbps": "Bus bandwidth (GB/s) per size; the run `<run>/expected` holds the fabric model's.",
    "time_us": "Median time per operation (us) per size; the run `<run>/expected` holds the fabric model's.",
    "busbw_pct_of_peak": "busbw as a share of the link peak (%) per size.",
    "vs_expected": "Measured busbw over the fabric model's expected busbw per size (1 = as expected).",
    "time_us_spread": "Slowest over fastest sample's time (time_us_max / time_us_min; 1 = no spread) per size.",
    "wrong": "Wrong elements found by the check at this size (0 expected).",
}
EXPECTED_DESCRIPTIONS = {
    "busbw_gbps": "The fabric model's expected busbw (GB/s) per size (expected_busbw_gbps in results.jsonl).",
    "time_us": "The fabric model's expected time (us) per size: time_us x busbw_gbps / expected_busbw_gbps.",
}


def size_step(nbytes: int) -> int:
  return round(10 * math.log2(nbytes))


def sweep_layout(collectives: Sequence[str], scopes: Sequence[str], peaked: Sequence[tuple[str, str]] = (),
                 expected: Sequence[tuple[str, str]] = (),
                 dtypes: Sequence[str] = ()) -> list[tuple[str, list[tuple[str, list[str]]]]]:
  """Custom Scalars: per metric, one chart per collective and scope, so every line in a chart is one series of
  one run, named by the run selector (Custom Scalars colours runs and gives a run's several tags in one chart
  only different markers, which nothing names). With several `dtypes`, a chart per dtype too. Titles are the
  same in every run, so TensorBoard merges runs' charts, and RUN/expected's lines join RUN's.

  `busbw % of peak` and `measured / expected` exist only where a record's link peak (`peaked`) or the fabric
  model's expectation (`expected`) is known: (collective, scope) pairs; their charts are drawn only for those,
  and their categories not at all when there are none (every CPU run without a fabric), so no chart is empty."""
  only = {**{t: set(peaked) for t in PEAK_ONLY}, **{t: set(expected) for t in EXPECTED_ONLY}}
  series = [(c, s, d) for c in collectives for s in scopes for d in (dtypes if len(dtypes) > 1 else [None])]
  cats = []
  for tag, name in METRICS:
    charts = [(f"{c} over {s}{f' {d}' if d else ''}: {name}", [f"^{tag}/{c}/{s}/" + (f"{d}$" if d else "")])
              for c, s, d in series if tag not in only or (c, s) in only[tag]]
    if charts:
      cats.append((f"{name}: {_CHARTS_NOTE}", charts))
  return cats


def peaked_series(records: Sequence[dict[str, Any]]) -> set[tuple[str, str]]:
  """(collective, scope) of the measured records whose busbw has a known link peak."""
  return {(r["collective"], r["scope"]) for r in records
          if r.get("status") == "ok" and r.get("busbw_pct_of_peak") is not None}


def expected_series(records: Sequence[dict[str, Any]]) -> set[tuple[str, str]]:
  """(collective, scope) of the measured records that carry the fabric model's expected busbw."""
  return {(r["collective"], r["scope"]) for r in records
          if r.get("status") == "ok" and r.get("expected_busbw_gbps") is not None}


def _text_cell(v: Any) -> str:
  """A value for Markdown text: lists as their items (an empty one: none), None as n/a, pipes escaped."""
  if v is None:
    return "n/a"
  if isinstance(v, bool):
    return "yes" if v else "no"
  if isinstance(v, (list, tuple)):
    v = ", ".join(str(x) for x in v) or "none"
  return str(v).replace("|", "\\|") or "(empty)"


def config_text(flags: dict[str, Any], defaults: dict[str, Any] | None = None) -> str:
  """A sweep's flags for the Text tab: a short table of those set away from their defaults (what tells runs
  apart), then every other flag as one wrapped paragraph. TensorBoard puts each text in a box about 500 px high
  and scrolls what is taller: the one-row-per-flag table it replaces hid the setting that differed below rows of
  defaults. Flags without a default given (the output folder) count as the rest."""
  defaults = defaults or {}
  changed = {k: v for k, v in sorted(flags.items()) if k in defaults and v != defaults[k]}
  if changed:
    head = "| set away from the default | value | default |\n|---|---|---|\n" + "\n".join(
        f"| `{k}` | **{_text_cell(v)}** | {_text_cell(defaults[k])} |" for k, v in changed.items())
  else:
    head = "**Every flag at its default.**"
  rest = [(k, v) for k, v in sorted(flags.items()) if k not in changed]
  return head + ("\n\n**The rest:** " + " · ".join(f"`{k}` = {_text_cell(v)}" for k, v in rest) if rest else "")


def summary_text(records: Sequence[dict[str, Any]]) -> str:
  """One row per series: sizes, average and best busbw (nccl-tests' "Avg bus bandwidth"), the fabric model's
  average expectation and the measured/expected range where known, and the points flagged. A table, not a
  scalar per series: one point per run draws a chart of dots, blank in the Scalars tab when two runs' dots fall
  outside the 5-95% range "Ignore outliers" keeps."""
  series: dict[tuple, list[dict[str, Any]]] = {}
  for r in latest(list(records)):
    if r.get("status") == "ok" and r.get("busbw_gbps") is not None:
      series.setdefault((r["collective"], r["scope"], r["dtype"], r.get("group_size")), []).append(r)
  if not series:
    return "No point measured."
  with_expected = any(r.get("expected_busbw_gbps") is not None for recs in series.values() for r in recs)
  head = ["collective", "scope", "dtype", "n", "sizes", "avg busbw (GB/s)", "best busbw (GB/s)"]
  head += ["avg expected (GB/s)", "measured / expected", "LOW"] if with_expected else []
  head += ["wrong points", "max spread"]
  rows = []
  for (c, s, d, n), recs in series.items():
    recs = sorted(recs, key=lambda r: r["bytes"])
    bw = [r["busbw_gbps"] for r in recs]
    row = [c, s, d, n, f"{_size_name(recs[0]['bytes'])} - {_size_name(recs[-1]['bytes'])} ({len(recs)})",
           f"{sum(bw) / len(bw):.4g}", f"{max(bw):.4g}"]
    if with_expected:
      exp = [r["expected_busbw_gbps"] for r in recs if r.get("expected_busbw_gbps") is not None]
      ratio = [r["vs_expected"] for r in recs if r.get("vs_expected") is not None]
      row += [f"{sum(exp) / len(exp):.4g}" if exp else "n/a",
              f"{min(ratio):.3g} - {max(ratio):.3g}" if ratio else "n/a",
              str(sum(1 for r in recs if r.get("low"))) if exp else "n/a"]
    spread = [r["time_us_max"] / r["time_us_min"] for r in recs if r.get("time_us_min") and r.get("time_us_max")]
    row += [str(sum(1 for r in recs if r.get("wrong"))), f"{max(spread):.3g}" if spread else "n/a"]
    rows.append(row)
  return ("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
          + "\n".join("| " + " | ".join(str(x) for x in row) + " |" for row in rows))


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


# Left out of the CSV, kept in results.jsonl: every process's samples, encoded (output.rank_times), are ~60 KB a
# point at 1024 processes and mean nothing in a spreadsheet cell; the CSV is rewritten at every point.
CSV_OMIT = ("rank_samples",)


def write_csv(path: str, records: list[dict[str, Any]]) -> list[str]:
  """All records as one table (the union of their fields), replaced atomically so a reader never sees
  half a file; a field a record lacks is an empty cell. Returns the columns (the header) written."""
  rows = [flatten({k: v for k, v in r.items() if k not in CSV_OMIT}) for r in records]
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


def scope_groups(meta: dict[str, Any], scope: str) -> list[list[int]]:
  """The device groups meta.json records for a scope ([] when it has none)."""
  return ((meta.get("scopes") or {}).get(scope) or {}).get("groups") or []


def group_nodes(meta: dict[str, Any], group: Sequence[int]) -> int:
  """How many nodes a group's devices span, by the run's topology (gpus per node); 0 when it has none."""
  per_node = int((meta.get("topology") or {}).get("gpus") or 0)
  return len({r // per_node for r in group}) if per_node else 0


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
    self._expected_tb: TensorBoardLog | None = None  # RUN/expected, opened by the first record with an expectation
    self._layout_of: tuple[list[str], list[str]] | None = None  # (collectives, scopes) once layout() ran
    self._layout_keys: tuple = ()  # what the layout written last was drawn for
    self._peaked: set[tuple[str, str]] = set()
    self._expected: set[tuple[str, str]] = set()
    self._dtypes: dict[str, None] = {}  # in order of first measurement
    if enabled:
      self._count(self._rows)  # a resumed run's earlier points count

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

  def config(self, flags: dict[str, Any], defaults: dict[str, Any] | None = None) -> None:
    """The run's flags as the Text tab's `config`: those set away from `defaults` first (config_text)."""
    self.text("config", config_text(flags, defaults))

  def layout(self, collectives: Sequence[str], scopes: Sequence[str]) -> None:
    """The Custom Scalars layout of this sweep and the x axis explained (the run's `x_axis` text). The layout
    is written again (at the step of the record that brings it) when a point first makes a `busbw % of peak`
    or `measured / expected` chart non-empty or brings a second dtype; TensorBoard reads a tag's last value,
    so it shows the newest layout."""
    if self._tb:
      self._layout_of = (list(collectives), list(scopes))
      self._write_layout(0)
      self._tb.text("x_axis", SIZE_STEP_TEXT)

  def _keys(self) -> tuple:
    """What the layout depends on, kept up to date per record (not recomputed over every row: quadratic)."""
    return (sorted(self._peaked), sorted(self._expected), list(self._dtypes))

  def _count(self, recs: Sequence[dict[str, Any]]) -> None:
    self._peaked |= peaked_series(recs)
    self._expected |= expected_series(recs)
    self._dtypes.update(dict.fromkeys(r["dtype"] for r in recs if r.get("status") == "ok"))

  def _write_layout(self, step: int) -> None:
    self._layout_keys = self._keys()
    self._tb.custom_scalars(sweep_layout(*self._layout_of, *self._layout_keys), step=step)

  def record(self, rec: dict[str, Any]) -> None:
    if not self.enabled:
      return
    self._results.write(json.dumps(rec, sort_keys=True) + "\n")
    self._results.flush()
    os.fsync(self._results.fileno())
    self._rows.append(rec)
    self._count([rec])
    self._write_csv_row(rec)
    if rec["status"] == "ok" and self._tb:
      base, step = f"{rec['collective']}/{rec['scope']}/{rec['dtype']}", size_step(rec["bytes"])
      values = {tag: rec[tag] for tag, _ in METRICS if rec.get(tag) is not None}  # % of peak: None if unknown
      if rec.get("time_us_min") and rec.get("time_us_max") is not None:
        values["time_us_spread"] = rec["time_us_max"] / rec["time_us_min"]
      if rec.get("wrong") is not None:
        values["wrong"] = rec["wrong"]
      for tag, v in values.items():
        self._scalar(tag, base, v, step)
      self._write_expected(rec, base, step)
      if self._layout_of is not None and self._keys() != self._layout_keys:
        # After the record's points, so the layout's step is not behind them (TensorBoard would read a restart).
        self._write_layout(step)

  def _write_expected(self, rec: dict[str, Any], base: str, step: int) -> None:
    """The fabric model's busbw and time for the point into RUN/expected, under the measured tags."""
    expected = rec.get("expected_busbw_gbps")
    if expected is None or not expected > 0:
      return
    if self._expected_tb is None:
      self._expected_tb = TensorBoardLog(os.path.join(self.outdir, EXPECTED_RUN))
    values = {"busbw_gbps": expected}
    if rec.get("time_us") and rec.get("busbw_gbps"):
      values["time_us"] = rec["time_us"] * rec["busbw_gbps"] / expected  # busbw is bytes x factor / time
    for tag, v in values.items():
      self._expected_tb.scalar(f"{tag}/{base}", v, step, description=EXPECTED_DESCRIPTIONS[tag] + " " + STEP_NOTE)

  def _scalar(self, tag: str, base: str, value: float, step: int) -> None:
    desc = DESCRIPTIONS.get(tag, dict(METRICS).get(tag, tag)) + " " + STEP_NOTE
    self._tb.scalar(f"{tag}/{base}", value, step, description=desc)

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
      self._tb.text("summary", summary_text(self._rows))  # this session's and any resumed points
      self._tb.close()
      self._tb = None
    if self._expected_tb:
      self._expected_tb.close()
      self._expected_tb = None
