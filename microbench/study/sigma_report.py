"""The study's results: samples read back from a results folder, sigma per matching key with its interval,
and the report (PNG plots, a Markdown summary, TensorBoard scalars).

A sample is one iteration of one job instance: the slowest rank's throughput. Warm-up iterations are left
out and, as the study's parser does, the first recorded iteration of every instance too. Baselines and
concurrent samples are pooled per key (strategy, model, GPUs, placement class) over repeats, respawns and
experiments. Plots (matplotlib, the `report` extra, imported only here and only when plotting):
violins of each concurrent sample's (geomean(baseline) / sample - 1) x 100 by placement class and strategy;
a heatmap over the experiments' placement x entropy bins of the median over jobs of each job's median slowdown
(per job, so one job with many short iterations does not outvote the others; medians of ratios, never means);
baseline throughput against GPUs per strategy, model and placement class (like for like: a rack-local 2-GPU
baseline is no reference for a cross-group 16-GPU one), log-log, with the ideal line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Callable

from microbench.output import jsonl
from microbench.output.tensorboard import TensorBoardLog
from microbench.study import predict, run_plan, stats
from microbench.study import workloads as wl

BINS = ("low", "medium", "high")


@dataclasses.dataclass(frozen=True)
class Sample:
  unit: str
  kind: str
  experiment: str | None
  job: str
  key: tuple[str, str, int, str]
  instance: int
  iteration: int
  throughput: float
  runtime_s: float
  comm_share: float


def read_records(path: str) -> list[dict]:
  """A proxy's JSONL (a torn last line from a kill is ignored)."""
  try:
    return jsonl.read(path)
  except OSError:  # unreadable: the unit is reported without this instance's records
    return []


def load(out_dir: str, drop_first: int = 1) -> tuple[list[Sample], dict[str, dict]]:
  """Every kept sample of every done unit, and the unit records by id."""
  done = run_plan.done_units(out_dir)
  samples: list[Sample] = []
  for unit in done.values():
    for job in unit["jobs"]:
      key = run_plan.key_of(job)
      for inst in job["instances"]:
        raw = inst["raw"] if os.path.isabs(inst["raw"]) else os.path.join(out_dir, inst["raw"])
        if not os.path.exists(raw):  # the results folder was moved: look beside it
          raw = os.path.join(out_dir, "raw", unit["unit"], os.path.basename(inst["raw"]))
        iters = [r for r in read_records(raw) if r.get("kind") == "iter" and not r.get("warmup")]
        for r in iters[drop_first:]:
          samples.append(Sample(unit["unit"], unit["kind"], unit.get("experiment"), job["name"], key, inst["n"],
                                r["iter"], r["throughput"], r["runtime_s"], r["comm_share"]))
  return samples, done


@dataclasses.dataclass(frozen=True)
class KeyResult:
  key: tuple[str, str, int, str]
  sigma: stats.Sigma | None
  comm_share_baseline: float
  comm_share_concurrent: float
  n_baseline: int
  n_concurrent: int


def by_key(samples: list[Sample]) -> dict[tuple, KeyResult]:
  base: dict[tuple, list[Sample]] = {}
  conc: dict[tuple, list[Sample]] = {}
  for s in samples:
    (base if s.kind == "baseline" else conc).setdefault(s.key, []).append(s)
  out = {}
  for key in sorted(set(base) | set(conc), key=lambda k: (k[0], k[1], k[2], k[3])):
    b, c = base.get(key, []), conc.get(key, [])
    sig = stats.sigma([x.throughput for x in b], [x.throughput for x in c]) if b and c else None
    out[key] = KeyResult(key, sig, stats.comm_share([x.comm_share for x in b]),
                         stats.comm_share([x.comm_share for x in c]), len(b), len(c))
  return out


