"""The report's figures, drawn with matplotlib's object API on the non-interactive Agg canvas (no display,
no pyplot state): functions take rows and return Figures; saving is separate. matplotlib is the `report`
extra, imported only here."""

from __future__ import annotations

import io
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # a headless node has no display; figures are only ever written to files
from matplotlib import ticker  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from matplotlib.figure import Figure  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from microbench.report.tables import size_text  # noqa: E402  pylint: disable=wrong-import-position

Line = tuple[str, Sequence[dict[str, Any]], float | str | None]  # legend label, records by bytes, busbw peak
# (GB/s), or the words saying why no peak is known ("peak unknown (CPU)"; None: "peak unknown")
Panel = tuple[str, Sequence[Line]]  # title, lines
Model = tuple[float, float | None, str | None]  # alpha_us, beta_gbps (None: latency only), why the fit is poor
PEAK_SPAN = 3.0  # a peak more than this times the best busbw turns the busbw axis logarithmic, so both show
DPI = 80
NO_PEAK = "peak unknown"
FIT_NOTE = "dashed: alpha-beta fit"
EXPECTED_NOTE = "dotted: expected"  # the fabric model's busbw, on the busbw panel where a record carries it
NOTE_CHARS = 70  # a poor-fit note's line: 7 pt text across a 5.2 in panel


def _size_axis(ax) -> None:
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_locator(ticker.LogLocator(base=2, numticks=8))
  ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: size_text(x)))
  ax.xaxis.set_minor_locator(ticker.NullLocator())
  ax.grid(True, which="major", alpha=0.3)


def colour_map(keys: Sequence[str]) -> dict[str, str]:
  """One colour per key for a whole figure, in the order given: matplotlib's cycle restarts in every axes,
  so a series missing from one panel would shift the colours of the rest there."""
  cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
  return {k: cycle[i % len(cycle)] for i, k in enumerate(dict.fromkeys(keys))}


def _draw_series(bw, tm, label: str, recs: Sequence[dict[str, Any]], peak: float | str | None,
                 model: Model | None, colour: str | None, top: float) -> tuple[bool, bool, bool, str | None]:
  """One series on a panel: busbw with its peak and expected busbw, time with its fit. Returns whether its
  peak or expected busbw is far above the panel's best busbw, whether it drew an expected busbw and a fit,
  and the note naming a poor fit."""
  xs = [r["bytes"] for r in recs]
  known = peak if isinstance(peak, (int, float)) and peak > 0 else None
  shown = label + (f", peak {known:.4g} GB/s" if known else f", {peak or NO_PEAK}")
  (line,) = bw.plot(xs, [r["busbw_gbps"] for r in recs], marker="o", markersize=3, label=shown, color=colour)
  tm.plot(xs, [r["time_us"] for r in recs], marker="o", markersize=3, label=shown, color=line.get_color())
  far = expected = fitted = False
  poor = None
  if known:
    bw.axhline(known, linestyle="--", linewidth=1, color=line.get_color(), label="_peak")
    far = known > PEAK_SPAN * top
  ex = [(r["bytes"], r["expected_busbw_gbps"]) for r in recs if (r.get("expected_busbw_gbps") or 0) > 0]
  if ex:  # the fabric model's busbw for the same points (fabric/expected.py), where it applies
    bw.plot([x for x, _ in ex], [y for _, y in ex], linestyle=":", linewidth=1.5, color=line.get_color(),
            label="_expected")
    expected = True
    far = far or max(y for _, y in ex) > PEAK_SPAN * top
  if model and xs:
    alpha, beta, why = model
    fx = sorted(xs)
    tm.plot(fx, [alpha + (0.0 if beta is None else x / (beta * 1e3)) for x in fx], linestyle="--",
            linewidth=1, color=line.get_color(), label="_fit")
    fitted = True
    if why:
      poor = f"poor fit {label}: {why}"
  return far, expected, fitted, poor


