"""What TensorBoard shows, read back through TensorBoard's own loaders and plugins (event multiplexer, data
provider, the custom-scalars, hparams and images plugins): sweep steps on a log2 axis, the custom-scalars
layout, training runs as HParams sessions with summary metrics at one step, and report figures as images."""

from __future__ import annotations

import json
import os

import pytest
from tensorboard import context as tb_request
from tensorboard.backend.event_processing import data_provider as tb_data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from tensorboard.plugins.custom_scalar import custom_scalars_plugin
from tensorboard.plugins.hparams import hparams_plugin
from tensorboard.plugins.scalar import scalars_plugin
from werkzeug import test as wtest
from werkzeug import wrappers

from support import run_cli
from microbench.output import run_folder
from microbench.fabric import link_peaks
from microbench.output.train_log import (HPARAM_METRIC_DESCRIPTIONS, HPARAM_METRICS, HPARAM_NAME_MAX, HPARAMS,
                                         HPARAMS_LEAD, SUMMARY_STEP, TrainLog, markdown_table)
from test_report import synthetic_records

COLLECTIVES = ("all_reduce", "all_gather")
SCOPES = ("scale_up", "scale_out")


def tensorboard(logdir: str):
  """TensorBoard's data path as `tensorboard --logdir` builds it: multiplexer -> data provider -> plugins."""
  mux = plugin_event_multiplexer.EventMultiplexer()
  mux.AddRunsFromDirectory(logdir)
  mux.Reload()
  provider = tb_data_provider.MultiplexerDataProvider(mux, logdir)
  plugins: dict = {}
  ctx = base_plugin.TBContext(logdir=logdir, multiplexer=mux, data_provider=provider,
                              plugin_name_to_instance=plugins)
  plugins["scalars"] = scalars_plugin.ScalarsPlugin(ctx)  # custom scalars reads through it
  return ctx, provider


def write_sweep(path: str, records: list[dict]) -> None:
  out = run_folder.RunOutputs(path, stream=open(os.devnull, "w"))
  out.layout(COLLECTIVES, SCOPES)
  for r in records:
    out.record(r)
  out.close()


def write_train(path: str, parallelism: str, tokens_per_device: float, mfu: float | None, steps: int,
                model: str = "gpt2", item: str = "tokens") -> None:
  log = TrainLog(path)
  config = {"kind": "config", "model": model, "size": "tiny", "layers": 2, "parallelism": parallelism,
            "placement": "tp_inner", "mesh": "data=8", "batch": 8, "seq_len": 64, "dtype": "float32",
            "devices": 8, "processes": 1, "topology": "racks:1,nodes:2,gpus:4", "device_kind": "cpu"}
  log.line(config)
  log.hparams(config)
  for i in range(steps):
    log.scalars({"train/loss": 5.0 - 0.1 * i, "train/step_time_s": 0.01}, i)
  log.summary({"kind": "summary", "model": model, "item": item, f"{item}_per_s_per_device": tokens_per_device,
               f"{item}_per_s": 8 * tokens_per_device, "mfu": mfu, "median_step_time_s": 0.01,
               "tflops_per_device": 0.5, "memory_per_device_bytes": 2**20, "compile_time_s": 1.5,
               "final_loss": 4.0, "flops_formula": "text", "comm": {"all-reduce": {"count": 1, "bytes": 4096}}})
  log.close()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
  root = tmp_path_factory.mktemp("runs")
  sizes = [1024, 2048, 4096, 3 * 2**20]
  records = synthetic_records(20.0, 40.0, sizes=sizes)
  for r in records:  # a sample spread as real sweeps record it
    r.update(time_us_min=0.8 * r["time_us"], time_us_max=1.2 * r["time_us"])
  write_sweep(str(root / "sweep_a"), records)
  write_sweep(str(root / "sweep_b"), synthetic_records(10.0, 80.0, sizes=sizes))
  write_train(str(root / "train" / "dp8"), "dp:8", 1000.0, 0.25, steps=10)
  write_train(str(root / "train" / "fsdp4_tp2"), "fsdp:4,tp:2", 1250.0, 0.3, steps=4)
  write_train(str(root / "train" / "vit_dp4"), "dp:4", 90.0, None, steps=3, model="vit", item="images")
  return str(root)