def per_experiment(samples: list[Sample]) -> dict[tuple, dict[str, stats.Sigma]]:
  """sigma per key and experiment (the artifact's unit): each mix's samples against the key's baseline."""
  base: dict[tuple, list[float]] = {}
  conc: dict[tuple, dict[str, list[float]]] = {}
  for s in samples:
    if s.kind == "baseline":
      base.setdefault(s.key, []).append(s.throughput)
    elif s.experiment:
      conc.setdefault(s.key, {}).setdefault(s.experiment, []).append(s.throughput)
  return {k: stats.per_experiment(base[k], v) for k, v in conc.items() if k in base}


def slowdowns(samples: list[Sample], keys: dict[tuple, KeyResult]) -> list[tuple[Sample, float]]:
  """Each concurrent sample with its slowdown in % against its key's baseline geomean."""
  out = []
  for s in samples:
    k = keys.get(s.key)
    if s.kind == "concurrent" and k and k.sigma:
      out.append((s, stats.slowdowns_percent(k.sigma.baseline_geomean, [s.throughput])[0]))
  return out


@dataclasses.dataclass(frozen=True)
class JobSlowdown:
  """One job of one experiment: the median of its concurrent samples' slowdowns (%), and how many there were."""
  unit: str
  job: str
  median_pct: float
  n_samples: int


def bin_cells(slow: list[tuple[Sample, float]], units: dict[str, dict]
              ) -> dict[tuple[str, str], list[JobSlowdown]]:
  """Per placement bin x entropy bin, each job's own median slowdown: a cell is summarised over jobs, not over
  pooled samples, because a job's sample count follows its iteration time (a fast rack-local job can give 100
  samples to a slowed job's 10 and would otherwise decide the cell alone)."""
  per_job: dict[tuple[str, str], list[float]] = {}
  where: dict[tuple[str, str], tuple[str, str]] = {}
  for s, v in slow:
    m = units[s.unit].get("meta") or {}
    if m.get("placement_bin") and m.get("entropy_bin"):
      per_job.setdefault((s.unit, s.job), []).append(v)
      where[(s.unit, s.job)] = (m["placement_bin"], m["entropy_bin"])
  cells: dict[tuple[str, str], list[JobSlowdown]] = {}
  for (unit, job), vals in sorted(per_job.items()):
    cells.setdefault(where[(unit, job)], []).append(JobSlowdown(unit, job, statistics.median(vals), len(vals)))
  return cells


def cell_median(jobs: list[JobSlowdown]) -> float:
  """A cell's figure: the median over its jobs of each job's median slowdown."""
  return statistics.median(j.median_pct for j in jobs)


def baseline_scaling(samples: list[Sample]) -> dict[tuple[str, str, str], list[tuple[int, float]]]:
  """Baseline throughput (geomean) against GPUs per (strategy, model, placement class), GPUs ascending: only a
  like-for-like series gives a parallel efficiency; across placements it would measure the placement."""
  per: dict[tuple[str, str, str], dict[int, list[float]]] = {}
  for s in samples:
    if s.kind == "baseline":
      per.setdefault((s.key[0], s.key[1], s.key[3]), {}).setdefault(s.key[2], []).append(s.throughput)
  order = {st: i for i, st in enumerate(wl.STRATEGIES)}
  return {k: [(g, stats.geomean(v)) for g, v in sorted(per_g.items())]
          for k, per_g in sorted(per.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0]))}


