"""One report from one or more run folders: Markdown, PNG figures and comparison CSVs in one folder.

A single sweep gets its average-busbw table (with the share of the link peak), its problem points, its
alpha-beta fits and one figure per collective (a line per scope and dtype). Several sweeps get the same per
run, then one figure per collective with a panel per scope and a line per run, and a ratio table and plot of
every run against the first (run A). Training runs get a table side by side, loss and step-time curves,
and throughput/MFU bars.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import os
import re
import struct
from typing import Any

from microbench.cluster import environment
from microbench.output import run_folder
from microbench.output.tensorboard import TensorBoardLog
from microbench.report import alpha_beta, plots, runs, tables

REPORT = "report.md"


@dataclasses.dataclass
class Report:
  out: str
  markdown: str
  figures: dict[str, Any]  # file name -> matplotlib Figure
  fits: dict[str, list[alpha_beta.Fit]]  # run label -> fits
  sweeps: list[runs.SweepRun]
  trains: list[runs.TrainRun]
  predictions: list[tuple[Any, ...]]  # prediction_rows for --predict's sizes ([] without)


def _slug(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def _line_label(r: dict[str, Any], with_scope: bool = True, prefix: str = "") -> str:
  parts = [prefix] if prefix else []
  if with_scope:
    parts.append(r["scope"])
  parts.append(r["dtype"])
  return "/".join(parts) + f" (n={r['group_size']})"


def _peak(recs: list[dict[str, Any]]) -> float | None:
  return max((r["peak_gbps"] for r in recs if r.get("peak_gbps")), default=None)


def no_peak_note(meta: dict[str, Any]) -> str:
  """Why a run's lines have no link peak, for their legend: CPU devices have none; another device kind needs
  --link_peaks (or --fabric) when the toolkit does not know it."""
  kind = str(meta.get("device_kind") or "")
  if meta.get("platform") == "cpu" or kind.lower() == "cpu":
    return "peak unknown (CPU)"
  return f"peak unknown ({kind}: give --link_peaks)" if kind else "peak unknown"


def _models(records: list[dict[str, Any]]) -> dict[tables.SeriesKey, plots.Model]:
  """Each series' alpha-beta fit (alpha, beta, why poor), keyed by the whole series (collective first)."""
  return {(f.collective, f.scope, f.dtype, f.group_size): (f.alpha_us, f.beta_gbps, f.poor())
          for f in alpha_beta.fit_run(records) if f.alpha_us is not None}


def single_sweep_figures(run: runs.SweepRun) -> dict[str, Any]:
  """One figure per collective: one line per scope and dtype, each with its own series' fit."""
  figs = {}
  series = tables.by_series(tables.ok(run.records))
  fits = _models(run.records)
  note = no_peak_note(run.meta)
  for coll in dict.fromkeys(k[0] for k in series):
    lines, models = [], {}
    for k, recs in series.items():
      if k[0] == coll:
        label = _line_label(recs[0])
        lines.append((label, recs, _peak(recs) or note))
        if k in fits:
          models[(run.label, label)] = fits[k]
    figs[f"{_slug(coll)}.png"] = plots.collective_figure(coll, [(run.label, lines)], models)
  return figs


def compare_sweep_figures(sweeps: list[runs.SweepRun]) -> dict[str, Any]:
  """One figure per collective, a panel per scope, a line per run (and dtype when there are several), each with
  its own fit; a run (and dtype) keeps one colour in every panel."""
  figs = {}
  per_run = [(run, tables.by_series(tables.ok(run.records)), _models(run.records), no_peak_note(run.meta))
             for run in sweeps]
  colls = list(dict.fromkeys(k[0] for _, s, _, _ in per_run for k in s))
  for coll in colls:
    scopes = list(dict.fromkeys(k[1] for _, s, _, _ in per_run for k in s if k[0] == coll))
    panels, models, colour_of = [], {}, {}
    for scope in scopes:
      dtypes = {k[2] for _, s, _, _ in per_run for k in s if k[:2] == (coll, scope)}
      lines = []
      for run, series, fits, note in per_run:
        for k, recs in series.items():
          if k[:2] == (coll, scope):
            name = run.label + (f"/{k[2]}" if len(dtypes) > 1 else "")
            label = f"{name} (n={k[3]})"
            lines.append((label, recs, _peak(recs) or note))
            colour_of[label] = name
            if k in fits:
              models[(scope, label)] = fits[k]
      panels.append((scope, lines))
    colours = plots.colour_map(list(colour_of.values()))
    figs[f"compare_{_slug(coll)}.png"] = plots.collective_figure(
        coll, panels, models, {label: colours.get(name) for label, name in colour_of.items()})
  return figs


