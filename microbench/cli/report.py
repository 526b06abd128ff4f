"""microbench-report: plots, tables, comparisons and alpha-beta fits from finished run folders (flags only;
the work is in microbench.report)."""

from __future__ import annotations

import datetime
import os
import sys

from absl import app, flags

from microbench.bench import sizes
from microbench.cli import absl_app, store_flags

FLAGS = flags.FLAGS

flags.DEFINE_string("out", None, "Report folder. Default: RUN_DIR/report for one run, report_<UTC time> for"
                    " several.")
flags.DEFINE_list("predict", [], "Message sizes (8, 64K, 32M, 1G) to predict each series' time for from its"
                  " alpha-beta fit: printed and added to the report.")
flags.DEFINE_string("fabric", None, "Predict on a described fabric instead of from run folders: leonardo, lumi,"
                    " alps, jupiter, dgx, nvl72 (with :leaf_up=GBPS,group_up=GBPS,nic=GBPS,scale_up=GBPS) or"
                    " testbed:hosts_per_rack=2,host_rate=400mbit,uplink_rate=100mbit. Needs --predict sizes and"
                    " --gpus or --shapes.")
flags.DEFINE_list("gpus", [], "With --fabric: group sizes, ranks filling nodes, leaves and groups in order.")
flags.DEFINE_list("shapes", [], "With --fabric: group shapes RANKS_PER_DOMAINxDOMAINS_PER_LEAFxLEAVES_PER_GROUPx"
                  "GROUPS (e.g. 4x2: two nodes of one leaf).")
flags.DEFINE_list("fit_from", [], "With --fabric: run folders whose alpha-beta fits replace the rate and hop"
                  " latency of the levels their scopes measured (model.json and meta.json), e.g. a 2-node sweep"
                  " inside a rack (the NICs) and one across two racks (the uplinks).")
flags.DEFINE_list("nccl_tests", [], "nccl-tests output to set beside the run(s), [COLLECTIVE=]PATH each: its text"
                  " log or its -J JSON file (COLLECTIVE where it does not name its binary, e.g. all_reduce=ar.log):"
                  " the busbw ratio per size with its interval, written to OUT/nccl_tests.md, OUT/nccl_tests.png"
                  " and the TensorBoard run OUT/nccl-tests.")
flags.DEFINE_bool("ranks", False, "Every rank of one sweep (RUN_DIR): a heat map of process x size (each"
                  " process's median time / the point's median over processes) and per host, and a table of the"
                  " processes slower than the others, with their interval and whether that is beyond noise:"
                  " OUT/ranks.md and OUT/ranks.png. Host timers: per GPU only with one GPU per process.")
flags.DEFINE_list("fabric_collectives", ["all_reduce"], "With --fabric: collectives to predict.")
flags.DEFINE_string("algorithm", "auto", "With --fabric: auto, ring, tree, hierarchical or nvls.")
# The results store (docs/results-store.md); --store comes from cli/store_flags.
flags.DEFINE_bool("index", False, "Index the run folders given (or found below them) into the results store;"
                  " idempotent, a malformed run is one line and the rest indexed.")
flags.DEFINE_string("baseline", None, "Name the runs given (one machine's) as baseline NAME in the store.")
flags.DEFINE_string("against", None, "Judge RUN against a baseline NAME, previous (its machine's last run of the"
                    " same kind) or another RUN: per point, beyond noise and --tolerance; exit 1 on a regression.")
flags.DEFINE_float("tolerance", 0.05, "A change smaller than this (0.05 = 5%) is not a regression or a change point,"
                   " even beyond noise.", lower_bound=0.0)
flags.DEFINE_bool("history", False, "busbw over time for one machine (--machine) from the store, with change points:"
                  " OUT/history.png and TensorBoard scalars.")
flags.DEFINE_string("since", None, "With --history or --fleet: runs finished at or after this ISO date/time.")
flags.DEFINE_string("machine", None, "With --history: the machine's id (or a prefix) in the store.")
flags.DEFINE_string("rules", None, "A TOML rules file judged on RUN (docs/results-store.md); exit 1 on a failed"
                    " rule, one line with FILE:LINE for a bad file.")