def _fmt(x: float, digits: int = 3) -> str:
  return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown(keys: dict[tuple, KeyResult], units: dict[str, dict], cells: dict[tuple[str, str], list[JobSlowdown]],
             scaling: dict[tuple[str, str, str], list[tuple[int, float]]], plots: list[str], note: str,
             predicted: dict | None = None, per_exp: dict[tuple, dict[str, stats.Sigma]] | None = None) -> str:
  """The report as Markdown: a section per kind of figure, each only where the results have it."""
  lines = ["# Multi-tenancy interference study", "",
           "sigma = geomean(baseline throughput) / median(concurrent throughput); > 1 means slower when "
           "sharing. CI: the 95% interval of sigma from the medians' Le Boudec intervals "
           "[base_lo / conc_hi, base_hi / conc_lo]. `>5%`: share of concurrent samples more than 5% slower "
           "than the baseline geomean. comm: mean over iterations of the largest exposed-communication share "
           "over ranks.", ""]
  if note:
    lines += [note, ""]
  lines += _sigma_section(keys)
  if per_exp:
    lines += _per_experiment_section(keys, per_exp)
  if predicted:
    lines += _predicted_section(keys, predicted)
  lines += _experiments_section(units)
  if cells:
    lines += _cells_section(cells)
  if scaling:
    lines += _scaling_section(scaling)
  if plots:
    lines += ["", "## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
  return "\n".join(lines) + "\n"


def _sigma_section(keys: dict[tuple, KeyResult]) -> list[str]:
  """Sigma per key, with its interval, the share of slower samples and the communication shares."""
  lines: list[str] = []
  lines += ["## Sigma per strategy, model, GPUs and placement class", "",
            "| strategy | model | GPUs | placement | n base | n conc | base geomean (samples/s) | "
            "conc median | sigma | 95% CI | excludes 1 | >5% | comm base | comm conc |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for k in keys.values():
    s = k.sigma
    if s:
      ci = (f"[{s.low:.3f}, {s.high:.3f}] | {'yes' if s.excludes_one else 'no'}" if s.has_interval
            else "none (<= 5 samples) | n/a")
      lines.append(f"| {k.key[0]} | {k.key[1]} | {k.key[2]} | {k.key[3]} | {k.n_baseline} | {k.n_concurrent} | "
                   f"{s.baseline_geomean:.4g} | {s.concurrent_median:.4g} | **{s.sigma:.3f}** | {ci} | "
                   f"{100 * s.share_slower:.0f}% | {_fmt(k.comm_share_baseline, 2)} | "
                   f"{_fmt(k.comm_share_concurrent, 2)} |")
    else:
      lines.append(f"| {k.key[0]} | {k.key[1]} | {k.key[2]} | {k.key[3]} | {k.n_baseline} | {k.n_concurrent} | "
                   "| | n/a | | | | | |")
  return lines


def _per_experiment_section(keys: dict[tuple, KeyResult], per_exp: dict[tuple, dict[str, stats.Sigma]]
                            ) -> list[str]:
  """Sigma per experiment beside the key's pooled figure, with the study's and a bootstrap interval."""
  lines: list[str] = []
  lines += ["", "## Sigma per experiment (the artifact's unit)", "",
            "Each mix's concurrent samples against the key's baseline; `all` pools the key's mixes (the table"
            " above). Two 95% intervals: the study's (from the medians' intervals; it can miss its own point"
            " estimate, which uses the baseline geomean) and a percentile bootstrap of the ratio itself.", "",
            "| strategy | model | GPUs | placement | experiment | n conc | sigma | study CI | bootstrap CI |",
            "|---|---|---|---|---|---|---|---|---|"]
  for k in keys.values():
    rows = ([("all", k.sigma)] if k.sigma else []) + sorted((per_exp.get(k.key) or {}).items())
    for e, x in rows:
      study = f"[{x.low:.3f}, {x.high:.3f}]" if x.has_interval else "none (<= 5 samples)"
      lines.append(f"| {k.key[0]} | {k.key[1]} | {k.key[2]} | {k.key[3]} | {e} | {x.n_concurrent} |"
                   f" {x.sigma:.3f} | {study} | [{_fmt(x.boot_low)}, {_fmt(x.boot_high)}] |")
  return lines


def _predicted_section(keys: dict[tuple, KeyResult], predicted: dict) -> list[str]:
  """Each key's predicted sigma against the measured one, the errors' median and worst, the assumptions."""
  lines: list[str] = []
  lines += ["", "## Predicted against measured sigma", "",
            "Predicted before the run by `microbench-study predict` (fabric model: flows share links max-min"
            " fairly; assumptions below). error = (predicted - measured) / measured.", "",
            "| strategy | model | GPUs | placement | measured sigma | predicted sigma | error |",
            "|---|---|---|---|---|---|---|"]
  errors = []
  for k in keys.values():
    p = predicted["keys"].get(run_plan.key_name(k.key))
    if p is None:
      continue
    measured = k.sigma.sigma if k.sigma else None
    err = None if measured is None else (p["sigma"] - measured) / measured
    if err is not None:
      errors.append(abs(err))
    lines.append(f"| {k.key[0]} | {k.key[1]} | {k.key[2]} | {k.key[3]} | {_fmt(measured)} | {p['sigma']:.3f} |"
                 f" {'n/a' if err is None else f'{100 * err:+.1f}%'}"
                 f"{' (latency-bound)' if p.get('note') else ''} |")
  if errors:
    lines += ["", f"|error| over {len(errors)} key(s): median {100 * statistics.median(errors):.1f}%,"
                  f" worst {100 * max(errors):.1f}%."]
  lines += [""] + [f"- assumed: {a}" for a in predicted.get("assumptions", [])]
  return lines


def _experiments_section(units: dict[str, dict]) -> list[str]:
  """The concurrent units: pattern, jobs, entropy and placement bins, how each ended (none: no section)."""
  lines: list[str] = []
  exps = [u for u in units.values() if u["kind"] == "concurrent"]
  if exps:
    lines += ["", "## Experiments", "", "| id | pattern | jobs | entropy | placement score | how it ended |",
              "|---|---|---|---|---|---|"]
    for u in sorted(exps, key=lambda u: u["unit"]):
      m = u.get("meta") or {}
      jobs = ", ".join(f"{j['strategy']}x{j['gpus']}@{j['placement_class']} ({len(j['instances'])} run(s))"
                       for j in u["jobs"])
      pat = (m.get("pattern") or {}).get("id", "?")
      lines.append(f"| {u['unit']} | {pat} | {jobs} | {m.get('entropy_bin')} ({_fmt(m.get('entropy_norm'), 2)}) | "
                   f"{m.get('placement_bin')} ({_fmt(m.get('placement_score'), 2)}) | {u['ended']} |")
  return lines


def _cells_section(cells: dict[tuple[str, str], list[JobSlowdown]]) -> list[str]:
  """Median slowdown over jobs by placement bin and entropy bin."""
  lines: list[str] = []
  lines += ["", "## Median slowdown (%) over jobs by placement bin (rows) and entropy bin (columns)", "",
            "Per job (one job of one experiment, its respawns together): the median of its samples' slowdowns;"
            " a cell gives the median over its jobs, then the mean over jobs, the number of jobs and of samples."
            " Jobs weigh the same whatever their sample count.", "",
            "| placement \\ entropy | " + " | ".join(BINS) + " |", "|---|---|---|---|"]
  for p in BINS:
    row = [(f"{cell_median(cells[(p, h)]):.1f} (mean {statistics.fmean(j.median_pct for j in cells[(p, h)]):.1f};"
            f" {len(cells[(p, h)])} jobs, {sum(j.n_samples for j in cells[(p, h)])} samples)")
           if cells.get((p, h)) else "-" for h in BINS]
    lines.append(f"| {p} | " + " | ".join(row) + " |")
  return lines


def _scaling_section(scaling: dict[tuple[str, str, str], list[tuple[int, float]]]) -> list[str]:
  """Baseline throughput against GPU count per strategy, model and placement class, with parallel efficiency."""
  lines: list[str] = []
  lines += ["", "## Baseline throughput scaling (like for like)", "",
            "Baselines of one strategy, model and placement class only; parallel efficiency = (T / T0) (g0 / g)"
            " against that series' fewest GPUs (`ref.`); a series with one GPU count has none.", "",
            "| strategy | model | placement | GPUs | samples/s | parallel efficiency |", "|---|---|---|---|---|---|"]
  for (st, model, cls), pts in scaling.items():
    g0, t0 = pts[0]
    for g, t in pts:
      eff = "-" if len(pts) == 1 else "ref." if g == g0 else f"{(t / t0) * (g0 / g):.2f}"
      lines.append(f"| {st} | {model} | {cls} | {g} | {t:.4g} | {eff} |")
  return lines


def _save(plt, fig, out: str, name: str) -> str:
  """Lays out, writes and closes one figure; returns its path."""
  fig.tight_layout()
  path = os.path.join(out, name)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _violins(plt, out: str, slow: list[tuple[Sample, float]]) -> str | None:
  """violins.png: the concurrent samples' slowdowns per placement class, a violin per strategy; None (nothing
  written) without samples."""
  from microbench.study import machines as mm  # pylint: disable=g-import-not-at-top
  classes = [c for c in mm.CLASSES if any(s.key[3] == c for s, _ in slow)]
  strategies = [st for st in wl.STRATEGIES if any(s.key[0] == st for s, _ in slow)]
  if not classes:
    return None
  fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(classes)), 4.5))
  width = 0.8 / max(1, len(strategies))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, st in enumerate(strategies):
    data, pos = [], []
    for c, cls in enumerate(classes):
      vals = [v for s, v in slow if s.key[0] == st and s.key[3] == cls]
      if vals:
        data.append(vals)
        pos.append(c + (i - (len(strategies) - 1) / 2) * width)
    if not data:
      continue
    parts = ax.violinplot(data, positions=pos, widths=width * 0.9, showmedians=True)
    for body in parts["bodies"]:
      body.set_facecolor(colors[i % len(colors)])
      body.set_alpha(0.6)
    ax.plot([], [], color=colors[i % len(colors)], lw=6, alpha=0.6, label=wl.STRATEGIES[st].title)
  ax.axhline(0, color="grey", lw=0.8, ls="--")
  ax.set_xticks(range(len(classes)), classes, rotation=15)
  ax.set_ylabel("slowdown (sigma - 1) x 100 %")
  ax.set_title("Concurrent samples against their baseline, by placement class")
  ax.legend(fontsize=8)
  return _save(plt, fig, out, "violins.png")


