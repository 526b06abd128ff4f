"""Every process and node of a sweep: which one is slower than the others, at which points, and whether that is
resolved beyond noise (`microbench-report --ranks RUN`).

The per-process times are each process's own host timer from the barrier before a call to the call's end, so
a process that finishes its part late (a slow host, GPU or NIC; `--inject_delay`) is slow in its own times,
while the others' stay the reference. A process that drives several GPUs has one timer for all of them:
per GPU means per process only where each process drives one GPU.

The test: each sample of a point is one call every process timed together, so process p's reference in
sample s is the median of the other processes' times in that same sample (paired: a busy machine slows a
sample for everyone and cancels). Two estimates of how much slower p is, each with a Student-t interval:
by ratio, the geometric mean of its per-sample ratios to the reference (t on the logs), right for a process
slow by a factor while the machine's load scales every sample; and by difference, its mean time over the
reference's mean (t on the paired differences), right for a process late by a constant while the shared time
varies, and the only one where a time by difference is near zero or negative (an operation within the
per-call noise: there one sample's ratio is meaningless or undefined). A loaded 4-process run showed both: a
healthy process's negative time and a shared time varying 100x between samples hid a process 20 ms late in
every sample from the ratio alone. Each process's deviation is the estimate whose interval's low end is
higher. t, not order statistics or a bootstrap: a point may stop after 5 samples, where the widest
order-statistic interval (min, max) covers only 94%. The intervals are simultaneous over the point's
processes and both estimates (Bonferroni), so 1024 healthy processes do not raise false alarms at every
point. A process is named when the low end is more than OUTLIER_SHARE slower: slower beyond noise, and by
enough to matter. Only the slow side is named: with calls started at a barrier the fast ones are the reference."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from microbench.output import rank_times
from microbench.report import runs, tables

OUTLIER_SHARE = 0.10  # named when surely this much slower than the others (the sweep's STRAGGLER_SPREAD too)
CONFIDENCE = 0.95     # simultaneous over the processes of one point
HEAT_POINTS = 40      # heat map columns: the points where a process strays furthest from the others
TABLE_ROWS = 60       # outlier table rows at most (named first); the rest counted
MARKDOWN, FIGURE = "ranks.md", "ranks.png"
NO_RANKS = "has no per-rank timings (recorded before rank_samples existed); rerun the sweep to get them"


class RanksError(ValueError):
  """A run that cannot be read for per-rank figures; the message says why."""


@dataclasses.dataclass(frozen=True)
class Deviation:
  """One process at one point: how much slower than the other processes, with its interval."""
  process: int
  host: str
  point: str       # collective/scope dtype size
  ratio: float     # how much slower than the others' median in the same samples (by ratio or difference)
  lo: float | None  # interval of `ratio`; None: too few samples for one
  hi: float | None
  median_us: float

  @property
  def resolved(self) -> bool:
    return self.lo is not None and self.lo > 1 + OUTLIER_SHARE


@dataclasses.dataclass
class Analysis:
  processes: int
  hosts: list[str]                 # host of each process
  points: list[str]                # label of each measured point with per-rank timings
  relative: np.ndarray             # [process, point] process median / median over processes (the heat map)
  deviations: list[Deviation]      # every process slower than the others by OUTLIER_SHARE at a point
  samples: list[int]               # samples of each point


def others_median(times: np.ndarray) -> np.ndarray:
  """[process, sample]: the median of every other process's time in the same sample (sorted once, O(P log P)
  per sample rather than one median per process)."""
  p = times.shape[0]
  order = np.argsort(times, axis=0, kind="stable")
  v = np.take_along_axis(times, order, axis=0)
  rank = np.empty_like(order)
  np.put_along_axis(rank, order, np.arange(p)[:, None].repeat(times.shape[1], axis=1), axis=0)
  n = p - 1
  lo_i, hi_i = (n - 1) // 2, n // 2
  lo = np.take_along_axis(v, lo_i + (lo_i >= rank), axis=0)
  hi = np.take_along_axis(v, hi_i + (hi_i >= rank), axis=0)
  return 0.5 * (lo + hi)


def _by_ratio(times_us: np.ndarray, ref: np.ndarray, t: float) -> tuple[np.ndarray, ...]:
  """Geometric mean of per-sample ratios and its interval (t on the logs); NaN where a time is not positive."""
  with np.errstate(divide="ignore", invalid="ignore"):
    logs = np.log(times_us / ref)
  good = np.isfinite(logs).all(axis=1) & (times_us > 0).all(axis=1) & (ref > 0).all(axis=1)
  logs = np.where(good[:, None], logs, 0.0)
  mean = logs.mean(axis=1)
  half = t * logs.std(axis=1, ddof=1) / math.sqrt(logs.shape[1]) if logs.shape[1] > 1 else np.nan
  nan = np.full(logs.shape[0], np.nan)
  return np.where(good, np.exp(mean), nan), np.where(good, np.exp(mean - half), nan), \
      np.where(good, np.exp(mean + half), nan)


def _by_difference(times_us: np.ndarray, ref: np.ndarray, t: float) -> tuple[np.ndarray, ...]:
  """Mean time over the reference's mean and its interval (t on the paired differences, scaled by that mean);
  NaN where the reference's mean is not positive (nothing to be slower than)."""
  diff = times_us - ref
  scale = ref.mean(axis=1)
  usable = scale > 0
  safe = np.where(usable, scale, 1.0)
  ratio = np.where(usable, 1 + diff.mean(axis=1) / safe, np.nan)
  half = t * diff.std(axis=1, ddof=1) / math.sqrt(diff.shape[1]) if diff.shape[1] > 1 else np.nan
  return ratio, np.where(usable, ratio - half / safe, np.nan), np.where(usable, ratio + half / safe, np.nan)