def _env_lines(meta: dict[str, Any]) -> list[str]:
  env = meta.get("environment")
  lines = [f"- {meta.get('device_count')} x {meta.get('device_kind')} ({meta.get('platform')}),"
           f" {meta.get('process_count')} process(es), topology {meta.get('topology')}, status {meta.get('status')}"]
  if env:
    lines += [f"- {line[2:]}" for line in environment.header(env)]
  else:
    lines.append(f"- jax {meta.get('jax_version')}, jaxlib {meta.get('jaxlib_version')} (no environment recorded)")
  peaks = meta.get("link_peaks")
  if peaks:
    lines.append("- link peaks: " + "; ".join(
        f"{level} {p['gbps']:g} GB/s ({p['link']}, {p['source']})" if p else f"{level} unknown"
        for level, p in peaks.items()))
  return lines


def _diff_lines(a: runs.SweepRun, b: runs.SweepRun) -> list[str]:
  diff = runs.settings_diff(a.meta, b.meta)
  if not diff:
    return ["No differences in flags, versions, environment variables, devices or topology."]
  return [tables.markdown(("setting", "A", "B"), [(f"`{k}`", *(tables.fmt(v)[:120].replace("|", "\\|") for v in ab))
                                                  for k, *ab in diff])]


FIT_HEADERS = ("collective", "scope", "dtype", "n", "alpha (us)", "beta (GB/s)", "busbw beta (GB/s)",
               "alpha/ring step (us)", "R^2", "rel. RMS error", "sizes", "points", "method", "quality")


def fit_rows(fits: list[alpha_beta.Fit]) -> list[tuple[Any, ...]]:
  return [(f.collective, f.scope, f.dtype, f.group_size, f.alpha_us, f.beta_gbps, f.busbw_beta_gbps,
           f.alpha_per_step_us, f.r2, f.rel_rms,
           f"{tables.size_text(f.min_bytes)}-{tables.size_text(f.max_bytes)}", f.points, f.method,
           f"POOR: {f.poor()}" if f.poor() else "good") for f in fits]


PREDICT_HEADERS = ("run", "collective", "scope", "dtype", "n", "size", "predicted time (us)",
                   "predicted busbw (GB/s)", "extrapolation", "fit quality")


def prediction_rows(fits: dict[str, list[alpha_beta.Fit]], sizes: list[int]) -> list[tuple[Any, ...]]:
  """Each fit's time and busbw at each size, saying how far past the measured sizes it reaches."""
  bad = [s for s in sizes if s <= 0]
  if bad:
    raise ValueError(f"--predict: sizes must be positive bytes, got {bad[0]}")
  rows = []
  for label, fs in fits.items():
    for f in fs:
      for size in sizes:
        t = f.predict_us(size)
        busbw = None if (t is None or not t or f.busbw_factor is None) else size / (t * 1e3) * f.busbw_factor
        rows.append((label, f.collective, f.scope, f.dtype, f.group_size, tables.size_text(size), t, busbw,
                     f.extrapolation(size), f"POOR: {f.poor()}" if f.poor() else "good"))
  return rows


def _enclosing_run(folder: str) -> str:
  """The nearest folder at or above `folder` that already holds event files (a run), else `folder`: TensorBoard
  makes every folder with event files a run, so a report written under a run folder (the default `RUN/report`)
  would appear as a phantom run; its images go into the run's own events instead, under their own prefix."""
  path = os.path.abspath(folder)
  while True:
    try:
      if any(n.startswith("events.out.tfevents") for n in os.listdir(path)):
        return path
    except OSError:  # not there yet, or not readable
      pass
    parent = os.path.dirname(path)
    if parent == path:
      return folder
    path = parent


# TensorBoard shows an image at its pixel size: at this DPI the figures' smallest text (7 pt legends) is 10 px
# and their titles 14 px, legible without zooming (the PNG files beside report.md keep plots.DPI).
IMAGE_DPI = 104