def test_sweep_scalars_step_on_ten_log2_bytes(logdir):
  _, provider = tensorboard(logdir)
  data = provider.read_scalars(tb_request.RequestContext(), experiment_id="", plugin_name="scalars",
                               downsample=1000)
  points = data["sweep_a"]["busbw_gbps/all_reduce/scale_up/float32"]
  assert [p.step for p in points] == [100, 110, 120, 216]  # 1K, 2K, 4K, 3M: 10 x log2(bytes), rounded
  recs = [r for r in run_folder.read_results(os.path.join(logdir, "sweep_a"))
          if (r["collective"], r["scope"]) == ("all_reduce", "scale_up")]
  assert [p.value for p in points] == pytest.approx([r["busbw_gbps"] for r in recs])
  assert [r["bytes"] for r in recs] == [1024, 2048, 4096, 3 * 2**20]  # exact sizes stay in the records
  assert {f"time_us/{c}/{s}/float32" for c in COLLECTIVES for s in SCOPES} <= set(data["sweep_b"])


def test_sweep_tags_describe_the_step_and_series_figures_are_scalars(logdir):
  _, provider = tensorboard(logdir)
  ctx = tb_request.RequestContext()
  listed = provider.list_scalars(ctx, experiment_id="", plugin_name="scalars")["sweep_a"]
  base = "all_reduce/scale_up/float32"
  for tag in ("busbw_gbps", "time_us", "wrong", "time_us_spread"):
    assert "200 = 1 MiB" in listed[f"{tag}/{base}"].description, tag  # the x axis explained beside each chart
  data = provider.read_scalars(ctx, experiment_id="", plugin_name="scalars", downsample=1000)["sweep_a"]
  assert [(p.step, p.value) for p in data[f"wrong/{base}"]] == [(100, 0.0), (110, 0.0), (120, 0.0), (216, 0.0)]
  assert [p.value for p in data[f"time_us_spread/{base}"]] == pytest.approx([1.5] * 4)  # 1.2 / 0.8
  assert f"time_us_spread/{base}" not in provider.list_scalars(ctx, experiment_id="", plugin_name="scalars")["sweep_b"]
  # No series of one point per run (the size-averaged busbw): it drew a lone dot, and two runs' dots fell outside
  # the range "Ignore outliers" keeps (a blank chart). The averages are the `summary` text instead.
  assert all(len(data[tag]) > 1 for tag in data), [tag for tag in data if len(data[tag]) == 1]


def test_sweep_summary_text_holds_each_series_average_busbw(logdir):
  """nccl-tests' "Avg bus bandwidth" per series as one table in the Text tab, rendered by TensorBoard's own
  Markdown; without the fabric model's fields the table has no expected columns."""
  from tensorboard.plugin_util import markdown_to_safe_html  # pylint: disable=g-import-not-at-top
  _, provider = tensorboard(logdir)
  text = provider.read_tensors(tb_request.RequestContext(), experiment_id="", plugin_name="text",
                               downsample=10)["sweep_a"]["summary"][0].numpy.item().decode()
  html = markdown_to_safe_html(text)
  rows = [[c.split(">")[-1] for c in row.split("</td>")[:-1]] for row in html.split("<tr>")[2:]]
  head = [c.split(">")[-1] for c in html.split("<tr>")[1].split("</th>")[:-1]]
  assert "avg busbw (GB/s)" in head and "avg expected (GB/s)" not in head
  recs = run_folder.read_results(os.path.join(logdir, "sweep_a"))
  for coll in COLLECTIVES:
    for scope in SCOPES:
      bw = [r["busbw_gbps"] for r in recs if (r["collective"], r["scope"]) == (coll, scope)]
      (row,) = [r for r in rows if r[:2] == [coll, scope]]
      assert float(row[head.index("avg busbw (GB/s)")]) == pytest.approx(sum(bw) / len(bw), rel=1e-3)
      assert row[head.index("sizes")] == "1 KiB - 3 MiB (4)" and row[head.index("max spread")] == "1.5"


def test_a_step_factor_that_would_put_two_sizes_on_one_step_is_refused():
  assert run_folder.size_step(2**20) != run_folder.size_step(round(2**20 * run_folder.MIN_STEP_FACTOR))
  assert run_folder.size_step(2**20) == run_folder.size_step(round(2**20 * 1.02))  # what the check prevents
  r = run_cli(["--step_factor=1.02", "--min_bytes=1K", "--max_bytes=1M"], timeout=60)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and lines == ["microbench: error: --step_factor=1.02 puts neighbouring sizes on one"
                                         " TensorBoard step (step = round(10 x log2(bytes))): use >= 1.0718"], r.stderr