def _label_panel(bw, tm, title: str, far: bool, expected: bool, fitted: bool, poor: list[str],
                 legend: bool) -> None:
  """A panel's scales, labels, poor-fit notes and legend, once its series are drawn."""
  if far:
    bw.set_yscale("log")
    bw.set_ylabel("busbw (GB/s, log: peak far above)" + (f"; {EXPECTED_NOTE}" if expected else ""))
  else:
    bw.set_ylim(bottom=0)
    bw.set_ylabel("busbw (GB/s)" + (f"; {EXPECTED_NOTE}" if expected else ""))
  if poor:  # wrapped to the panel: constrained layout squeezed the axes to nothing beside one long line
    note = "\n".join(textwrap.fill(p, NOTE_CHARS, subsequent_indent="  ") for p in poor)
    tm.text(0.02, 0.98, note, transform=tm.transAxes, fontsize=7, va="top", color="red", in_layout=False)
  bw.set_title(title, fontsize=10)
  tm.set_ylabel("time (us)")
  tm.set_yscale("log")
  tm.set_xlabel("message size S (bytes)" + (f"; {FIT_NOTE}" if fitted else ""))
  for ax in (bw, tm):
    _size_axis(ax)
  if legend:
    bw.legend(fontsize=7, loc="best")


def collective_figure(collective: str, panels: Sequence[Panel], models: Mapping[tuple[str, str], Model] | None = None,
                      colours: Mapping[str, str] | None = None) -> Figure:
  """busbw (top) and time (bottom) against message size, one column per panel, one line per series.

  The link peak is always drawn where it is known, and a line without one says so in its legend: when the peak
  is far above the measured busbw (a sweep at 0.6% of an NVLink peak) the busbw axis turns logarithmic instead
  of dropping the line, since a linear axis scaled to the data would make a tiny fraction of the peak look like
  saturation. `models` ((panel title, line label) -> alpha-beta fit) adds the fitted time as a dashed line on
  the time panel, a poor fit named there; the x label mentions the dashed fit only where one is drawn.
  `colours` (line label -> colour) keeps a series' colour the same in every panel. Records carrying the fabric
  model's `expected_busbw_gbps` get it dotted beside their busbw, said in the busbw label only where drawn (and,
  like the peak, far above the measured busbw it turns the axis logarithmic)."""
  cols = len(panels)
  fig = Figure(figsize=(5.2 * cols, 6.4), dpi=DPI, layout="constrained")
  axes = fig.subplots(2, cols, squeeze=False, sharex="col")
  fig.suptitle(f"{collective}: bus bandwidth and time against message size")
  for j, (title, lines) in enumerate(panels):
    bw, tm = axes[0][j], axes[1][j]
    top = max((r["busbw_gbps"] for _, recs, _ in lines for r in recs), default=0.0)
    far = expected = fitted = False
    poor = []
    for label, recs, peak in lines:
      f, e, fit, why = _draw_series(bw, tm, label, recs, peak, (models or {}).get((title, label)),
                                    (colours or {}).get(label), top)
      far, expected, fitted = far or f, expected or e, fitted or fit
      if why:
        poor.append(why)
    _label_panel(bw, tm, title, far, expected, fitted, poor, bool(lines))
  return fig


class _PlainLogFormatter(ticker.LogFormatter):
  """matplotlib's log-axis labelling (which ticks get a label), each label a plain number."""

  def _num_to_string(self, x, vmin, vmax):  # pylint: disable=unused-argument
    return f"{x:g}"