def write_images(logdir: str, figures: dict[str, Any], prefix: str) -> None:
  """The figures into TensorBoard's Images tab (tag `<prefix>/<name>`), for readers who only open TensorBoard;
  into the enclosing run's events when `logdir` lies inside a run folder (no extra run)."""
  log = TensorBoardLog(_enclosing_run(logdir))
  try:
    for name, fig in figures.items():
      buf = io.BytesIO()
      fig.savefig(buf, format="png", dpi=IMAGE_DPI)
      png = buf.getvalue()
      width, height = struct.unpack(">II", png[16:24])  # the PNG header's IHDR chunk
      log.image(f"{prefix}/{name.removesuffix('.png')}", png, width, height)
  finally:
    log.close()


def sweep_images(outdir: str, records: list[dict[str, Any]]) -> int:
  """A finished sweep's per-collective figures into its own events; returns how many."""
  try:
    meta = run_folder.read_meta(outdir) or {}
  except ValueError:  # a torn meta.json costs the figures only their "peak unknown (CPU)" note
    meta = {}
  figs = single_sweep_figures(runs.SweepRun(outdir, os.path.basename(os.path.normpath(outdir)), meta, records))
  if figs:
    write_images(outdir, figs, "figures")
  return len(figs)


def _write_csv(path: str, headers: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.writer(f)
    w.writerow(headers)
    w.writerows(rows)


@dataclasses.dataclass
class Side:
  """One side of a comparison: one sweep, or several runs of the same sweep (their spread is the noise)."""
  label: str
  runs: list[runs.SweepRun]


def _sides(sweeps: list[runs.SweepRun], sides: list[list[str]] | None) -> list[Side]:
  """Each sweep its own side, or the sweeps grouped as `sides` (run folder paths) says."""
  if not sides:
    return [Side(run.label, [run]) for run in sweeps]
  by_path = {os.path.normpath(run.path): run for run in sweeps}
  out = []
  for paths in sides:
    group = [by_path[os.path.normpath(p)] for p in paths if os.path.normpath(p) in by_path]
    if group:
      out.append(Side("+".join(run.label for run in group), group))
  return out


def _within_side_lines(side: Side) -> list[str]:
  """Settings that differ between the runs of one side: repeats of one sweep should not differ."""
  keys = list(dict.fromkeys(k for run in side.runs[1:] for k, _, _ in runs.settings_diff(side.runs[0].meta, run.meta)))
  if not keys:
    return []
  return ["", f"Warning: the runs of `{side.label}` are not repeats of one sweep; they differ in "
          + ", ".join(f"`{k}`" for k in keys) + "."]


def _intro_lines(sweeps: list[runs.SweepRun], trains: list[runs.TrainRun], groups: list[Side]) -> list[str]:
  """The report's head: when and from what it was made, and what differs between the sides and within one."""
  now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  md = ["# microbench report", "", f"Generated {now} from {len(sweeps) + len(trains)} run(s):", ""]
  md += [f"- `{r.label}`: `{os.path.abspath(r.path)}`" for r in [*sweeps, *trains]]
  for other in groups[1:]:
    md += ["", f"## Settings that differ: `{other.label}` (B) against `{groups[0].label}` (A)", "",
           *_diff_lines(groups[0].runs[0], other.runs[0])]
  for side in groups:
    md += _within_side_lines(side)
  return md


def _sweep_lines(run: runs.SweepRun, fits: list[alpha_beta.Fit]) -> list[str]:
  """One sweep's section: its summary table, its problem points and its alpha-beta fits."""
  md = ["", f"## Sweep `{run.label}`", "", *_env_lines(run.meta), "",
        "### Average bus bandwidth (mean over sizes), best busbw and its share of the link peak", "",
        tables.markdown(tables.SUMMARY_HEADERS, tables.summary_rows(run.records))]
  problems = tables.problem_rows(run.records)
  for title, rows in problems.items():
    if rows:
      md += ["", f"### Points {title} ({len(rows)})", "",
             tables.markdown(("collective", "scope", "dtype", "size", "what", "detail"), rows)]
  if not any(problems.values()):
    md += ["", "No skipped, failed, wrong or straggling points."]
  md += ["", f"### Alpha-beta model per series: {alpha_beta.FORM}", "",
         tables.markdown(FIT_HEADERS, fit_rows(fits))]
  return md


def _ratio_lines(out: str, base: Side, other: Side, figures: dict[str, Any]) -> list[str]:
  """One side (B) against the base (A): the ratio CSV written into `out`, its summary and per-point tables,
  the points only one side has, and the ratio figure added to `figures`."""
  r = tables.ratio_rows([run.records for run in base.runs], [run.records for run in other.runs])
  name = f"ratio_{_slug(other.label)}_vs_{_slug(base.label)}"
  _write_csv(os.path.join(out, name + ".csv"), tables.RATIO_HEADERS, r["both"])
  summary = tables.ratio_summary(r["both"], r["series_interval"])
  md = ["", f"## `{other.label}` (B) against `{base.label}` (A)", "", "What differs in their settings:", "",
        *_diff_lines(base.runs[0], other.runs[0]), "",
        f"{len(r['both'])} point(s) in both runs; per-point table in `{name}.csv`. "
        + tables.changed_text(summary, r["runs"]), "",
        tables.markdown(tables.RATIO_SUMMARY_HEADERS, summary), "",
        "Per point:", "", tables.markdown(tables.RATIO_HEADERS, r["both"])]
  for which, rows in (("A", r["only_a"]), ("B", r["only_b"])):
    if rows:
      md += ["", f"Points measured (status ok) only in run {which} or not ok in the other ({len(rows)}):", "",
             tables.markdown(("collective", "scope", "dtype", "n", "bytes", "status A", "status B"), rows)]
  if r["both"]:
    figures[name + ".png"] = plots.ratio_figure(base.label, other.label, r["both"], r["runs"])
    md += ["", f"![{name}]({name}.png)"]
  return md


def _train_lines(trains: list[runs.TrainRun], figures: dict[str, Any]) -> list[str]:
  """The training runs' table side by side; their curves and throughput bars added to `figures`."""
  rows = [tables.train_row(t.label, t.config, t.summary) for t in trains]
  md = ["", "## Training runs", "", tables.markdown(tables.TRAIN_HEADERS, rows)]
  unfinished = [t.label for t in trains if t.summary is None]
  if unfinished:
    md += ["", "Not finished (no summary): " + ", ".join(f"`{u}`" for u in unfinished)]
  figures["train_curves.png"] = plots.train_curves_figure([(t.label, t.steps) for t in trains])
  figures["train_throughput.png"] = plots.train_bars_figure(
      [(row[0], (t.summary or {}).get("item", "items"), row[8], row[10]) for row, t in zip(rows, trains)])
  md += ["", "![train_curves](train_curves.png)", "", "![train_throughput](train_throughput.png)"]
  return md


def _write_report(out: str, md: list[str], figures: dict[str, Any]) -> str:
  """The figures (as PNGs and into the folder's events) and report.md into `out`; returns the Markdown."""
  for name, fig in figures.items():
    plots.save(fig, os.path.join(out, name))
  if figures:
    write_images(out, figures, "report")
  text = "\n".join(md) + "\n"
  with open(os.path.join(out, REPORT), "w", encoding="utf-8") as f:
    f.write(text)
  return text


def build(paths: list[str], out: str, predict: list[int] | None = None,
          sides: list[list[str]] | None = None) -> Report:
  """Reads the runs, writes report.md, the figures and comparison CSVs into `out`, returns it all. `sides`
  (run folder paths per side, as `microbench-report A1 A2 vs B1 B2` gives them) groups repeated sweeps: each
  side's runs are compared as one, with an interval that includes the spread between them; without it every
  sweep is compared on its own against the first."""
  sweeps, trains = runs.load(paths)
  groups = _sides(sweeps, sides)
  os.makedirs(out, exist_ok=True)
  md = _intro_lines(sweeps, trains, groups)
  figures: dict[str, Any] = {}
  fits: dict[str, list[alpha_beta.Fit]] = {}

  for run in sweeps:
    fits[run.label] = alpha_beta.fit_run(run.records)
    md += _sweep_lines(run, fits[run.label])
    if len(sweeps) == 1:
      figs = single_sweep_figures(run)
      figures.update(figs)
      md += [""] + [f"![{name}]({name})" for name in figs]

  if len(sweeps) > 1:
    figs = compare_sweep_figures(sweeps)
    figures.update(figs)
    md += ["", "## Runs side by side", ""] + [f"![{name}]({name})" for name in figs]
    for other in groups[1:]:
      md += _ratio_lines(out, groups[0], other, figures)

  if trains:
    md += _train_lines(trains, figures)

  predictions = prediction_rows(fits, predict) if predict and fits else []
  if predictions:
    md += ["", "## Predicted times from the alpha-beta fits", "", tables.markdown(PREDICT_HEADERS, predictions)]

  text = _write_report(out, md, figures)
  return Report(out, text, figures, fits, sweeps, trains, predictions)