def test_sweep_text_says_what_the_step_is(logdir):
  _, provider = tensorboard(logdir)
  tags = provider.list_tensors(tb_request.RequestContext(), experiment_id="", plugin_name="text")
  assert "x_axis" in tags["sweep_a"]
  text = provider.read_tensors(tb_request.RequestContext(), experiment_id="", plugin_name="text",
                               downsample=10)["sweep_a"]["x_axis"][0].numpy.item().decode()
  assert "10 x log2(bytes)" in text and "200 = 1 MiB" in text and "smoothing to 0" in text
  # Rendered as TensorBoard's Text tab renders it: a step -> size grid, row = hundreds, column = the rest.
  from tensorboard.plugin_util import markdown_to_safe_html
  html = markdown_to_safe_html(text)
  assert html.count("<table>") == 1 and html.count("<tr>") == 5  # header + steps 0, 100, 200, 300
  rows = [r.split("</td>")[:-1] for r in html.split("<tr>")[2:]]
  grid = {int(html_row[0].split("<strong>")[1].split("</strong>")[0]) + 10 * j: c.split(">")[-1]
          for html_row in rows for j, c in enumerate(html_row[1:])}
  assert grid[100] == "1 KiB" and grid[200] == "1 MiB" and grid[230] == "8 MiB" and grid[300] == "1 GiB"
  assert grid[0] == "1 B" and grid[390] == "512 GiB" and len(grid) == 40
  for step, size in grid.items():  # every cell agrees with the step the sweep writes
    n, unit = size.split()
    assert run_folder.size_step(int(n) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]) == step


def test_custom_scalars_chart_each_collective_and_scope(logdir):
  """A chart per collective and scope, so each of its lines is one run (named by the run selector): Custom
  Scalars colours runs and draws a run's several tags in one chart with different markers that nothing names."""
  ctx, provider = tensorboard(logdir)
  assert "custom_scalars" in provider.list_plugins(tb_request.RequestContext(), experiment_id="")  # the tab shows
  plugin = custom_scalars_plugin.CustomScalarsPlugin(ctx)
  layout = json.loads(plugin.layout_impl(tb_request.RequestContext(), ""))
  cats = {c["title"]: c["chart"] for c in layout["category"]}
  # busbw and time; no run has a link peak or an expectation: no "% of peak" or "measured / expected" charts.
  assert list(cats) == [f"{name}: {run_folder._CHARTS_NOTE}"  # pylint: disable=protected-access
                        for name in ("busbw (GB/s)", "time (us)")]
  charts = cats["busbw (GB/s): " + run_folder._CHARTS_NOTE]  # pylint: disable=protected-access
  assert [c["title"] for c in charts] == [f"{c} over {s}: busbw (GB/s)" for c in COLLECTIVES for s in SCOPES]
  for run in ("sweep_a", "sweep_b"):
    for chart, (c, s) in zip(charts, [(c, s) for c in COLLECTIVES for s in SCOPES]):
      lines = plugin.scalars_impl(tb_request.RequestContext(), run, chart["multiline"]["tag"][0], "")
      assert lines["regex_valid"] and list(lines[custom_scalars_plugin._TAG_TO_EVENTS_PROPERTY]) == [  # pylint: disable=protected-access
          f"busbw_gbps/{c}/{s}/float32"]


def _layout_charts(logdir: str) -> dict[str, list[str]]:
  """Category title -> chart titles, as the Custom Scalars tab gets them (every run's last layout, merged)."""
  ctx, _ = tensorboard(logdir)
  layout = json.loads(custom_scalars_plugin.CustomScalarsPlugin(ctx).layout_impl(tb_request.RequestContext(), ""))
  return {c["title"]: [ch["title"] for ch in c["chart"]] for c in layout.get("category", [])}


def _category(name: str) -> str:
  return f"{name}: {run_folder._CHARTS_NOTE}"  # pylint: disable=protected-access


def test_a_sweep_of_two_dtypes_gets_a_chart_per_dtype(tmp_path):
  """Two dtypes of one series would be two markers of one colour in a chart: a chart per dtype instead,
  although the layout is written before the second dtype is measured."""
  recs = synthetic_records(20.0, 40.0, collectives=("all_reduce",), sizes=[1024, 4096])
  write_sweep(str(tmp_path / "s"), recs + [dict(r, dtype="bfloat16") for r in recs])
  charts = _layout_charts(str(tmp_path))[_category("busbw (GB/s)")]  # all_gather's planned charts too
  assert [t for t in charts if t.startswith("all_reduce")] == [
      f"all_reduce over {s} {d}: busbw (GB/s)" for s in SCOPES for d in ("float32", "bfloat16")]
  assert len(charts) == len(COLLECTIVES) * len(SCOPES) * 2


