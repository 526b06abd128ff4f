"""`microbench-report --history [--since=DATE] [--machine=ID]`: a machine's busbw over time per collective,
scope and size, the change points of every size named; history.png draws each series' largest
(bandwidth-bound) size with the baseline's band and the fabric model's expectation; TensorBoard gets every size."""

from __future__ import annotations

import datetime
import os

from absl import app

from microbench.cli.report_modes import common

FLAGS = common.FLAGS


def _machine(conn, queries) -> str:
  machines = queries.machines(conn)
  if FLAGS.machine:
    hits = [m for m in machines if m["machine_id"].startswith(FLAGS.machine)]
    if len(hits) != 1:
      raise app.UsageError(f"--machine={FLAGS.machine}: {len(hits)} machine(s) match; the store has: "
                           + "; ".join(f"{m['machine_id'][:8]} {m['name']}" for m in machines))
    return hits[0]["machine_id"]
  swept = {r["machine_id"] for r in queries.machine_runs(conn, kind="sweep")}
  if len(swept) != 1:
    raise app.UsageError(f"the store has sweeps of {len(swept)} machines: name one with --machine=ID ("
                         + "; ".join(f"{m['machine_id'][:8]} {m['name']}" for m in machines if m["machine_id"] in swept)
                         + ")")
  return swept.pop()


def _band(conn, queries, history, machine_id: str):
  """Per series, the baseline runs' busbw range (their intervals' outer edges) for a baseline of this machine."""
  names = [n for n in queries.baselines(conn) if (queries.baseline(conn, n) or ("",))[0] == machine_id]
  if not names:
    return {}, None
  name = FLAGS.against or names[-1]
  b = queries.baseline(conn, name)
  if b is None:
    return {}, None
  band = {}
  for key, pts in history.series(conn, machine_id).items():
    inside = [p for p in pts if p.run_id in b[1]]
    if inside:
      band[key] = (min(p.lo or p.busbw for p in inside), max(p.hi or p.busbw for p in inside))
  return band, name


def main(paths: list[str]) -> int:
  from microbench.report import plots  # pylint: disable=import-outside-toplevel
  from microbench.store import history, history_views, queries  # pylint: disable=import-outside-toplevel
  store = common.open_store(common.beside(paths))
  with store.read() as conn:
    machine_id = _machine(conn, queries)
    runs = queries.machine_runs(conn, machine_id, "sweep", since=FLAGS.since)
    all_series = history.series(conn, machine_id, FLAGS.since)
    band, band_name = _band(conn, queries, history, machine_id)
  if len(runs) < 2:
    raise app.UsageError(f"machine {machine_id[:8]}: {len(runs)} sweep(s) in the store since {FLAGS.since or 'ever'}:"
                         " a history needs two")
  labels = [r["run_id"] for r in runs]
  chosen = history_views.pick(all_series)  # drawn: the bandwidth-bound end of each series
  changes = {k: history.change_points(v, FLAGS.tolerance) for k, v in sorted(all_series.items())}  # named: every size
  print(f"history of {runs[0]['machine_name']} ({machine_id[:8]}): {len(runs)} sweep(s) from {runs[0]['finished_at']}"
        f" to {runs[-1]['finished_at']}" + (f"; band: baseline {band_name}" if band_name else ""))
  for key, idx in changes.items():
    pts = all_series[key]
    for i in idx:
      before, after = pts[i - 1].busbw, pts[i].busbw
      print(f"CHANGE {key[0]} {key[1]} {key[2]} n={key[3]} {key[4]} B at run {labels.index(pts[i].run_id) + 1}"
            f" ({pts[i].finished_at}, {pts[i].run_id}): busbw {before:.4g} -> {after:.4g} GB/s")
  if not any(changes.values()):
    print("no change point beyond noise and --tolerance")
  out = FLAGS.out or os.path.join("runs", "history_" + datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y%m%d-%H%M%S"))
  os.makedirs(out, exist_ok=True)
  plots.save(history_views.figure(chosen, changes, band, labels), os.path.join(out, history_views.FIGURE))
  folder = history_views.tensorboard(out, all_series, labels)
  print(f"microbench-report: wrote {history_views.FIGURE} and TensorBoard scalars ({folder}) to {out}")
  return 0
