"""The history drawn: a PNG panel per collective and scope (busbw per run at the bandwidth-bound size, the
runs' intervals, the baseline's band, the fabric model's expectation, change points marked) and the same
series as TensorBoard scalars (step = the run's place in the history)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from microbench.output.tensorboard import TensorBoardLog
from microbench.store.history import Point, Series

FIGURE = "history.png"


def pick(series: dict[Series, list[Point]]) -> dict[Series, list[Point]]:
  """Per collective, scope, dtype and group size the largest size (the bandwidth-bound end) that has runs."""
  best: dict[tuple, Series] = {}
  for key, pts in series.items():
    head = key[:4]
    if head not in best or (key[4], len(pts)) > (best[head][4], len(series[best[head]])):
      best[head] = key
  return {k: series[k] for k in sorted(best.values())}


def figure(chosen: dict[Series, list[Point]], changes: dict[Series, list[int]],
           band: dict[Series, tuple[float, float]], labels: Sequence[str]):
  """One panel per series; x = the run's place (labelled with its date)."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  keys = list(chosen)
  fig = Figure(figsize=(9, 2.6 * max(1, len(keys))), layout="constrained")
  axes = fig.subplots(max(1, len(keys)), 1, squeeze=False)[:, 0]
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel
  order = {l: i + 1 for i, l in enumerate(labels)}  # runs numbered from 1, as the CHANGE lines name them
  for ax, key in zip(axes, keys):
    pts = chosen[key]
    x = [order[p.run_id] for p in pts]
    y = [p.busbw for p in pts]
    err = [[p.busbw - (p.lo or p.busbw) for p in pts], [(p.hi or p.busbw) - p.busbw for p in pts]]
    ax.errorbar(x, y, yerr=err, fmt="o-", ms=3, lw=1, label="measured (run's 95% interval)")
    if key in band:
      ax.axhspan(*band[key], color="tab:green", alpha=0.15, label="baseline band")
    exp = [p.expected for p in pts if p.expected]
    if exp:
      ax.axhline(exp[-1], color="grey", ls="--", lw=1, label="fabric model")
    for i in changes.get(key, []):
      ax.axvline(x[i] - 0.5, color="tab:red", lw=1.5, label=f"change at run {x[i]}")
    ax.set_title(f"{key[0]} over {key[1]}, {key[2]}, n={key[3]}, {key[4]} B", fontsize=9)
    ax.set_ylabel("busbw (GB/s)")
    ax.set_xlabel("run (in finishing order)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7, loc="best")
  return fig


def tensorboard(out: str, chosen: dict[Series, list[Point]], labels: Sequence[str]) -> str:
  """history/busbw_gbps/<collective>/<scope>/<dtype>/n<group>/<bytes> at step = the run's place."""
  folder = os.path.join(out, "tensorboard")
  log = TensorBoardLog(folder)
  order = {l: i for i, l in enumerate(labels)}
  try:
    for key, pts in chosen.items():
      tag = "history/busbw_gbps/" + "/".join(map(str, (key[0], key[1], key[2], f"n{key[3]}", key[4])))
      for p in pts:
        log.scalar(tag, p.busbw, order[p.run_id], "busbw per run of this machine, step = the run's place in time")
        if p.expected:
          log.scalar(tag.replace("busbw_gbps", "expected_busbw_gbps", 1), p.expected, order[p.run_id])
  finally:
    log.close()
  return folder