def test_custom_scalars_show_peak_charts_only_where_a_peak_is_known(logdir, tmp_path):
  """Sweeps without a link peak (every CPU run) get no "busbw % of peak" charts (they were empty charts in
  the default view); a sweep with peaks for some scopes gets those charts for the collectives and scopes that
  have one, although its layout is written before any point is measured."""
  pct = _category("busbw % of peak")
  cats = _layout_charts(logdir)
  assert not any("% of peak" in t for t in cats) and len(cats) == 2, list(cats)
  recs = synthetic_records(20.0, 40.0, sizes=[1024, 4096])
  for r in recs:
    if r["scope"] == "scale_up":  # a known NVLink-like peak for scale_up only, none for scale_out
      r.update(link_peaks.share(r["busbw_gbps"], 100.0))
  write_sweep(str(tmp_path / "gpu"), recs)
  cats = _layout_charts(str(tmp_path))
  assert cats[pct] == ["all_reduce over scale_up: busbw % of peak", "all_gather over scale_up: busbw % of peak"]
  assert len(cats[_category("busbw (GB/s)")]) == 4
  # A resumed run knows its earlier points' peaks before measuring anything.
  out = run_folder.RunOutputs(str(tmp_path / "gpu"), stream=open(os.devnull, "w"))
  out.layout(COLLECTIVES, SCOPES)
  out.close()
  assert _layout_charts(str(tmp_path))[pct] == cats[pct]
  # Next to a CPU run the merged view keeps the GPU run's charts and adds no empty ones.
  write_sweep(str(tmp_path / "cpu"), synthetic_records(10.0, 80.0, sizes=[1024, 4096]))
  assert _layout_charts(str(tmp_path))[pct] == cats[pct]


def with_expected(records: list[dict], factor: dict[str, float]) -> list[dict]:
  """The fabric model's fields as the sweep writes them (collective -> expected over measured busbw; a
  collective not in `factor` gets none, as where no fabric description applies)."""
  for r in records:
    if r["collective"] in factor:
      exp = r["busbw_gbps"] * factor[r["collective"]]
      r.update(expected_busbw_gbps=exp, vs_expected=r["busbw_gbps"] / exp, low=r["busbw_gbps"] / exp < 0.5)
  return records


def test_expected_busbw_is_a_run_beside_the_measured_one(tmp_path):
  """Where a record carries the fabric model's expectation, `RUN/expected` holds it under the measured tags
  (busbw, and the time it implies), so every chart of the series shows expected beside measured; the ratio is
  `vs_expected/...` with its charts; series without the fields get none, and a sweep without any no extra run."""
  sizes = [1024, 4096, 2**20]
  recs = with_expected(synthetic_records(20.0, 40.0, sizes=sizes), {"all_reduce": 1.25})
  write_sweep(str(tmp_path / "fab"), recs)
  write_sweep(str(tmp_path / "cpu"), synthetic_records(20.0, 40.0, sizes=sizes))
  assert not os.path.exists(tmp_path / "cpu" / run_folder.EXPECTED_RUN)
  ctx, provider = tensorboard(str(tmp_path))
  assert {r.run_name for r in provider.list_runs(tb_request.RequestContext(), experiment_id="")} == {
      "fab", "fab/expected", "cpu"}
  data = provider.read_scalars(tb_request.RequestContext(), experiment_id="", plugin_name="scalars", downsample=100)
  assert set(data["fab/expected"]) == {f"{t}/all_reduce/{s}/float32"
                                       for t in ("busbw_gbps", "time_us") for s in SCOPES}
  for scope in SCOPES:
    base = f"all_reduce/{scope}/float32"
    mine = [r for r in recs if (r["collective"], r["scope"]) == ("all_reduce", scope)]
    assert [(p.step, p.value) for p in data["fab/expected"][f"busbw_gbps/{base}"]] == [
        (run_folder.size_step(r["bytes"]), pytest.approx(r["expected_busbw_gbps"], rel=1e-6)) for r in mine]
    assert [p.value for p in data["fab/expected"][f"time_us/{base}"]] == pytest.approx(
        [r["time_us"] / 1.25 for r in mine], rel=1e-6)  # 1.25 x the busbw: 1/1.25 of the time
    assert [p.value for p in data["fab"][f"vs_expected/{base}"]] == pytest.approx([0.8] * 3, rel=1e-6)
  assert "vs_expected/all_gather/scale_up/float32" not in data["fab"]
  cats = _layout_charts(str(tmp_path))
  assert cats[_category("measured / expected busbw")] == [
      f"all_reduce over {s}: measured / expected busbw" for s in SCOPES]
  plugin = custom_scalars_plugin.CustomScalarsPlugin(ctx)
  layout = json.loads(plugin.layout_impl(tb_request.RequestContext(), ""))
  chart = next(ch for c in layout["category"] for ch in c["chart"]
               if ch["title"] == "all_reduce over scale_up: busbw (GB/s)")
  for run in ("fab", "fab/expected"):  # the chart holds the measured run's line and the expected run's
    lines = plugin.scalars_impl(tb_request.RequestContext(), run, chart["multiline"]["tag"][0], "")
    assert list(lines[custom_scalars_plugin._TAG_TO_EVENTS_PROPERTY]) == [  # pylint: disable=protected-access
        "busbw_gbps/all_reduce/scale_up/float32"]
  text = provider.read_tensors(tb_request.RequestContext(), experiment_id="", plugin_name="text",
                               downsample=10)["fab"]["summary"][0].numpy.item().decode()
  assert "| avg expected (GB/s) | measured / expected | LOW |" in text and "| 0.8 - 0.8 | 0 |" in text


