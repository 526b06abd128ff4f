"""The `microbench` command end to end: outputs, bad input, failures, resume."""

import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from support import run_cli
from microbench.output.run_folder import size_step

FIELDS = {"collective", "scope", "group_size", "num_groups", "dtype", "bytes", "count", "iters", "short_iters",
          "samples", "samples_us", "time_method", "time_us", "time_us_min", "time_us_max", "algbw_gbps",
          "busbw_gbps", "wrong", "status", "wire_dtype", "trip_count", "call_us_short", "call_us_long"}


def _records(outdir):
  with open(os.path.join(outdir, "results.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_sweep_writes_table_jsonl_meta_and_tensorboard(tmp_path):
  out = tmp_path / "run"
  r = run_cli(["--collectives=all_reduce,all_to_all", "--scopes=all", "--min_bytes=1K", "--max_bytes=4K",
               "--iters=6", "--samples=3", "--link_peaks=scale_up:100,scale_out:ndr", f"--outdir={out}"],
              NCCL_ALGO="Ring", XLA_FLAGS="--xla_dump_hlo_pass_re=nothing")
  assert r.returncode == 0, r.stderr
  assert "emulated as racks:1,nodes:2,gpus:4" in r.stdout  # the CPU default, said in the output
  assert "scope rack_scale skipped" in r.stdout
  assert "Avg bus bandwidth" in r.stdout and "Out of bounds values : 0 OK" in r.stdout
  recs = _records(out)
  assert len(recs) == 2 * 3 * 3  # collectives x (scale_up, scale_out, global) x sizes
  for rec in recs:
    assert FIELDS <= rec.keys() and rec["status"] == "ok" and rec["wrong"] == 0
  assert {r["scope"] for r in recs} == {"scale_up", "scale_out", "global"}
  assert {(r["scope"], r["group_size"], r["num_groups"]) for r in recs} == {
      ("scale_up", 4, 2), ("scale_out", 2, 4), ("global", 8, 1)}
  meta = json.loads((out / "meta.json").read_text())
  assert meta["device_count"] == 8 and meta["process_count"] == 1 and meta["platform"] == "cpu"
  assert meta["topology"] == {"racks": 1, "nodes": 2, "gpus": 4}
  assert meta["mesh"]["shape"] == [1, 2, 4] and meta["status"] == "finished"
  assert meta["jax_version"] and meta["flags"]["collectives"] == ["all_reduce", "all_to_all"]
  # The software stack, in meta.json and the header.
  env = meta["environment"]
  assert env["variables"]["NCCL_ALGO"] == "Ring" and env["variables"]["XLA_FLAGS"].startswith("--xla_dump")
  assert env["packages"]["jax"] == meta["jax_version"] and env["gpu"] is None and env["hosts"]
  assert env["toolkit"]["version"] and "NCCL_ALGO=Ring" in r.stdout and f"jax {meta['jax_version']}" in r.stdout
  # Link peaks: per level in meta.json, and per record with busbw's share of the scope's bound.
  assert meta["link_peaks"]["scale_up"]["gbps"] == 100 and meta["link_peaks"]["scale_out"]["link"] == "ndr"
  from microbench.fabric import link_peaks
  peaks = link_peaks.parse("scale_up:100,scale_out:ndr")
  for rec in recs:
    axes = meta["scopes"][rec["scope"]]["axes"]
    bound = link_peaks.bus_peak(rec["collective"], axes, {"rack": 1, "node": 2, "gpu": 4}, peaks)
    assert rec["peak_gbps"] == pytest.approx(bound)
    assert rec["busbw_pct_of_peak"] == pytest.approx(100 * rec["busbw_gbps"] / bound)
    assert rec["peak_algorithm"] == link_peaks.ALGORITHMS[rec["collective"]]  # what the bound assumes
  # The same records as CSV, and an alpha-beta fit per series.
  import csv
  with open(out / "results.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert [(r["collective"], r["scope"], int(r["bytes"])) for r in rows] == [
      (r["collective"], r["scope"], r["bytes"]) for r in recs]
  model = json.loads((out / "model.json").read_text())
  assert len(model["fits"]) == 2 * 3 and all(f["points"] == 3 for f in model["fits"])
  ea = EventAccumulator(str(out))
  ea.Reload()
  tags = ea.Tags()["scalars"]
  assert "busbw_gbps/all_reduce/scale_up/float32" in tags and "time_us/all_to_all/global/float32" in tags
  steps = [e.step for e in ea.Scalars("busbw_gbps/all_reduce/scale_out/float32")]
  assert steps == [100, 110, 120]  # 10 x log2(bytes)
  assert "custom_scalars__config__" in ea.Tags()["tensors"] and "x_axis" in ea.Tags()["tensors"]
  assert {"figures/all_reduce", "figures/all_to_all"} <= set(ea.Tags()["images"])  # the report's figures
  assert "config" in ea.Tags()["tensors"]
  config = ea.Tensors("config")[0].tensor_proto.string_val[0].decode()
  assert config.startswith("| set away from the default | value | default |")  # what differs first
  assert "| `collectives` | **all_reduce, all_to_all** | all |" in config and "None" not in config


@pytest.mark.slow
def test_explicit_topology_two_dtypes_and_flagfile(tmp_path):
  out = tmp_path / "run"
  flagfile = tmp_path / "sweep.flags"
  flagfile.write_text("--collectives=reduce_scatter,broadcast\n--scopes=scale_out,rack_scale\n"
                      "--topology=racks:2,nodes:3,gpus:1\n--dtype=float32,bfloat16\n")
  r = run_cli([f"--flagfile={flagfile}", "--min_bytes=4K", "--max_bytes=4K", "--iters=6", "--samples=2",
               f"--outdir={out}"])
  assert r.returncode == 0, r.stderr
  recs = _records(out)
  assert {(r["scope"], r["group_size"]) for r in recs} == {("scale_out", 6), ("rack_scale", 3)}
  assert {r["dtype"] for r in recs} == {"float32", "bfloat16"}
  assert all(r["wrong"] == 0 for r in recs)
  assert all(r["count"] % r["group_size"] == 0 for r in recs if r["collective"] == "reduce_scatter")


@pytest.mark.parametrize("args,message", [
    (["--collectives=allreduce"], "unknown collective allreduce: choose from all_reduce"),
    (["--scopes=rack"], "unknown scope rack"),
    (["--dtype=float64"], "unknown dtype float64"),
    (["--topology=nodes:3,gpus:4"], "has 12 devices but 8 are available"),
    (["--topology=nodes:two"], "bad topology item"),
    (["--min_bytes=1M", "--max_bytes=1K"], "is larger than --max_bytes"),
    (["--max_bytes=12Q"], "bad size"),
    (["--iters=0"], "--iters=0 must be >= 1"),
    (["--iters=4"], "--iters=4: use 1 (latency mode"),
    (["--max_bytes=64T"], "lower --max_bytes"),
    (["--link_peaks=scale_out:fast"], "--link_peaks scale_out:fast: give GB/s"),
    (["--fabric=summit"], "unknown fabric 'summit'"),
    (["stray"], "unexpected arguments"),
    (["--op=mean"], "unknown reduction operator mean: choose from sum, max, min, prod, avg or all"),
    (["--profile_points=first"], "--profile_points=first: give point numbers"),
    (["--profile_points=0"], "points are numbered from 1"),
    (["--collectives=all_reduce", "--dtype=float8_e4m3fn"], "XLA:GPU hands no fp8 reduction to NCCL"),
    (["--collectives=reduce_scatter", "--op=avg", "--dtype=int32"], "XLA has no integer average"),
    (["--topology=nodes:2"], "topology 'nodes:2' does not say how many GPUs a node has: add gpus:G"),
    # Shapes the device kind cannot have, and flags that do nothing without a run (none needs the plugin).
    (["--target=h100", "--topology=nodes:1,gpus:72"], "a NVIDIA H100 SXM5 80GB node has 8 GPUs, not 72"),
    (["--target=gb200", "--topology=nodes:18,gpus:8"], "a NVIDIA GB200 (NVL72) tray has 4 GPUs, not 8"),
    (["--target=gb200", "--topology=nodes:19,gpus:4"], "NVLink domain (rack) has 18 trays, not 19"),
    (["--target=h100", "--distributed"], "--distributed does nothing with --target=h100"),
    (["--target=h100", "--inject_crash=0:1", "--inject_delay=0:5"], "--inject_delay, --inject_crash do nothing"),
    (["--target=h100", "--inject_hang=0:1"], "--inject_hang does nothing with --target"),
    (["--target=h100", "--profile_points=1"], "--profile_points does nothing with --target"),
    (["--target=h100", "--samples=5", "--warmup=2"], "--warmup, --samples do nothing with --target"),
    (["--target=h100", "--sample_ms=5", "--hang_timeout=9"], "--sample_ms, --hang_timeout do nothing"),
    (["--target=h100", "--nccl_debug"], "--nccl_debug does nothing with --target"),
])
def test_bad_input_is_one_clear_line(args, message, tmp_path):
  # A device count the user chose (here 8) is respected, so a topology of 12 devices can't match it.
  r = run_cli([*args, f"--outdir={tmp_path / 'x'}"], timeout=60, JAX_NUM_CPU_DEVICES="8")
  assert r.returncode == 2
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("microbench: error: ") and message in lines[0], r.stderr
  assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.parametrize("module,args,message", [
    ("microbench.cli.train", ["--target=h100", "--steps=5"], "microbench-train: error: --steps does nothing with"
                                                             " --target=h100"),
    ("microbench.cli.train", ["--target=h100", "--profile_steps=2", "--distributed"],
     "microbench-train: error: --distributed, --profile_steps do nothing with --target=h100"),
    ("microbench.cli.study", ["schedule", "--target=h100", "--gpu=B200", "--proxy_from=gpt2-tiny,fsdp"],
     "microbench-study: error: --gpu=B200 contradicts --target=h100"),
])
def test_contradictory_or_idle_flags_of_the_other_commands_are_one_line(module, args, message):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from support import ROOT, clean_env  # pylint: disable=g-import-not-at-top
  r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60,
                     env=clean_env(), cwd=ROOT)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("module,args,message", [
    ("microbench", ["--frobnicate"], "microbench: error: Unknown command line flag 'frobnicate'"),
    ("microbench", ["--samples=lots"], "microbench: error: flag --samples=lots"),
    ("microbench.cli.study", ["proxy", "--compute=fast"], "microbench-study: error: flag --compute=fast: value should"
                                                          " be one of <sleep|busy>"),
])
def test_a_flag_absl_rejects_is_one_clear_line(module, args, message):
  """Flags absl itself rejects (unknown flag, bad enum or integer) get the same one line as the commands' own
  checks (absl's default is a FATAL line plus a hint, exit 1)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from support import ROOT, clean_env  # pylint: disable=g-import-not-at-top
  r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60,
                     env=clean_env(), cwd=ROOT)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), r.stderr


def test_an_outdir_holding_a_run_is_not_mixed_with_a_new_one(tmp_path):
  (tmp_path / "meta.json").write_text("{}")
  r = run_cli([f"--outdir={tmp_path}"], timeout=60)
  assert r.returncode == 2
  assert r.stderr.strip() == (f"microbench: error: --outdir={tmp_path} already holds a run: choose a new folder,"
                              f" or continue that run with --resume={tmp_path}")


def test_help_lists_the_commands_flags():
  r = run_cli(["--help"], timeout=60)  # absl's --help exits 1 by design
  for flag in ("--collectives:", "--scopes:", "--max_bytes:", "--sample_ms:", "--[no]distributed:", "--resume:",
               "--coordinator_address:"):
    assert flag in r.stdout, flag


def test_wrong_results_fail_the_run(tmp_path, parsed_flags, monkeypatch):
  """One wrong element anywhere makes the whole run exit non-zero (after finishing the sweep)."""
  from microbench.bench import collectives, run as bench_run, sweep

  coll = collectives.get("ppermute")  # pretend it should have come from two ranks back
  monkeypatch.setattr(type(coll), "source", lambda self, rank, e, n, in_count: (0 * e + (rank - 2 + n) % n, e))
  cfg = sweep.SweepConfig(("ppermute", "all_reduce"), ("scale_up",), ("float32",), 64, 128, 2, 4, 0, 2, True)
  code = bench_run.execute(cfg, None, str(tmp_path), resumed=False, nodes_per_rack=None,
                                 flag_values={"distributed": False})
  assert code == 1
  recs = _records(tmp_path)
  assert len(recs) == 4  # the sweep went on after the wrong points
  assert all(r["wrong"] > 0 for r in recs if r["collective"] == "ppermute")
  assert all(r["wrong"] == 0 for r in recs if r["collective"] == "all_reduce")


@pytest.mark.slow
def test_crash_keeps_finished_points_and_resume_completes_the_sweep(tmp_path):
  out = tmp_path / "run"
  args = ["--collectives=all_reduce,all_gather", "--scopes=scale_up", "--min_bytes=1K", "--max_bytes=8K",
          "--iters=6", "--samples=2"]
  r = run_cli([*args, f"--outdir={out}", "--inject_crash=0:5"])
  assert r.returncode != 0
  before = _records(out)
  assert len(before) == 5 and all(rec["status"] == "ok" for rec in before)
  # Resume takes the sweep's flags from meta.json: no need to repeat them.
  r = run_cli([f"--resume={out}"])
  assert r.returncode == 0, r.stderr
  assert "5 point(s) already recorded are skipped" in r.stdout
  after = _records(out)
  keys = [(rec["collective"], rec["bytes"]) for rec in after]
  assert len(after) == 8 and len(set(keys)) == 8
  meta = json.loads((out / "meta.json").read_text())
  assert meta["status"] == "finished" and len(meta["resumed_at"]) == 1


@pytest.mark.slow
def test_a_hang_in_a_single_process_is_recorded_and_ends_the_run(tmp_path):
  out = tmp_path / "run"
  r = run_cli(["--collectives=ppermute", "--scopes=scale_up", "--min_bytes=1K", "--max_bytes=2K", "--iters=6",
               "--samples=2", "--hang_timeout=2", "--inject_hang=0:0", f"--outdir={out}"], timeout=60)
  assert r.returncode == 3, r.stderr[-2000:]
  recs = _records(out)
  assert len(recs) == 1 and recs[0]["status"] == "failed"
  assert recs[0]["reason"].startswith("watchdog: the timed runs of point 1/2 (ppermute over scale_up, float32, 1024 B)")
  assert json.loads((out / "meta.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_sizes_rounding_to_one_count_make_one_point(tmp_path):
  """On groups of 3, 4, 8 and 12 bytes all round to 3 float32 elements: one point, one TensorBoard step."""
  out = tmp_path / "run"
  r = run_cli(["--collectives=all_gather", "--scopes=scale_up", "--topology=racks:1,nodes:1,gpus:3",
               "--min_bytes=4", "--max_bytes=12", "--iters=6", "--samples=2", f"--outdir={out}"],
              JAX_NUM_CPU_DEVICES="3")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "requested sizes 4, 8, 12 B all round to 3 elements (12 B) for groups of 3: measured once" in r.stdout
  recs = _records(out)
  assert len(recs) == 1 and recs[0]["requested_bytes"] == 4 and recs[0]["also_requested"] == [8, 12]
  ea = EventAccumulator(str(out))
  ea.Reload()
  assert [e.step for e in ea.Scalars("busbw_gbps/all_gather/scale_up/float32")] == [size_step(12)]
  # A resumed run knows every requested size is done.
  r = run_cli([f"--resume={out}"], JAX_NUM_CPU_DEVICES="3")
  assert r.returncode == 0 and len(_records(out)) == 1


def test_sigterm_mid_sweep_leaves_valid_outputs(tmp_path):
  import signal
  import subprocess
  import sys
  import time
  from support import ROOT, clean_env

  out = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, "-m", "microbench", "--collectives=all_reduce", "--scopes=scale_up",
                           "--min_bytes=1K", "--max_bytes=256K", "--step_factor=1.08", "--nocheck", "--iters=6", "--samples=2", f"--outdir={out}"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT)
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline:  # wait for some points to finish
    if (out / "results.jsonl").exists() and len((out / "results.jsonl").read_text().splitlines()) >= 3:
      break
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  stdout, _ = proc.communicate(timeout=60)
  assert proc.returncode == 130
  assert "interrupted" in stdout
  recs = _records(out)  # every line parses
  assert 3 <= len(recs) < 200 and all(r["wrong"] is None for r in recs)
  assert json.loads((out / "meta.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_reduction_operators_and_fp8_in_one_sweep(tmp_path):
  """--op=all runs every operator of both reductions, each checked exactly (the check program and, for the
  idempotent max and min, the timed programs' chained output too); fp8 runs the data-moving collectives and
  the sweep says which pairs it skipped."""
  out = tmp_path / "run"
  r = run_cli(["--op=all", "--dtype=bfloat16,float8_e5m2", "--scopes=scale_up", "--min_bytes=256",
               "--max_bytes=256", f"--outdir={out}"], timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  recs = [json.loads(line) for line in open(out / "results.jsonl")]
  names = {(x["collective"], x["dtype"]) for x in recs}
  ops = ("", "_max", "_min", "_prod", "_avg")
  assert names == {*((f"{c}{o}", "bfloat16") for c in ("all_reduce", "reduce_scatter") for o in ops),
                   *((c, d) for c in ("all_gather", "all_to_all", "broadcast", "ppermute")
                     for d in ("bfloat16", "float8_e5m2"))}
  for x in recs:
    assert x["status"] == "ok" and x["wrong"] == 0, x
    if x["collective"].endswith(("_max", "_min")):
      assert x["timed_wrong"] == 0 and x["op"] in ("max", "min")
  assert "# all_reduce_prod in float8_e5m2 skipped: " in r.stdout
  assert " f8e5m2 " in r.stdout


def test_profile_points_trace_the_chosen_point_into_the_run_folder(tmp_path):
  """--profile_points=2 traces the second point after its measurement: an XPlane trace under the run folder's
  plugins/profile (TensorBoard's Profile tab) holding the all-reduce's execution; the other point has none."""
  out = tmp_path / "run"
  r = run_cli(["--collectives=all_reduce", "--scopes=scale_up", "--min_bytes=1K", "--max_bytes=2K",
               "--profile_points=2", f"--outdir={out}"], timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  recs = [json.loads(line) for line in open(out / "results.jsonl")]
  assert [x.get("profile") for x in recs] == [None, str(out / "plugins" / "profile")]
  traces = list((out / "plugins" / "profile").rglob("*.xplane.pb"))
  assert len(traces) == 1 and b"all-reduce" in traces[0].read_bytes()
  assert b"step_num" in traces[0].read_bytes()  # step markers (the Overview Page reads them: no "no step marker")


@pytest.mark.slow
def test_max_bytes_auto_is_4m_on_cpu_and_never_below_min_bytes(tmp_path):
  """The default range ends at 4M on CPU devices, 16M on GPUs; a --min_bytes past it is a one-size sweep."""
  from microbench.bench import sizes
  assert sizes.default_max_bytes("cpu", 1024) == 4 << 20
  assert sizes.default_max_bytes("gpu", 1024) == sizes.default_max_bytes("cuda", 1024) == 16 << 20
  assert sizes.default_max_bytes("cpu", 8 << 20) == 8 << 20
  out = tmp_path / "run"
  r = run_cli(["--collectives=ppermute", "--scopes=scale_out", "--min_bytes=1M", "--iters=6", "--samples=2",
               f"--outdir={out}"])
  assert r.returncode == 0, r.stderr[-2000:]
  assert [rec["bytes"] for rec in _records(out)] == [1 << 20, 2 << 20, 4 << 20]  # ends at 4M, not 16M (tests double)
  meta = json.loads((out / "meta.json").read_text())
  assert meta["flags"]["max_bytes"] == "auto" and meta["max_bytes"] == 4 << 20


@pytest.mark.parametrize("keep_going", [False, True])
def test_a_point_that_fails_to_run_fails_the_run(tmp_path, parsed_flags, monkeypatch, capsys, keep_going):
  """A point whose program fails (here: its timed runs raise, as an out-of-memory would) is recorded as failed
  and the run exits 1 naming it; without --keep_going the sweep stops there, keeping every point before it,
  with it the sweep measures the rest. Never `skipped` with exit 0."""
  from microbench.bench import program, run as bench_run, sweep

  real = program.time_pairs
  calls = []

  def fail_second(*a, **k):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while trying to allocate 12 bytes")
    return real(*a, **k)

  monkeypatch.setattr(program, "time_pairs", fail_second)
  cfg = sweep.SweepConfig(("all_reduce",), ("scale_up",), ("float32",), 64, 256, 2, 6, 0, 2, True,
                          keep_going=keep_going)
  code = bench_run.execute(cfg, None, str(tmp_path), resumed=False, nodes_per_rack=None,
                           flag_values={"distributed": False})
  assert code == 1
  recs = _records(tmp_path)
  assert [r["status"] for r in recs] == (["ok", "failed", "ok"] if keep_going else ["ok", "failed"])
  assert "RESOURCE_EXHAUSTED" in recs[1]["reason"]
  out = capsys.readouterr().out
  assert "# 1 point(s) FAILED to compile or run:" in out
  assert "point 2/3 (all_reduce over scale_up, float32, 128 B): run failed: RuntimeError: RESOURCE_EXHAUSTED" in out
  meta = json.loads((tmp_path / "meta.json").read_text())
  assert meta["status"] == ("finished" if keep_going else "failed")
  # A resume tries the failed point again (and, here, measures it).
  monkeypatch.setattr(program, "time_pairs", real)
  assert bench_run.execute(cfg, None, str(tmp_path), resumed=True, nodes_per_rack=None,
                           flag_values={"distributed": False}) == 0


@pytest.mark.slow
def test_nccl_debug_captures_into_the_run_folder_and_says_when_there_is_nothing(tmp_path):
  """On CPU no NCCL runs: the capture folder exists, meta.json's `nccl` says no INFO lines were written and
  why, and the sweep is unchanged."""
  out = tmp_path / "run"
  r = run_cli(["--nccl_debug", "--collectives=all_reduce", "--scopes=global", "--min_bytes=1K", "--max_bytes=1K",
               "--samples=2", "--iters=6", f"--outdir={out}"], timeout=120)
  assert r.returncode == 0, r.stderr
  meta = json.loads((out / "meta.json").read_text())
  assert (out / "nccl").is_dir() and meta["nccl"]["info_lines"] == 0 and meta["nccl"]["files"] == []
  assert meta["nccl"]["warnings"] == ["NCCL wrote no INFO lines: no NCCL communicator ran (a CPU run), or"
                                      " NCCL_DEBUG_FILE points elsewhere"]
  assert "# NCCL: NCCL wrote no INFO lines" in r.stdout


def test_a_rerun_loads_its_programs_from_the_compilation_cache(tmp_path):
  """--compilation_cache: the first run compiles every program into the folder, the same sweep again loads every
  one (JAX's own log: hits, no miss) and still checks them (HLO and values); none keeps the folder out. Were the
  cache keeping only JAX's default (compiles over a second), the rerun would miss every program."""
  cache = tmp_path / "xla"
  # --sample_ms=0: the long program's length is --iters, not what a loaded machine's first call suggested.
  args = ["--collectives=all_gather,all_reduce", "--scopes=global", "--min_bytes=1K", "--max_bytes=2K",
          "--sample_ms=0", f"--compilation_cache={cache}"]
  runs = [run_cli([*args, f"--outdir={tmp_path / name}"], JAX_EXPLAIN_CACHE_MISSES="1", JAX_LOG_COMPILES="1")
          for name in ("a", "b")]
  for proc in runs:
    assert proc.returncode == 0, proc.stderr[-2000:]
  first, second = (p.stderr for p in runs)
  assert "PERSISTENT COMPILATION CACHE MISS" in first
  assert "Persistent compilation cache hit" in second and "PERSISTENT COMPILATION CACHE MISS" not in second
  entries = sorted(os.listdir(cache))
  for name in ("a", "b"):
    with open(tmp_path / name / "meta.json", encoding="utf-8") as f:
      assert json.load(f)["compilation_cache"] == str(cache)
    with open(tmp_path / name / "results.jsonl", encoding="utf-8") as f:
      rows = [json.loads(line) for line in f]
    assert len(rows) == 4 and all(r["status"] == "ok" and r["wrong"] == 0 and r["timed_wrong"] == 0 and r["hlo"]
                                  for r in rows)
  off = run_cli([*args[:-1], "--compilation_cache=none", f"--outdir={tmp_path / 'c'}", "--min_bytes=4K",
                 "--max_bytes=4K"])
  assert off.returncode == 0, off.stderr[-2000:]
  with open(tmp_path / "c" / "meta.json", encoding="utf-8") as f:
    assert json.load(f)["compilation_cache"] == "off (--compilation_cache=none)"
  assert sorted(os.listdir(cache)) == entries


def test_cache_entries_are_renamed_into_place_whole(tmp_path, monkeypatch):
  """Processes sharing a cache folder (a study's concurrent jobs, a host's ranks, the suite's workers) never read
  half an entry: each is written under a temporary name and renamed into place. JAX's own write (the mutant)
  writes the entry's name in place: no rename, and this test fails on it."""
  from jax._src import lru_cache  # pylint: disable=import-outside-toplevel
  from microbench.bench import compile_cache  # pylint: disable=import-outside-toplevel
  assert compile_cache.atomic_writes() and compile_cache.atomic_writes()  # a second call keeps the first wrapper
  renames, real = [], os.replace

  def spy(src, dst):
    with open(src, "rb") as f:
      renames.append((f.read(), os.path.exists(dst), os.path.dirname(src) == os.path.dirname(dst)))
    real(src, dst)
  monkeypatch.setattr(os, "replace", spy)
  value = os.urandom(1 << 16)

  def written(put, folder) -> list:
    renames.clear()
    cache = lru_cache.LRUCache(str(tmp_path / folder), max_size=-1)
    put(cache, "key", value)
    put(cache, "key", b"another value: the first entry stays")
    assert cache.get("key") == value and os.listdir(tmp_path / folder) == ["key-cache"]
    return renames[:]
  atomic = lru_cache.LRUCache.put
  assert written(atomic, "atomic") == [(value, False, True)]
  assert written(atomic.jax_put, "jax") == []  # in place


def test_the_compilation_cache_stays_off_where_a_real_compile_is_read(monkeypatch):
  from microbench.bench import compile_cache  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("MICROBENCH_COMPILATION_CACHE", "/x/cache")
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert compile_cache.resolve("auto", None, "no") == ("/x/cache", "/x/cache")
  assert compile_cache.resolve("/y", None, "no")[0] == "/y"
  assert compile_cache.resolve("None", None, "no")[0] is None
  assert "compile-only" in compile_cache.resolve("auto", "h100", "no")[1]
  assert "thunk" in compile_cache.resolve("auto", None, "yes")[1]
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
  assert "dump" in compile_cache.resolve("auto", None, "no")[1]
  monkeypatch.delenv("MICROBENCH_COMPILATION_CACHE")
  monkeypatch.setenv("XDG_CACHE_HOME", "/c")
  assert compile_cache.default_dir() == "/c/microbench/xla"
