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

from conftest import run_cli
from microbench.output import run_folder
from microbench.fabric import peaks as link_peaks
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
  for tag in ("busbw_gbps", "time_us", "wrong", "time_spread", "busbw_avg_gbps"):
    assert "200 = 1 MiB" in listed[f"{tag}/{base}"].description, tag  # the x axis explained beside each chart
  data = provider.read_scalars(ctx, experiment_id="", plugin_name="scalars", downsample=1000)["sweep_a"]
  recs = [r for r in run_folder.read_results(os.path.join(logdir, "sweep_a"))
          if (r["collective"], r["scope"]) == ("all_reduce", "scale_up")]
  assert [(p.step, p.value) for p in data[f"wrong/{base}"]] == [(100, 0.0), (110, 0.0), (120, 0.0), (216, 0.0)]
  assert [p.value for p in data[f"time_spread/{base}"]] == pytest.approx([1.5] * 4)  # 1.2 / 0.8
  (avg,) = data[f"busbw_avg_gbps/{base}"]  # once per series, at its largest size
  assert avg.step == 216 and avg.value == pytest.approx(sum(r["busbw_gbps"] for r in recs) / 4)
  assert f"time_spread/{base}" not in provider.list_scalars(ctx, experiment_id="", plugin_name="scalars")["sweep_b"]


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


def test_custom_scalars_layout_charts_per_collective_and_per_scope(logdir):
  ctx, provider = tensorboard(logdir)
  assert "custom_scalars" in provider.list_plugins(tb_request.RequestContext(), experiment_id="")  # the tab shows
  plugin = custom_scalars_plugin.CustomScalarsPlugin(ctx)
  layout = json.loads(plugin.layout_impl(tb_request.RequestContext(), ""))
  cats = {c["title"]: c["chart"] for c in layout["category"]}
  # Per collective and per scope; the runs' layouts merge. No run has a link peak: no "% of peak" charts.
  assert len(cats) == 2 * (len(run_folder.METRICS) - 1)
  by_coll = cats["busbw (GB/s) " + run_folder._BY_COLLECTIVE]  # pylint: disable=protected-access
  by_scope = cats["time (us) " + run_folder._BY_SCOPE]  # pylint: disable=protected-access
  assert [c["title"] for c in by_coll] == ["all_reduce: busbw (GB/s)", "all_gather: busbw (GB/s)"]
  assert [c["title"] for c in by_scope] == ["scale_up: time (us)", "scale_out: time (us)"]
  # A chart's regex picks one line per scope (for a collective) or per collective (for a scope).
  lines = plugin.scalars_impl(tb_request.RequestContext(), "sweep_a", by_coll[0]["multiline"]["tag"][0], "")
  assert lines["regex_valid"] and set(lines[custom_scalars_plugin._TAG_TO_EVENTS_PROPERTY]) == {  # pylint: disable=protected-access
      "busbw_gbps/all_reduce/scale_up/float32", "busbw_gbps/all_reduce/scale_out/float32"}
  lines = plugin.scalars_impl(tb_request.RequestContext(), "sweep_b", by_scope[1]["multiline"]["tag"][0], "")
  assert set(lines[custom_scalars_plugin._TAG_TO_EVENTS_PROPERTY]) == {  # pylint: disable=protected-access
      "time_us/all_reduce/scale_out/float32", "time_us/all_gather/scale_out/float32"}


def _layout_charts(logdir: str) -> dict[str, list[str]]:
  """Category title -> chart titles, as the Custom Scalars tab gets them (every run's last layout, merged)."""
  ctx, _ = tensorboard(logdir)
  layout = json.loads(custom_scalars_plugin.CustomScalarsPlugin(ctx).layout_impl(tb_request.RequestContext(), ""))
  return {c["title"]: [ch["title"] for ch in c["chart"]] for c in layout.get("category", [])}


def test_custom_scalars_show_peak_charts_only_where_a_peak_is_known(logdir, tmp_path):
  """Sweeps without a link peak (every CPU run) get no "busbw % of peak" charts (they were empty charts in
  the default view); a sweep with peaks for some scopes gets those charts for the collectives and scopes that
  have one, although its layout is written before any point is measured."""
  pct_coll = "busbw % of peak " + run_folder._BY_COLLECTIVE  # pylint: disable=protected-access
  pct_scope = "busbw % of peak " + run_folder._BY_SCOPE  # pylint: disable=protected-access
  cats = _layout_charts(logdir)
  assert not any("% of peak" in t for t in cats) and len(cats) == 4, list(cats)
  recs = synthetic_records(20.0, 40.0, sizes=[1024, 4096])
  for r in recs:
    if r["scope"] == "scale_up":  # a known NVLink-like peak for scale_up only, none for scale_out
      r.update(link_peaks.share(r["busbw_gbps"], 100.0))
  write_sweep(str(tmp_path / "gpu"), recs)
  cats = _layout_charts(str(tmp_path))
  assert cats[pct_coll] == ["all_reduce: busbw % of peak", "all_gather: busbw % of peak"]
  assert cats[pct_scope] == ["scale_up: busbw % of peak"]  # scale_out has no peak: no chart
  assert cats["busbw (GB/s) " + run_folder._BY_SCOPE] == [  # pylint: disable=protected-access
      "scale_up: busbw (GB/s)", "scale_out: busbw (GB/s)"]
  # A resumed run knows its earlier points' peaks before measuring anything.
  out = run_folder.RunOutputs(str(tmp_path / "gpu"), stream=open(os.devnull, "w"))
  out.layout(COLLECTIVES, SCOPES)
  out.close()
  assert _layout_charts(str(tmp_path))[pct_scope] == ["scale_up: busbw % of peak"]
  # Next to a CPU run the merged view keeps the GPU run's charts and adds no empty ones.
  write_sweep(str(tmp_path / "cpu"), synthetic_records(10.0, 80.0, sizes=[1024, 4096]))
  assert _layout_charts(str(tmp_path))[pct_scope] == ["scale_up: busbw % of peak"]


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
  _, provider = tensorboard(str(root))
  before = {r.run_name for r in provider.list_runs(tb_request.RequestContext(), experiment_id="")}
  build.build([str(root / "sweep_a")], str(root / "sweep_a" / "report"))
  assert (root / "sweep_a" / "report" / build.REPORT).exists()
  _, provider = tensorboard(str(root))
  assert {r.run_name for r in provider.list_runs(tb_request.RequestContext(), experiment_id="")} == before == {"sweep_a"}
  blobs = provider.list_blob_sequences(tb_request.RequestContext(), experiment_id="", plugin_name="images")
  assert any(t.startswith("report/") for t in blobs["sweep_a"]) and "figures/all_reduce" in blobs["sweep_a"]


@pytest.mark.skipif(not (os.path.exists("/usr/bin/chromium") and os.path.exists("/usr/bin/chromedriver")),
                    reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)")
def test_hparams_parallel_coordinates_draw_every_run_in_a_browser(logdir):
  """In headless Chromium over a real TensorBoard: HParams' parallel-coordinates view draws a line for each
  of the three training runs (a vit run with images/s and no MFU among two language models), the view that
  once came up empty because one run lacked a shown metric. About 15 s."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("tensorboard_screenshots", os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "tensorboard_screenshots.py"))
  shots = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(shots)
  with shots.Browser(os.path.join(logdir, "train")) as browser:
    assert browser.parallel_coordinates_lines(3) == 3