def test_config_text_puts_the_flags_set_away_from_their_defaults_first():
  """Rendered by TensorBoard's Markdown: a table of the changed flags with their defaults first, every other
  flag after it in one paragraph, none listed twice; a flag without a default (the output folder) is in the
  rest. That it fits TensorBoard's text box as opened: test_sweep_views_as_opened_in_a_browser."""
  from tensorboard.plugin_util import markdown_to_safe_html  # pylint: disable=g-import-not-at-top
  flags = {f"flag_{i:02d}": i for i in range(22)} | {"dtype": ["bfloat16", "float32"], "check": True,
                                                      "outdir": "runs/x", "fabric": None}
  defaults = {k: v for k, v in flags.items() if k != "outdir"} | {"dtype": ["float32"], "check": False}
  html = markdown_to_safe_html(run_folder.config_text(flags, defaults))
  table, rest = html.split("</table>")
  assert table.count("<tr>") == 1 + 2 and table.index("set away from the default") < table.index("<tbody>")
  assert "<td><code>check</code></td>\n<td><strong>yes</strong></td>\n<td>no</td>" in table
  assert "<td><code>dtype</code></td>\n<td><strong>bfloat16, float32</strong></td>\n<td>float32</td>" in table
  assert "<code>outdir</code> = runs/x" in rest and "<code>fabric</code> = n/a" in rest and "<table>" not in rest
  assert all(html.count(f"<code>{k}</code>") == 1 for k in flags)
  same = markdown_to_safe_html(run_folder.config_text(flags, flags))
  assert same.startswith("<p><strong>Every flag at its default.</strong></p>") and "<table>" not in same


def _hparams_post(ctx, route: str, body: dict) -> dict:
  """POST to the hparams plugin's route as TensorBoard's frontend does."""
  app = hparams_plugin.HParamsPlugin(ctx).get_plugin_apps()[route]
  resp = wtest.Client(app, wrappers.Response).post("/", data=json.dumps(body), content_type="application/json")
  assert resp.status_code == 200, resp.get_data(as_text=True)
  return json.loads(resp.get_data(as_text=True))


def test_training_runs_are_hparams_sessions_with_summary_metrics(logdir):
  ctx, provider = tensorboard(logdir)
  exp = _hparams_post(ctx, "/experiment", {"experimentName": ""})
  names = [h["name"] for h in exp["hparamInfos"]]
  assert set(names) == set(HPARAMS)
  assert names[:5] == sorted(HPARAMS_LEAD)  # the strategy columns first: TensorBoard shows the first few
  assert {m["name"]["tag"] for m in exp["metricInfos"]} == set(HPARAM_METRICS)
  # Short column names (long ones overlapped in parallel coordinates at 1600 px); the meaning is the description.
  for m in exp["metricInfos"]:
    assert len(m["displayName"]) <= HPARAM_NAME_MAX, m["displayName"]
    assert m["description"] == HPARAM_METRIC_DESCRIPTIONS[m["name"]["tag"]]
  assert "tokens/s" in HPARAM_METRIC_DESCRIPTIONS["summary/items_per_s_per_device"]
  cols = [{"hparam": h, "includeInResult": True} for h in HPARAMS] + [
      {"metric": {"tag": t, "group": ""}, "includeInResult": True} for t in HPARAM_METRICS]
  groups = _hparams_post(ctx, "/session_groups", {"experimentName": "", "startIndex": 0, "sliceSize": 100,
                                                  "allowedStatuses": ["STATUS_SUCCESS", "STATUS_UNKNOWN"],
                                                  "colParams": cols})
  sessions = {g["hparams"]["parallelism"]: g for g in groups["sessionGroups"]}
  assert set(sessions) == {"dp:8", "fsdp:4,tp:2", "dp:4"}  # sweeps are not sessions
  fsdp = sessions["fsdp:4,tp:2"]
  assert fsdp["hparams"]["devices"] == 8 and fsdp["hparams"]["model"] == "gpt2"
  metrics = {m["name"]["tag"]: m["value"] for m in fsdp["metricValues"]}
  assert metrics["summary/items_per_s_per_device"] == 1250.0 and metrics["summary/items_per_s"] == 10000.0
  assert fsdp["sessions"][0]["status"] == "STATUS_SUCCESS"
  vit = {m["name"]["tag"]: m["value"] for m in sessions["dp:4"]["metricValues"]}
  assert vit["summary/items_per_s_per_device"] == 90.0  # images/s in the same column as tokens/s
  # Every run, language or image model, with or without a known peak, has every default metric column:
  # TensorBoard's parallel coordinates drop a session missing any, so none is dropped.
  for group in groups["sessionGroups"]:
    assert {m["name"]["tag"] for m in group["metricValues"]} == set(HPARAM_METRICS), group["hparams"]
  # The figures not every run has are still scalars.
  data = provider.read_scalars(tb_request.RequestContext(), experiment_id="", plugin_name="scalars", downsample=100)
  assert data["train/fsdp4_tp2"]["summary/mfu"][0].value == pytest.approx(0.3)
  assert data["train/fsdp4_tp2"]["summary/comm_bytes/all-reduce"][0].value == 4096.0
  assert "summary/mfu" not in data["train/vit_dp4"]
  # Summary scalars sit at one step in every run, whatever its length.
  data = provider.read_scalars(tb_request.RequestContext(), experiment_id="", plugin_name="scalars", downsample=100)
  for run in ("train/dp8", "train/fsdp4_tp2"):
    assert [p.step for p in data[run]["summary/mfu"]] == [SUMMARY_STEP]
  assert [p.step for p in data["train/dp8"]["train/loss"]] == list(range(10))