def ratio_figure(base: str, other: str, rows: Sequence[tuple[Any, ...]], runs: tuple[int, int] = (1, 1)) -> Figure:
  """Run(s) B over run(s) A time per point (tables.RATIO_HEADERS rows), one panel per collective, with each
  point's interval as an error bar and changed points (interval excludes 1) ringed, a series (scope, dtype,
  group size) one colour in every panel; the title says what noise the intervals hold (`runs`: runs on side A
  and B)."""
  by_coll: dict[str, dict[str, list[tuple[Any, ...]]]] = {}
  for r in rows:
    coll, scope, dtype, n = r[:4]
    by_coll.setdefault(coll, {}).setdefault(f"{scope}/{dtype} (n={n})", []).append(r)
  colours = colour_map([label for series in by_coll.values() for label in series])  # one scope, one colour
  cols = min(3, max(1, len(by_coll)))
  nrows = max(1, -(-len(by_coll) // cols))
  fig = Figure(figsize=(5.0 * cols, 3.6 * nrows), dpi=DPI, layout="constrained")
  axes = fig.subplots(nrows, cols, squeeze=False)
  noise = (f"spread between runs ({runs[0]} vs {runs[1]})" if max(runs) > 1
           else "samples within each run only: drift between runs not included")
  fig.suptitle(f"time B / A per point (below 1: B is faster; ringed red: changed)\nA = {base}, B = {other}\n"
               f"bars: intervals holding together at 95%, from the {noise}", fontsize=10)
  for ax, (coll, series) in zip(axes.flat, by_coll.items()):
    for label, pts in series.items():
      pts.sort(key=lambda p: p[4])
      xs = [p[4] for p in pts]
      ys = [p[7] for p in pts]
      (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=label, color=colours.get(label))
      with_ci = [p for p in pts if p[11] is not None]
      if with_ci:
        ax.errorbar([p[4] for p in with_ci], [p[7] for p in with_ci],
                    yerr=[[max(0.0, p[7] - p[11]) for p in with_ci], [max(0.0, p[12] - p[7]) for p in with_ci]],
                    fmt="none", ecolor=line.get_color(), capsize=2, linewidth=0.8, label="_interval")
      changed = [p for p in pts if p[13] in ("slower", "faster")]
      if changed:
        ax.plot([p[4] for p in changed], [p[7] for p in changed], linestyle="none", marker="o", markersize=9,
                markerfacecolor="none", markeredgecolor="red", label="_changed")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")  # 2x slower and 2x faster are the same distance from 1
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    # Minor ticks labelled only over a narrow range (matplotlib's thresholds), as 0.6 rather than 6 x 10^-1.
    ax.yaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
    ax.set_title(coll, fontsize=10)
    ax.set_ylabel("time B/A")
    ax.set_xlabel("message size S (bytes)")
    _size_axis(ax)
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(by_coll):]:
    ax.set_visible(False)
  return fig


def train_curves_figure(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> Figure:
  """Loss and step time per step, one line per training run (warm-up steps drawn lighter)."""
  fig = Figure(figsize=(11, 4.2), dpi=DPI, layout="constrained")
  loss_ax, time_ax = fig.subplots(1, 2)
  for label, steps in runs:
    xs = [s["step"] for s in steps]
    (line,) = loss_ax.plot(xs, [s["loss"] for s in steps], label=label)
    timed = [s for s in steps if not s.get("warmup") and not s.get("profiled")]
    time_ax.plot([s["step"] for s in timed], [1e3 * s["step_time_s"] for s in timed], marker="o", markersize=3,
                 label=label, color=line.get_color())
  loss_ax.set_title("loss", fontsize=10)
  loss_ax.set_xlabel("step")
  loss_ax.set_ylabel("loss")
  time_ax.set_title("step time after warm-up", fontsize=10)
  time_ax.set_xlabel("step")
  time_ax.set_ylabel("step time (ms)")
  for ax in (loss_ax, time_ax):
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
  return fig


def train_bars_figure(rows: Sequence[tuple[str, str, float | None, float | None]]) -> Figure:
  """Throughput per device and MFU per training run: (label, item name, items/s/device, MFU %)."""
  fig = Figure(figsize=(11, 1.2 + 0.45 * max(1, len(rows))), dpi=DPI, layout="constrained")
  thr_ax, mfu_ax = fig.subplots(1, 2, sharey=True)
  labels = [r[0] for r in rows]
  ys = list(range(len(rows)))
  thr_ax.barh(ys, [r[2] or 0.0 for r in rows], color="tab:blue")
  mfu_ax.barh(ys, [r[3] or 0.0 for r in rows], color="tab:orange")
  thr_ax.set_yticks(ys, labels, fontsize=8)
  thr_ax.invert_yaxis()
  items = sorted({r[1] for r in rows}) or ["items"]
  thr_ax.set_xlabel(f"{'/'.join(items)} per second per device")
  mfu_ax.set_xlabel("MFU (%)")
  thr_ax.set_title("throughput per device", fontsize=10)
  mfu_ax.set_title("model FLOPs utilisation", fontsize=10)
  for ax in (thr_ax, mfu_ax):
    ax.grid(True, axis="x", alpha=0.3)
  return fig


def png_bytes(fig: Figure) -> bytes:
  buf = io.BytesIO()
  fig.savefig(buf, format="png")
  return buf.getvalue()


def save(fig: Figure, path: str) -> str:
  fig.savefig(path)
  return path