flags.DEFINE_bool("fleet", False, "Per node from the store's doctor runs: runs, times named, last named, last healthy.")
flags.DEFINE_string("prometheus", None, "Write the store's latest figures and verdicts as Prometheus text to this file"
                    " (node_exporter's textfile collector), atomically.")
flags.DEFINE_string("node", None, "With --prometheus: this node's series only. With --fleet: this node's latest"
                    " verdict, exit 1 when the doctor named it (a SLURM health check).")
flags.DEFINE_bool("drain", False, "Run the scontrol drain line printed for each node the judged doctor run named.")
# What XLA and NCCL read, written from the runs (docs/tuning.md).
flags.DEFINE_string("xla_perf_table", None, "Write XLA:GPU's collective performance table (text proto) from the"
                    " sweeps' checked points inside one node, merged into this file if it exists.")
flags.DEFINE_string("xla_device_key", None, "With --xla_perf_table: XLA's device key to write under (default: the"
                    " runs' GPU's, e.g. sm_90); needed for a rehearsal from CPU runs.")
flags.DEFINE_bool("xla_sol_options", False, "Fit XLA:GPU's speed-of-light collective model to the sweeps' points"
                  " across nodes; print the XLA_FLAGS line and record it in RUN/xla_sol_options.json.")
flags.DEFINE_string("nccl_tuner_conf", None, "Write NCCL's example tuner plugin's CSV config from runs of one sweep"
                    " under several NCCL settings (microbench --nccl_env): the best setting per collective, size"
                    " band, node and rank count where it beats NCCL's own choice beyond noise and --tolerance.")
STORE_MODES = ("index", "baseline", "history", "fleet", "judge")
SIDES = "vs"  # separates the sides of a comparison among the run folders


def _sizes(texts: list[str]) -> list[int]:
  out = []
  for text in texts:
    try:
      size = -1 if text.strip().startswith("-") else sizes.parse_size(text)
    except ValueError as e:
      raise app.UsageError(f"--predict: {e}") from None
    if size <= 0:  # a time for no bytes (or fewer) is not a prediction of anything measured
      raise app.UsageError(f"--predict: {text.strip()} is not a positive size; give bytes above 0 (8, 64K, 1G)")
    out.append(size)
  return out


def _fit_from(fab, run_dir: str):
  """The fabric with the levels `run_dir`'s sweep measured fitted (UsageError when it holds no sweep)."""
  from microbench.fabric import description as fd  # pylint: disable=g-import-not-at-top
  from microbench.report import fabric_fit  # pylint: disable=g-import-not-at-top
  try:
    return fabric_fit.fit_from_run(fab, run_dir)
  except fd.FabricError as e:
    raise app.UsageError(str(e)) from None


def _fabric_predictions(paths: list[str], predict: list[int]) -> int:
  """`--fabric`: predictions from the fabric's description alone (no run folder is read)."""
  from microbench.fabric import collective_model as fc  # pylint: disable=g-import-not-at-top
  from microbench.fabric import description as fd  # pylint: disable=g-import-not-at-top
  from microbench.report import fabric_tables, tables  # pylint: disable=g-import-not-at-top
  if paths:
    raise app.UsageError("--fabric predicts from the fabric's description; give no run folders with it")
  if not predict or not (FLAGS.gpus or FLAGS.shapes):
    raise app.UsageError("--fabric needs --predict=SIZES and --gpus=N,... or --shapes=4x2,...: e.g."
                         " microbench-report --fabric=leonardo --gpus=8,64 --predict=1M,1G")
  try:
    fab = fd.parse(FLAGS.fabric)
    notes: list[str] = []
    for run_dir in FLAGS.fit_from:
      fab, more = _fit_from(fab, run_dir)
      notes += more
    shapes = [fc.Shape.parse(s) for s in FLAGS.shapes]
    for g in FLAGS.gpus:
      if not g.strip().isdigit() or int(g) < 1:
        raise fd.FabricError(f"--gpus: {g.strip()!r} is not a positive number of GPUs")
      shapes.append(fc.dense_shape(fab, int(g)))
    rows = fabric_tables.prediction_rows(fab, FLAGS.fabric_collectives, shapes, predict, FLAGS.algorithm)
    assumed = fabric_tables.assumptions(fab, FLAGS.fabric_collectives, shapes, predict[0], FLAGS.algorithm)
  except fd.FabricError as e:
    raise app.UsageError(str(e)) from None
  print("\n".join(f"# {line}" for line in fab.describe() + notes))
  print(tables.markdown(fabric_tables.HEADERS, rows))
  print("\n".join(f"# assumed: {a}" for a in assumed if f"assumed: {a}" not in fab.describe()))
  return 0