def deviation(times_us: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per process: how much slower than the others (paired by sample) and the simultaneous interval, by ratio
  or by difference, whichever interval's low end is higher (NaN where neither has one: fewer than 2 samples,
  or no positive reference)."""
  procs, n = times_us.shape
  ref = others_median(times_us)
  t = tables._t((1 - CONFIDENCE) / (2 * 2 * procs), n - 1) if n > 1 else np.nan  # pylint: disable=protected-access
  r_ratio, lo_ratio, hi_ratio = _by_ratio(times_us, ref, t)
  r_diff, lo_diff, hi_diff = _by_difference(times_us, ref, t)
  pick = np.isnan(r_ratio) | (lo_diff > lo_ratio)  # a NaN low end compares False: the ratio where it has one
  return (np.where(pick, r_diff, r_ratio), np.where(pick, lo_diff, lo_ratio), np.where(pick, hi_diff, hi_ratio))


def point_label(r: dict[str, Any]) -> str:
  return f"{r['collective']}/{r['scope']} {r['dtype']} {tables.size_text(r['bytes'])}"


def hosts_of(meta: dict[str, Any], processes: int) -> list[str]:
  """Host of each process from meta.json's `processes` ("?" where it does not say)."""
  known = {p.get("process"): p.get("host") for p in meta.get("processes") or [] if isinstance(p, dict)}
  return [str(known.get(i) or "?") for i in range(processes)]


