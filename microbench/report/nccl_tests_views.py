"""JAX beside nccl-tests, drawn: a figure of busbw per size (the sweep's line and nccl-tests' for the same
collective, dtype and group size) over the ratio JAX / nccl-tests with its interval, and the same as
TensorBoard series.

The TensorBoard copy is a run of its own (`OUT/nccl-tests`) holding nccl-tests' busbw under the sweep's own tags
(`busbw_gbps/<collective>/<scope>/<dtype>`, at the sweep's step = round(10 log2(bytes))), so TensorBoard draws
nccl-tests as one more line in the sweep's busbw cards and custom-scalar charts, beside the JAX run it was
matched to; the ratio and its interval get cards of their own. The points come from nccl_tests.matches.
"""

from __future__ import annotations

import glob
import io
import os
import struct
from collections.abc import Sequence
from typing import Any

from microbench.output import run_folder
from microbench.output.tensorboard import TensorBoardLog
from microbench.report import build, plots, tables

RUN = "nccl-tests"  # the TensorBoard run's folder under the report's output folder
FIGURE = "nccl_tests.png"
RATIO_TAGS = ("nccl_tests_ratio", "nccl_tests_ratio_lo", "nccl_tests_ratio_hi")
_RATIO_NOTE = ("JAX busbw / nccl-tests busbw at the same collective, dtype, size and group size (above 1: JAX"
               " faster); _lo and _hi bound the interval, holding at 95% together over the compared points. ")