def _store_mode() -> str | None:
  """The store mode the flags ask for (one at a time), or None."""
  asked = [m for m, on in (("index", FLAGS.index), ("baseline", FLAGS.baseline), ("history", FLAGS.history),
                           ("judge", FLAGS.against or FLAGS.rules)) if on]
  if len(asked) > 1:
    raise app.UsageError(f"--{' and --'.join(asked)}: one store mode at a time")
  if asked:
    return asked[0]
  return "fleet" if FLAGS.fleet or FLAGS.prometheus else None


def main(argv: list[str]) -> int:
  paths = argv[1:]
  mode = _store_mode()
  tuning = [m for m, on in (("xla_tuning", FLAGS.xla_perf_table or FLAGS.xla_sol_options),
                            ("nccl_tuner", FLAGS.nccl_tuner_conf)) if on]
  if tuning and (mode or len(tuning) > 1):
    raise app.UsageError("--xla_perf_table/--xla_sol_options, --nccl_tuner_conf and the store modes: one at a time")
  mode = mode or (tuning[0] if tuning else None)
  if mode:
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(f"microbench.cli.report_modes.{mode}").main(paths)
  if FLAGS.fabric:
    return _fabric_predictions(paths, _sizes(FLAGS.predict))
  if FLAGS.ranks:
    return _ranks(paths)
  if not paths:
    raise app.UsageError("give one or more run folders: microbench-report RUN_DIR [RUN_DIR ...] [--out=DIR]"
                         f" (repeated runs per side: A1 A2 {SIDES} B1 B2)")
  predict = _sizes(FLAGS.predict)
  try:
    import matplotlib  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise app.UsageError("the report draws with matplotlib, which is not installed:"
                         " pip install -e '.[report]'") from None
  from microbench.report import build, runs  # pylint: disable=g-import-not-at-top

  # `A1 A2 vs B1 B2`: repeated runs of one sweep per side, compared as one (their spread is the noise).
  groups = [[]]
  for p in paths:
    if p == SIDES:
      groups.append([])
    else:
      groups[-1].append(p)
  if len(groups) > 1 and not all(groups):
    raise app.UsageError(f"'{SIDES}' needs run folders on both sides: microbench-report A1 A2 {SIDES} B1 B2")
  try:
    sides = [runs.expand(g) for g in groups] if len(groups) > 1 else None
    found = runs.expand([p for p in paths if p != SIDES])
  except runs.RunError as e:
    raise app.UsageError(str(e)) from None
  out = FLAGS.out or (os.path.join(found[0], "report") if len(found) == 1 else
                      "report_" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S"))
  theirs = _read_nccl_tests() if FLAGS.nccl_tests else []  # before the report: an unreadable log fails first
  try:
    report = build.build(found, out, predict, sides=sides)
  except runs.RunError as e:
    raise app.UsageError(str(e)) from None
  except OSError as e:
    raise app.UsageError(f"{e.filename or out}: {e.strerror or e}") from None
  print(f"microbench-report: {len(report.sweeps)} sweep(s), {len(report.trains)} training run(s);"
        f" wrote {build.REPORT} and {len(report.figures)} figure(s) to {os.path.abspath(out)}")
  if predict:
    from microbench.report import tables  # pylint: disable=g-import-not-at-top
    print(tables.markdown(build.PREDICT_HEADERS, report.predictions))
  if FLAGS.nccl_tests:
    _beside_nccl_tests([r for sweep in report.sweeps for r in sweep.records], theirs, out)
  _beside_nccl_log(report.sweeps, out)
  return 0


def _ranks(paths: list[str]) -> int:
  """`--ranks RUN_DIR`: per-process and per-node figures of one sweep."""
  if len(paths) != 1 or paths[0] == SIDES:
    raise app.UsageError(f"--ranks takes one sweep's run folder, got {len(paths)}: microbench-report --ranks RUN_DIR")
  try:
    import matplotlib  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise app.UsageError("--ranks draws with matplotlib, which is not installed: pip install -e '.[report]'") from None
  from microbench.report import ranks  # pylint: disable=g-import-not-at-top
  out = FLAGS.out or os.path.join(paths[0], "report")
  try:
    text, fig = ranks.report(paths[0], out)
  except ranks.RanksError as e:
    raise app.UsageError(str(e)) from None
  except OSError as e:
    raise app.UsageError(f"{e.filename or out}: {e.strerror or e}") from None
  print(text)
  if fig:
    print(f"microbench-report: wrote {ranks.MARKDOWN} and {ranks.FIGURE} to {os.path.abspath(out)}")
  return 0


def _beside_nccl_log(sweeps: list, out: str) -> None:
  """OUT/nccl.md: each point beside the algorithm/protocol NCCL chose for it, for runs that recorded NCCL's log
  (meta.json's `nccl`, from --nccl_debug); nothing for runs without one."""
  from microbench.report import nccl_log  # pylint: disable=g-import-not-at-top
  text = nccl_log.write_beside(sweeps, out)
  if text:
    print(text)


def _read_nccl_tests() -> list:
  """Every --nccl_tests log's records; a row (or JSON result) that cannot be read is one line on stderr and the
  rest of the log is used; a log that cannot be opened or holds nothing is one line, exit 2."""
  from microbench.report import nccl_tests  # pylint: disable=g-import-not-at-top
  theirs = []
  for spec in FLAGS.nccl_tests:
    name, eq, path = spec.partition("=")
    try:
      got, errors = nccl_tests.read_file(path if eq else name, name if eq else None)
    except nccl_tests.NcclTestsError as e:
      raise app.UsageError(str(e)) from None
    for line in errors:
      print(f"microbench-report: {line}", file=sys.stderr)
    theirs += got
    _record_nccl_tests(path if eq else name, got, errors)
  return theirs


def _record_nccl_tests(path: str, records: list, notes: list[str]) -> None:
  """An imported nccl-tests output is a run of its own in the results store."""
  if not records:
    return
  from microbench.store import folders, index  # pylint: disable=g-import-not-at-top
  index.record(FLAGS.store, path, say=lambda line: print(f"microbench-report: {line.lstrip('# ')}"),
               entry=folders.nccl_tests_entry(path, records, notes))


def _beside_nccl_tests(records: list, theirs: list, out: str) -> None:
  """The sweep's points beside nccl-tests' rows of the same collective, dtype and size: the table, the figure
  and the TensorBoard run."""
  from microbench.report import nccl_tests, nccl_tests_views, plots, tables  # pylint: disable=g-import-not-at-top
  points = nccl_tests.matches(records, theirs)
  rows = nccl_tests.compare_rows(points)
  text = tables.markdown(nccl_tests.COMPARE_HEADERS, rows) if rows else (
      "no point of the run matches a nccl-tests row (same collective, dtype, size and group size)")
  with open(os.path.join(out, "nccl_tests.md"), "w", encoding="utf-8") as f:
    f.write("# JAX beside nccl-tests\n\n" + text + "\n")
  print(text)
  if points:
    fig = nccl_tests_views.figure(points)
    plots.save(fig, os.path.join(out, nccl_tests_views.FIGURE))
    folder = nccl_tests_views.write_tensorboard(out, points, text, fig)
    print(f"microbench-report: wrote {nccl_tests_views.FIGURE} and the TensorBoard run {folder}")


def run() -> None:
  """Console-script entry point."""
  absl_app.run(main, "microbench-report", [__name__, store_flags.__name__])


if __name__ == "__main__":
  run()