def _heatmap(plt, out: str, cells: dict[tuple[str, str], list[JobSlowdown]]) -> str:
  """heatmap.png: the median over jobs of each job's median slowdown, per placement bin and mix entropy bin."""
  grid = [[cell_median(cells[(p, h)]) if cells.get((p, h)) else math.nan for h in BINS] for p in BINS]
  fig, ax = plt.subplots(figsize=(5.5, 4.5))
  im = ax.imshow(grid, cmap="viridis", origin="lower")
  for r, p in enumerate(BINS):
    for c, h in enumerate(BINS):
      if cells.get((p, h)):
        bright = im.norm(grid[r][c]) > 0.5  # dark text on the bright end of viridis
        ax.text(c, r, f"{grid[r][c]:.1f}%\n{len(cells[(p, h)])} jobs", ha="center", va="center",
                color="k" if bright else "w", fontsize=8)
  ax.set_xticks(range(3), BINS)
  ax.set_yticks(range(3), BINS)
  ax.set_xlabel("mix entropy bin")
  ax.set_ylabel("placement (locality score) bin")
  ax.set_title("Median over jobs of each job's median slowdown (%)")
  fig.colorbar(im, ax=ax, label="median over jobs, (sigma - 1) x 100 %")
  return _save(plt, fig, out, "heatmap.png")