def analyse(records: list[dict[str, Any]], meta: dict[str, Any]) -> Analysis | None:
  """Per-process figures of a sweep's measured points; None when no point has per-rank timings."""
  points, rel_cols, devs, samples = [], [], [], []
  procs = 0
  hosts: list[str] = []
  for r in sorted(tables.ok(records), key=lambda r: (tables.series_key(r), r["bytes"])):
    try:
      times = rank_times.decode(r)
    except rank_times.RankTimesError as e:
      raise RanksError(str(e)) from None
    if times is None:
      continue
    if procs and times.shape[0] != procs:
      raise RanksError(f"{point_label(r)} has times of {times.shape[0]} processes, other points {procs}")
    procs = times.shape[0]
    hosts = hosts or hosts_of(meta, procs)
    label = point_label(r)
    med = np.median(times, axis=1)
    centre = float(np.median(med))
    rel_cols.append(med / centre if centre > 0 else np.full(procs, np.nan))
    points.append(label)
    samples.append(times.shape[1])
    if procs < 2:
      continue
    ratio, lo, hi = deviation(times)
    for p in np.flatnonzero(ratio > 1 + OUTLIER_SHARE):
      devs.append(Deviation(int(p), hosts[p], label, float(ratio[p]),
                            None if np.isnan(lo[p]) else float(lo[p]), None if np.isnan(hi[p]) else float(hi[p]),
                            float(med[p])))
  if not points:
    return None
  return Analysis(procs, hosts, points, np.stack(rel_cols, axis=1), devs, samples)


OUTLIER_HEADERS = ("process", "host", "point", "median (us)", "vs others", f"{CONFIDENCE:.0%} interval",
                   "resolved")
NODE_HEADERS = ("host", "processes", "median vs point median", "worst", "worst point", "named outliers")


def _pct(x: float | None) -> str:
  return "–" if x is None else f"{(x - 1) * 100:+.1f}%"


def outlier_rows(a: Analysis) -> list[tuple[Any, ...]]:
  devs = sorted(a.deviations, key=lambda d: (not d.resolved, -d.ratio))
  return [(d.process, d.host, d.point, d.median_us, _pct(d.ratio),
           f"{_pct(d.lo)} .. {_pct(d.hi)}" if d.lo is not None else "–",
           "yes" if d.resolved else ("no: within noise" if d.lo is not None else "no: too few samples"))
          for d in devs[:TABLE_ROWS]]


def named(a: Analysis) -> dict[int, list[str]]:
  """Processes slower than the others beyond noise: the points where each is."""
  out: dict[int, list[str]] = {}
  for d in a.deviations:
    if d.resolved:
      out.setdefault(d.process, []).append(d.point)
  return out


def node_rows(a: Analysis) -> list[tuple[Any, ...]]:
  names = named(a)
  rows = []
  for host in dict.fromkeys(a.hosts):
    idx = [i for i, h in enumerate(a.hosts) if h == host]
    rel = np.nanmedian(a.relative[idx], axis=0)  # the node's processes, per point
    worst = int(np.nanargmax(rel)) if np.isfinite(rel).any() else 0
    rows.append((host, ",".join(map(str, idx)), _pct(float(np.nanmedian(rel))), _pct(float(rel[worst])),
                 a.points[worst], ",".join(str(i) for i in idx if i in names) or "none"))
  return rows


def summary_line(a: Analysis) -> str:
  if a.processes < 2:
    return "one process: nothing to compare (per-rank figures need a multi-process run)"
  names = named(a)
  if not names:
    return (f"no process is more than {OUTLIER_SHARE:.0%} slower than the others beyond noise at any of"
            f" {len(a.points)} point(s)")
  return "slower than the others beyond noise: " + "; ".join(
      f"process {p} ({a.hosts[p]}) at {len(pts)} of {len(a.points)} point(s)" for p, pts in sorted(names.items()))