def test_report_figures_are_images_in_the_events(logdir, tmp_path):
  from microbench.report import build
  sweep = os.path.join(logdir, "sweep_a")
  assert build.sweep_images(sweep, run_folder.read_results(sweep)) == 2
  out = tmp_path / "report"
  build.build([sweep, os.path.join(logdir, "sweep_b")], str(out))
  _, provider = tensorboard(str(tmp_path))
  blobs = provider.list_blob_sequences(tb_request.RequestContext(), experiment_id="", plugin_name="images")
  assert {"report/compare_all_reduce", "report/ratio_sweep_b_vs_sweep_a"} <= set(blobs["report"])
  _, provider = tensorboard(logdir)
  blobs = provider.list_blob_sequences(tb_request.RequestContext(), experiment_id="", plugin_name="images")
  assert set(blobs["sweep_a"]) == {"figures/all_reduce", "figures/all_gather"}
  (seq,) = provider.read_blob_sequences(tb_request.RequestContext(), experiment_id="", plugin_name="images",
                                        downsample=1, run_tag_filter=None)["sweep_a"]["figures/all_reduce"]
  png = provider.read_blob(tb_request.RequestContext(), blob_key=seq.values[2].blob_key)
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  # Shown at its pixel size, the figure's smallest text (7 pt) is at least 10 px tall.
  import struct
  fig = build.single_sweep_figures(build.runs.SweepRun(sweep, "sweep_a", {}, run_folder.read_results(sweep)))
  width = struct.unpack(">I", png[16:20])[0]
  assert width / fig["all_reduce.png"].get_figwidth() * 7 / 72 >= 10


def test_training_summary_text_renders_as_a_readable_table():
  """Rendered by TensorBoard's own Markdown: no None, no 15-digit floats, formulas and names as written."""
  from tensorboard.plugin_util import markdown_to_safe_html
  html = markdown_to_safe_html(markdown_table({
      "mfu": None, "median_step_time_s": 0.012345678901234, "flops_formula": "6 * N * T + 12 * L * s_len * d",
      "scan_layers": True, "mesh": "data=2 tensor=2", "rule": "a|b",
      "comm": {"all-reduce": {"count": 1, "bytes": 4096, "share": 0.333333333333}}}))
  assert html.startswith("<table>") and html.count("<tr>") == 8
  assert "None" not in html and "<td>n/a</td>" in html and "<td>yes</td>" in html
  assert "<td>0.01235</td>" in html and "0.3333}" in html and "333333" not in html
  assert "<code>6 * N * T + 12 * L * s_len * d</code>" in html and "<em>" not in html
  assert "<code>median_step_time_s</code>" in html and "<code>a|b</code>" in html


def test_a_report_under_a_run_folder_adds_no_run(logdir, tmp_path):
  """`microbench-report RUN` writes into RUN/report by default: its images join RUN's events, not a new run."""
  import shutil
  from microbench.report import build
  root = tmp_path / "runs"
  shutil.copytree(os.path.join(logdir, "sweep_a"), root / "sweep_a")
  if not build.sweep_images(str(root / "sweep_a"), run_folder.read_results(str(root / "sweep_a"))):
    raise AssertionError("the sweep's own figures were not written")  # not left to another test's order
  _, provider = tensorboard(str(root))
  before = {r.run_name for r in provider.list_runs(tb_request.RequestContext(), experiment_id="")}
  build.build([str(root / "sweep_a")], str(root / "sweep_a" / "report"))
  assert (root / "sweep_a" / "report" / build.REPORT).exists()
  _, provider = tensorboard(str(root))
  assert {r.run_name for r in provider.list_runs(tb_request.RequestContext(), experiment_id="")} == before == {"sweep_a"}
  blobs = provider.list_blob_sequences(tb_request.RequestContext(), experiment_id="", plugin_name="images")
  assert any(t.startswith("report/") for t in blobs["sweep_a"]) and "figures/all_reduce" in blobs["sweep_a"]