def _scaling(plt, out: str, scaling: dict[tuple[str, str, str], list[tuple[int, float]]]) -> str:
  """scaling.png: baseline throughput against GPUs per strategy, model and placement class, ideal dotted."""
  fig, ax = plt.subplots(figsize=(6, 4.5))
  for (st, model, cls), pts in scaling.items():
    gs, ts = [g for g, _ in pts], [t for _, t in pts]
    line, = ax.plot(gs, ts, "o-", label=f"{wl.STRATEGIES[st].title if st in wl.STRATEGIES else st} {model} @ {cls}")
    ax.plot(gs, [ts[0] * g / gs[0] for g in gs], ls=":", color=line.get_color())
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("GPUs")
  ax.set_ylabel("baseline throughput (samples/s)")
  ax.set_title("Baseline scaling per placement class (dotted: ideal)")
  ax.legend(fontsize=8)
  return _save(plt, fig, out, "scaling.png")


def plot(out: str, keys: dict[tuple, KeyResult], slow: list[tuple[Sample, float]],
         cells: dict[tuple[str, str], list[JobSlowdown]], scaling: dict[tuple[str, str, str], list[tuple[int, float]]]
         ) -> list[str]:
  """The three PNGs; returns their paths. Needs matplotlib (the `report` extra)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  paths = []
  if (violins := _violins(plt, out, slow)) is not None:
    paths.append(violins)
  if cells:
    paths.append(_heatmap(plt, out, cells))
  if scaling:
    paths.append(_scaling(plt, out, scaling))
  return paths


def build(out_dir: str, report_dir: str | None = None, drop_first: int = 1, plots: bool = True,
          say: Callable[[str], None] = print) -> dict:
  """Reads a results folder and writes report.md, sigma.json, PNGs and TensorBoard scalars into report_dir."""
  report_dir = report_dir or os.path.join(out_dir, "report")
  os.makedirs(report_dir, exist_ok=True)
  samples, units = load(out_dir, drop_first)
  keys = by_key(samples)
  slow = slowdowns(samples, keys)
  cells = bin_cells(slow, units)
  scaling = baseline_scaling(samples)
  note = ""
  recorded = read_records(os.path.join(out_dir, run_plan.UNITS_FILE))
  failed = sorted({u["unit"] for u in recorded if u.get("status") != "done"} - set(units))
  if failed:
    note = f"{len(failed)} unit(s) failed (run again by `run --resume`): " + ", ".join(failed)
  pngs: list[str] = []
  if plots:
    try:
      pngs = plot(report_dir, keys, slow, cells, scaling)
    except ImportError:
      say("PNG plots need matplotlib: pip install -e '.[report]' (Markdown and TensorBoard written)")
  predicted = predict.read(out_dir)
  per_exp = per_experiment(samples)
  md = markdown(keys, units, cells, scaling, pngs, note, predicted, per_exp)
  with open(os.path.join(report_dir, "report.md"), "w", encoding="utf-8") as f:
    f.write(md)
  table = [{"strategy": k.key[0], "model": k.key[1], "gpus": k.key[2], "placement_class": k.key[3],
            "n_baseline": k.n_baseline, "n_concurrent": k.n_concurrent,
            "comm_share_baseline": k.comm_share_baseline, "comm_share_concurrent": k.comm_share_concurrent,
            **({"sigma": dict(dataclasses.asdict(k.sigma), has_interval=k.sigma.has_interval,
                              excludes_one=k.sigma.excludes_one)} if k.sigma else {}),
            **({"per_experiment": {e: {f: getattr(x, f) for f in ("sigma", "low", "high", "boot_low", "boot_high",
                                                                 "n_concurrent")}
                                   for e, x in sorted(per_exp[k.key].items())}} if k.key in per_exp else {}),
            **({"predicted": predicted["keys"][run_plan.key_name(k.key)]}
               if predicted and run_plan.key_name(k.key) in predicted["keys"] else {})} for k in keys.values()]
  with open(os.path.join(report_dir, "sigma.json"), "w", encoding="utf-8") as f:
    json.dump(table, f, indent=1)
  tb = TensorBoardLog(os.path.join(report_dir, "tensorboard"), flush_each=False)
  for k in keys.values():
    name = run_plan.key_name(k.key)
    if k.sigma:
      for what in ("sigma", "low", "high", "share_slower"):
        tb.scalar(f"sigma/{name}/{what}", getattr(k.sigma, what), 0)
    tb.scalar(f"comm_share/{name}/baseline", k.comm_share_baseline, 0)
    tb.scalar(f"comm_share/{name}/concurrent", k.comm_share_concurrent, 0)
  step: dict[str, int] = {}
  for s in samples:
    tag = f"throughput/{s.unit}/{s.job}"
    tb.scalar(tag, s.throughput, step.get(tag, 0))
    step[tag] = step.get(tag, 0) + 1
  tb.text("report", md)
  tb.close()
  say(f"report: {len(samples)} samples, {sum(1 for k in keys.values() if k.sigma)} sigma(s) -> {report_dir}")
  return {"report_dir": report_dir, "keys": keys, "plots": pngs, "samples": len(samples), "markdown": md}