def markdown(label: str, a: Analysis) -> str:
  unresolved = sum(not d.resolved for d in a.deviations)
  rows = outlier_rows(a)
  more = len(a.deviations) - len(rows)
  return "\n".join([
      f"# Every rank: {label}", "",
      f"{a.processes} process(es) on {len(set(a.hosts))} host(s), {len(a.points)} point(s)."
      " Times are each process's own host timer (per GPU only where each process drives one GPU).", "",
      f"**{summary_line(a)}**", "",
      "## Per node", "",
      tables.markdown(NODE_HEADERS, node_rows(a)), "",
      "## Outliers", "",
      f"Processes more than {OUTLIER_SHARE:.0%} slower than the median of the others in the same samples (by"
      f" ratio or by difference, whichever resolves more); interval {CONFIDENCE:.0%} simultaneous over the"
      f" point's processes; resolved when its low end is above +{OUTLIER_SHARE:.0%}. {unresolved} within noise.",
      "",
      tables.markdown(OUTLIER_HEADERS, rows) if rows else "none", "",
      *([f"... {more} more row(s)", ""] if more > 0 else []),
  ])


def _columns(a: Analysis) -> list[int]:
  """The HEAT_POINTS points where some process strays furthest from the point's median, in sweep order."""
  spread = np.nanmax(np.abs(np.log(np.where(a.relative > 0, a.relative, np.nan))), axis=0, initial=0.0)
  return sorted(np.argsort(-np.nan_to_num(spread), kind="stable")[:HEAT_POINTS].tolist())


def figure(a: Analysis):
  """Heat maps of process x point and host x point: each one's median time / the point's median."""
  from matplotlib import colors  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  cols = _columns(a)
  hosts = list(dict.fromkeys(a.hosts))
  per_proc = a.relative[:, cols]
  per_host = np.stack([np.nanmedian(per_proc[[i for i, h in enumerate(a.hosts) if h == host]], axis=0)
                       for host in hosts])
  finite = per_proc[np.isfinite(per_proc) & (per_proc > 0)]
  top = float(max(1 + 2 * OUTLIER_SHARE, finite.max() if finite.size else 1.0))
  bottom = float(min(1 / top, finite.min() if finite.size else 1.0))  # as far below as above: no noise in deep blue
  norm = colors.TwoSlopeNorm(vcenter=1.0, vmin=bottom, vmax=top)
  rows = a.processes + len(hosts)
  fig = Figure(figsize=(max(6.0, 0.25 * len(cols) + 3), min(40.0, 2.5 + 0.18 * rows)), layout="constrained")
  axes = fig.subplots(2, 1, height_ratios=[max(1, a.processes), max(1, len(hosts))], sharex=True)
  for ax, data, names, title in ((axes[0], per_proc, [f"{i} {h}" for i, h in enumerate(a.hosts)], "process"),
                                 (axes[1], per_host, hosts, "host")):
    im = ax.imshow(data, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
    step = max(1, len(names) // 40)
    ax.set_yticks(range(0, len(names), step), names[::step], fontsize=7)
    ax.set_ylabel(title)
  axes[1].set_xticks(range(len(cols)), [a.points[c] for c in cols], rotation=90, fontsize=7)
  axes[0].set_title(f"each one's median time / the point's median over processes\n({len(cols)} of"
                    f" {len(a.points)} points: where a process strays furthest)", fontsize=9)
  fig.colorbar(im, ax=axes, shrink=0.8, label="x the point's median")
  return fig


def report(run_dir: str, out: str) -> tuple[str, str | None]:
  """Writes OUT/ranks.md and OUT/ranks.png for one sweep; returns the text to print and the figure's path
  (None when the run has no per-rank timings: the text says so in one line)."""
  try:
    sweeps, _ = runs.load([run_dir])
  except (runs.RunError, ValueError) as e:
    raise RanksError(str(e)) from None
  if len(sweeps) != 1:
    raise RanksError(f"{run_dir}: --ranks takes one sweep's run folder, found {len(sweeps)} sweep(s)")
  sweep = sweeps[0]
  a = analyse(sweep.records, sweep.meta)
  if a is None:
    return f"{sweep.path} {NO_RANKS}", None
  os.makedirs(out, exist_ok=True)
  text = markdown(sweep.label, a)
  with open(os.path.join(out, MARKDOWN), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  path = os.path.join(out, FIGURE)
  figure(a).savefig(path)
  return text, path