def _series(points: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
  """collective -> 'scope/dtype (n=N)' -> its points by size."""
  out: dict[str, dict[str, list[dict[str, Any]]]] = {}
  for p in points:
    out.setdefault(p["collective"], {}).setdefault(f"{p['scope']}/{p['dtype']} (n={p['n']})", []).append(p)
  for by_label in out.values():
    for pts in by_label.values():
      pts.sort(key=lambda p: p["bytes"])
  return out


def _draw_nccl_tests(bw, series: dict[str, list[dict[str, Any]]]) -> None:
  """nccl-tests' busbw in grey, once per dtype and group size (several scopes of a sweep can match the same
  rows): out-of-place dashed, in-place dotted."""
  theirs: dict[str, dict[int, dict[str, Any]]] = {}
  for pts in series.values():
    for p in pts:
      theirs.setdefault(f"{p['dtype']} (n={p['n']})", {}).setdefault(p["bytes"], p)
  for label, by_size in theirs.items():
    pts = [by_size[b] for b in sorted(by_size)]
    xs = [p["bytes"] for p in pts]
    bw.plot(xs, [p["nccl_busbw_gbps"] for p in pts], linestyle="--", marker="s", markersize=3, color="grey",
            label=f"nccl-tests {label}")
    inplace = [p for p in pts if p.get("nccl_inplace_busbw_gbps")]
    if inplace:
      bw.plot([p["bytes"] for p in inplace], [p["nccl_inplace_busbw_gbps"] for p in inplace], linestyle=":",
              color="grey", label="_in-place")


def _draw_jax(bw, ratio, series: dict[str, list[dict[str, Any]]]) -> None:
  """JAX's busbw per series, and its ratio to nccl-tests below in the same colour: intervals as bars, points
  beyond the noise ringed red."""
  for label, pts in series.items():
    xs = [p["bytes"] for p in pts]
    (line,) = bw.plot(xs, [p["jax_busbw_gbps"] for p in pts], marker="o", markersize=3, label=f"JAX {label}")
    color = line.get_color()
    ratio.plot(xs, [p["ratio"] for p in pts], marker="o", markersize=3, color=color, label=label)
    with_ci = [p for p in pts if p["lo"] is not None]
    if with_ci:
      ratio.errorbar([p["bytes"] for p in with_ci], [p["ratio"] for p in with_ci],
                     yerr=[[max(0.0, p["ratio"] - p["lo"]) for p in with_ci],
                           [max(0.0, p["hi"] - p["ratio"]) for p in with_ci]],
                     fmt="none", ecolor=color, capsize=2, linewidth=0.8, label="_interval")
    changed = [p for p in pts if p["verdict"] in ("JAX slower", "JAX faster")]
    if changed:
      ratio.plot([p["bytes"] for p in changed], [p["ratio"] for p in changed], linestyle="none", marker="o",
                 markersize=9, markerfacecolor="none", markeredgecolor="red", label="_changed")


def _label_column(bw, ratio, coll: str) -> None:
  """A collective's column: titles, labels, legends, the ratio's log axis around 1 and the size axes."""
  bw.set_title(coll, fontsize=10)
  bw.set_ylabel("busbw (GB/s)")
  bw.set_ylim(bottom=0)
  bw.legend(fontsize=7)
  ratio.axhline(1.0, color="black", linewidth=0.8)
  ratio.set_yscale("log")  # 2x slower and 2x faster the same distance from 1
  ratio.yaxis.set_major_formatter(plots.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
  ratio.yaxis.set_minor_formatter(plots.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
  ratio.set_ylabel("busbw JAX / nccl-tests")
  ratio.legend(fontsize=7)
  ratio.set_xlabel("message size S (bytes)")
  for ax in (bw, ratio):
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(plots.ticker.LogLocator(base=2, numticks=8))
    ax.xaxis.set_major_formatter(plots.ticker.FuncFormatter(lambda x, _: tables.size_text(x)))
    ax.xaxis.set_minor_locator(plots.ticker.NullLocator())
    ax.grid(True, which="major", alpha=0.3)


def figure(points: Sequence[dict[str, Any]]) -> plots.Figure:
  """One column per collective: busbw against size (JAX solid, one colour per scope/dtype/group size; nccl-tests
  grey, dashed, its in-place dotted), and below it JAX / nccl-tests with each point's interval as a bar, points
  beyond the noise ringed red."""
  by_coll = _series(points)
  cols = max(1, len(by_coll))
  fig = plots.Figure(figsize=(5.2 * cols, 6.4), dpi=plots.DPI, layout="constrained")
  axes = fig.subplots(2, cols, squeeze=False, sharex="col")
  noise = sorted({p["noise"] for p in points})
  fig.suptitle("JAX beside nccl-tests: busbw per size (solid: JAX; grey dashed: nccl-tests out-of-place, dotted:"
               " in-place)\nbelow: JAX / nccl-tests; bars: intervals holding at 95% together, from "
               f"{'; '.join(noise) or 'no samples'}; ringed red: beyond the noise", fontsize=9)
  for j, (coll, series) in enumerate(sorted(by_coll.items())):
    bw, ratio = axes[0][j], axes[1][j]
    _draw_nccl_tests(bw, series)
    _draw_jax(bw, ratio, series)
    _label_column(bw, ratio, coll)
  if not by_coll:
    axes[0][0].text(0.5, 0.5, "no point matches a nccl-tests row", ha="center", transform=axes[0][0].transAxes)
  return fig


def layout(collectives: Sequence[str]) -> list[tuple[str, list[tuple[str, list[str]]]]]:
  """Custom Scalars: per collective, nccl-tests' busbw (merged into the sweep's own busbw charts by their regex)
  and the ratio with its bounds."""
  return [(f"JAX / nccl-tests busbw: {run_folder.STEP_NOTE}",
           [(f"{c}: JAX / nccl-tests busbw (lo, ratio, hi)", [f"^nccl_tests_ratio(_lo|_hi)?/{c}/"])
            for c in collectives])]


def write_tensorboard(out: str, points: Sequence[dict[str, Any]], table: str,
                      fig: plots.Figure | None = None) -> str:
  """The comparison as the TensorBoard run OUT/nccl-tests (its earlier events replaced: the folder is this
  module's alone); returns the folder. nccl-tests' busbw is written once per sweep series and size."""
  folder = os.path.join(out, RUN)
  os.makedirs(folder, exist_ok=True)
  for old in glob.glob(os.path.join(folder, "events.out.tfevents*")):
    os.remove(old)
  log = TensorBoardLog(folder, flush_each=False)
  try:
    seen = set()
    for p in points:
      base, step = f"{p['collective']}/{p['scope']}/{p['dtype']}", run_folder.size_step(p["bytes"])
      if (base, step) in seen:  # the same point of several runs: nccl-tests measured it once
        continue
      seen.add((base, step))
      log.scalar(f"busbw_gbps/{base}", p["nccl_busbw_gbps"], step,
                 description="nccl-tests' busbw (GB/s, out-of-place) at the sizes a JAX sweep measured too. "
                 + run_folder.STEP_NOTE)
      for tag, value in zip(RATIO_TAGS, (p["ratio"], p["lo"], p["hi"])):
        if value is not None:
          log.scalar(f"{tag}/{base}", value, step, description=_RATIO_NOTE + run_folder.STEP_NOTE)
    log.custom_scalars(layout(sorted({p["collective"] for p in points})))
    log.text("nccl_tests", table)
    if fig is not None:
      buf = io.BytesIO()
      fig.savefig(buf, format="png", dpi=build.IMAGE_DPI)  # as the report's other TensorBoard images
      png = buf.getvalue()
      width, height = struct.unpack(">II", png[16:24])  # the PNG header's IHDR chunk
      log.image("nccl_tests/figure", png, width, height)
  finally:
    log.close()
  return folder