@pytest.mark.slow
@pytest.mark.skipif(not (os.path.exists("/usr/bin/chromium") and os.path.exists("/usr/bin/chromedriver")),
                    reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)")
def test_hparams_parallel_coordinates_draw_every_run_in_a_browser(logdir):
  """In headless Chromium over a real TensorBoard: HParams' parallel-coordinates view draws a line for each
  of the three training runs (a vit run with images/s and no MFU among two language models), the view that
  once came up empty because one run lacked a shown metric. About 15 s."""
  with _shots_module().Browser(os.path.join(logdir, "train")) as browser:
    assert browser.parallel_coordinates_lines(3) == 3


def _shots_module():
  """scripts/tensorboard_screenshots.py, whose Browser drives headless Chromium over a real TensorBoard (loaded
  once: it defines absl flags)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  if "tensorboard_screenshots" in sys.modules:
    return sys.modules["tensorboard_screenshots"]
  spec = importlib.util.spec_from_file_location("tensorboard_screenshots", os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "tensorboard_screenshots.py"))
  shots = importlib.util.module_from_spec(spec)
  sys.modules["tensorboard_screenshots"] = shots
  spec.loader.exec_module(shots)
  return shots


def time_series_faults(view: dict, runs: list[str]) -> list[str]:
  """What Time Series as opened gets wrong: its first card not a busbw size sweep holding every run (the
  measured ones and their `/expected`), or a per-point check (`wrong`, a spread) among the cards drawn
  (TensorBoard draws the cards of the first two groups it opens)."""
  cards = [c for c in view["cards"] if c["tag"]]
  if not cards or not cards[0]["tag"].startswith("busbw_gbps/"):
    return [f"first card {cards[0]['tag'] if cards else None}, groups {view['groups']}"]
  faults = [f"{r} not in the first card" for r in runs if r not in cards[0]["text"].split()]
  return faults + [f"{c['tag']} drawn" for c in cards if c["tag"].startswith("wrong/") or "spread" in c["tag"]]


def blank_charts(charts: list[dict]) -> list[str]:
  """Charts with a series none of whose values lies in the y range shown ("Ignore outliers" dropped them all)."""
  return [f"{c['title']}: {s['name']}" for c in charts for s in c["series"]
          if s["values"] and not any(c["domain"][0] <= v <= c["domain"][1] for v in s["values"])]


def unnamed_lines(charts: list[dict]) -> list[str]:
  """Custom Scalars charts drawing several tags of one run: its lines share the run's colour and differ only by
  a marker nothing names. A series is named `TAG (RUN)`."""
  bad = []
  for c in charts:
    tags: dict[str, set] = {}
    for s in c["series"]:
      tag, run = s["name"].rsplit(" (", 1)
      tags.setdefault(run.rstrip(")"), set()).add(tag)
    bad += [f"{c['title']}: {run} draws {sorted(t)}" for run, t in tags.items() if len(t) > 1]
  return bad


def hidden_config(boxes: list[dict]) -> list[str]:
  """Runs whose `config` text box scrolls (TensorBoard's box is 500 px: taller text hides rows) or does not
  open on the settings that differ from the defaults."""
  return [f"{b['run']}: {b['scroll_height']} px in {b['client_height']} px, starts {b['text'][:40]!r}"
          for b in boxes if b["tag"] == "config"
          and (b["scroll_height"] > b["client_height"] + 2 or not b["text"].lower().startswith(CONFIG_OPENS))]


CONFIG_OPENS = ("set away from the default value default", "every flag at its default")


SWEEP_FLAGS = {f"flag_{i:02d}": i for i in range(40)} | {  # about as many as microbench has
    "collectives": list(COLLECTIVES), "scopes": list(SCOPES), "dtype": ["bfloat16"], "fabric": "dgx_h100"}
SWEEP_DEFAULTS = SWEEP_FLAGS | {"dtype": ["float32"], "fabric": "auto"}


def write_old_views(root: str) -> None:
  """Two sweeps as TensorBoard got them before: a one-point size-averaged busbw per series (sorting first),
  `time_spread` and `wrong` per size, a chart per collective holding both scopes, and the config as a one-column
  table, so each check above can be shown to catch what was wrong."""
  from microbench.output.tensorboard import TensorBoardLog  # pylint: disable=g-import-not-at-top
  for name, (alpha, beta) in {"old_a": (20.0, 40.0), "old_b": (10.0, 80.0)}.items():
    tb = TensorBoardLog(os.path.join(root, name))
    tb.text("config", markdown_table(SWEEP_FLAGS))
    tb.custom_scalars([("busbw per collective", [(f"{c}: busbw", [f"^busbw_gbps/{c}/"]) for c in COLLECTIVES])])
    recs = synthetic_records(alpha, beta, sizes=[2**k for k in range(10, 25, 2)])
    for r in recs:
      base, step = f"{r['collective']}/{r['scope']}/{r['dtype']}", run_folder.size_step(r["bytes"])
      for tag, v in (("busbw_gbps", r["busbw_gbps"]), ("time_spread", 1.5), ("wrong", 0.0)):
        tb.scalar(f"{tag}/{base}", v, step)
    for c in COLLECTIVES:
      for s in SCOPES:
        bw = [r["busbw_gbps"] for r in recs if (r["collective"], r["scope"]) == (c, s)]
        tb.scalar(f"busbw_avg_gbps/{c}/{s}/float32", sum(bw) / len(bw), 240)
    tb.close()


@pytest.mark.slow
@pytest.mark.skipif(not (os.path.exists("/usr/bin/chromium") and os.path.exists("/usr/bin/chromedriver")),
                    reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)")
def test_sweep_views_as_opened_in_a_browser(tmp_path):
  """In headless Chromium over a real TensorBoard, each view as a reader opens it: Time Series starts on the
  busbw size sweep with the expected line beside the measured one and draws no per-point check; no Scalars
  chart is blank; every Custom Scalars line is one run's one series; the config box shows the setting that
  differs without scrolling. The same checks on sweeps written the old way name each fault. About 25 s."""
  shots = _shots_module()
  sizes = [2**k for k in range(10, 25, 2)]
  fab = with_expected(synthetic_records(20.0, 40.0, sizes=sizes), {"all_reduce": 1.25, "all_gather": 1.1})
  for r in fab:
    r.update(time_us_min=0.8 * r["time_us"], time_us_max=1.2 * r["time_us"])
  for name, recs in (("fab", fab), ("cpu", synthetic_records(10.0, 80.0, sizes=sizes))):
    out = run_folder.RunOutputs(str(tmp_path / "new" / name), stream=open(os.devnull, "w"))
    out.config(SWEEP_FLAGS, SWEEP_DEFAULTS)
    out.layout(COLLECTIVES, SCOPES)
    for r in recs:
      out.record(r)
    out.close()
  write_old_views(str(tmp_path / "old"))
  seen = {}
  for name in ("new", "old"):
    with shots.Browser(str(tmp_path / name)) as browser:
      browser.open("timeseries")
      ts = browser.time_series(want_cards=1, want_runs=("fab", "fab/expected", "cpu") if name == "new" else ())
      runs = 3 if name == "new" else 2
      browser.open("scalars")
      scalars = browser.charts(want=4, want_series=runs)  # the busbw cards, every run's line loaded
      browser.open("custom_scalars")
      custom = browser.charts(want=2, want_series=runs)
      browser.open("text")
      text = browser.text_boxes(want=2)
    seen[name] = ts, scalars, custom, text
  ts, scalars, custom, text = seen["new"]
  assert time_series_faults(ts, ["fab", "fab/expected", "cpu"]) == [], ts
  titles = [c["title"] for c in scalars]
  assert "busbw_gbps/all_reduce/scale_up/float32" in titles and blank_charts(scalars) == [], scalars
  chart = next(c for c in custom if c["title"] == "all_reduce over scale_up: busbw (GB/s)")
  assert sorted(s["name"] for s in chart["series"]) == [
      f"busbw_gbps/all_reduce/scale_up/float32 ({r})" for r in ("cpu", "fab", "fab/expected")]
  assert unnamed_lines(custom) == [], custom
  assert hidden_config(text) == [] and {b["run"] for b in text if b["tag"] == "config"} == {"fab", "cpu"}
  assert "value default dtype bfloat16 float32 fabric dgx_h100 auto The rest:" in next(
      b["text"] for b in text if b["tag"] == "config")
  ts, scalars, custom, text = seen["old"]  # each check, shown catching what the old output did
  assert time_series_faults(ts, ["old_a"])[0].startswith("first card busbw_avg_gbps/"), ts
  assert any(f.startswith("busbw_avg_gbps/") for f in blank_charts(scalars)), scalars
  assert len(unnamed_lines(custom)) == 2 * len(COLLECTIVES), custom  # 2 runs x 2 charts
  assert len(hidden_config(text)) == 2, text
