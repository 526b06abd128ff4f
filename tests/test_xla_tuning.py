"""XLA:GPU's collective performance table and speed-of-light options written from sweeps (microbench/tuning/):
the table's entries as XLA reads them, merging, the checks that say when XLA would not use a table, and the
fitted options against the model they come from."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest

from microbench.tuning import textproto, xla_perf_table, xla_sol_fit, xla_table_check
from support import ROOT, clean_env, made_once, run_cli

COLLECTIVES = "all_reduce,all_gather,reduce_scatter,all_to_all,ppermute"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
  """A CPU sweep made by the toolkit (two emulated nodes of four), made once and shared by every worker: every
  collective XLA's table knows, inside a node and across nodes."""
  def make(out):
    r = run_cli(["--topology=nodes:2,gpus:4", f"--collectives={COLLECTIVES}", "--scopes=scale_up,scale_out",
                 "--min_bytes=256K", "--max_bytes=1M", "--step_factor=4", "--samples=3", f"--outdir={out}",
                 "--store=none"], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
  return str(made_once(tmp_path_factory, "xla_tuning_sweep", make))


def _steady_copy(run: str, dest) -> str:
  """The run with every point marked steady (the CPU's noise decides which are NOISY; these tests are about what
  is written from a steady point)."""
  shutil.copytree(run, dest)
  path = os.path.join(dest, "results.jsonl")
  recs = [json.loads(line) for line in open(path, encoding="utf-8")]
  with open(path, "w", encoding="utf-8") as f:
    for rec in recs:
      f.write(json.dumps({**rec, "noisy": False}) + "\n")
  return str(dest)


# ------------------------------------------------------------------------------------------------ the table

def test_device_keys_are_xlas():
  assert xla_perf_table.device_key("NVIDIA H100 80GB HBM3") == "sm_90"
  assert xla_perf_table.device_key("NVIDIA H200") == "sm_90"  # one key for both: a table per compile, not per file
  assert xla_perf_table.device_key("NVIDIA B200") == "sm_100_B200"
  assert xla_perf_table.device_key("NVIDIA A100-SXM4-80GB") == "sm_80"
  with pytest.raises(xla_perf_table.TableError, match="--xla_device_key"):
    xla_perf_table.device_key("cpu")


def _groups(dims, perm):
  d = int(np.prod(dims))
  arr = np.arange(d).reshape(dims).transpose(perm)
  return arr


@pytest.mark.parametrize("seed", range(6))
def test_iota_form_rebuilds_every_layout_a_mesh_makes(seed):
  """Groups from a seeded sample of 1-3-axis device layouts (contiguous, strided, transposed) are written in
  iota form that rebuilds exactly those groups, in order; groups of no iota form get None."""
  rng = random.Random(seed)
  for _ in range(20):
    dims = [rng.choice((2, 3, 4)) for _ in range(rng.randint(1, 3))]
    perm = list(range(len(dims)))
    rng.shuffle(perm)
    arr = _groups(dims, perm)
    size = arr.shape[-1]
    groups = arr.reshape(-1, size).tolist()
    form = xla_perf_table.iota_form(groups)
    assert form is not None, (dims, perm)
    rebuilt = np.arange(len(sum(groups, []))).reshape(form[0]).transpose(form[1]).reshape(len(groups), size)
    assert rebuilt.tolist() == groups
  swapped = [[0, 1, 2, 3], [4, 5, 7, 6]]
  assert xla_perf_table.iota_form(swapped) is None


def _bytes_transferred(e) -> int:
  """XLA's BytesTransferred for an entry, from the entry alone (reduce-scatter's input is N x its output)."""
  ins = textproto.first(e, "instruction")
  shape = textproto.first(ins, "shape")
  nbytes = {"F32": 4, "BF16": 2, "F16": 2, "S32": 4}[textproto.first(shape, "element_type")]
  nbytes *= int(textproto.first(shape, "dimensions"))
  if textproto.unquote(textproto.first(ins, "opcode")) == "reduce-scatter":
    nbytes *= int(textproto.first(textproto.first(ins, "iota_collective_device_list"), "num_devices_per_group"))
  return nbytes


def test_each_entry_gives_back_the_measured_time_as_xla_computes_it(sweep, tmp_path):
  """For every entry: XLA's bytes (from the entry's own shape) over its throughput is the point's measured time
  (so a wrong shape, a wrong size convention or a wrong unit is caught), and only points inside a node are in."""
  run = _steady_copy(sweep, tmp_path / "steady")
  key, entries, counts = xla_perf_table.from_runs([run], "sm_90")
  recs = [json.loads(line) for line in open(os.path.join(run, "results.jsonl"), encoding="utf-8")]
  inside = [r for r in recs if r["scope"] == "scale_up" and r["status"] == "ok" and r["time_us"] > 0]
  assert key == "sm_90" and counts.written == len(entries) == len(inside) > 0
  assert sum(counts.left_out.values()) + counts.written == len(recs)
  assert any("across nodes" in why for why in counts.left_out)
  times = sorted(r["time_us"] for r in inside)
  got = sorted(_bytes_transferred(e) / int(textproto.first(e, "network_throughput_bytes_per_sec")) * 1e6
               for e in entries)
  assert got == pytest.approx(times, rel=1e-6)
  ops = {textproto.unquote(textproto.first(textproto.first(e, "instruction"), "opcode")) for e in entries}
  assert ops == {xla_perf_table.OPCODES[r["collective"]] for r in inside}


def test_noisy_and_failed_points_are_left_out_and_counted(sweep, tmp_path):
  run = _steady_copy(sweep, tmp_path / "mixed")
  path = os.path.join(run, "results.jsonl")
  recs = [json.loads(line) for line in open(path, encoding="utf-8")]
  recs[0] = {**recs[0], "noisy": True}
  recs[1] = {**recs[1], "status": "failed"}
  recs[2] = {**recs[2], "wrong": 3}
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in recs)
  _, entries, counts = xla_perf_table.from_runs([run], "sm_90")
  reasons = " ".join(counts.left_out)
  assert "NOISY" in reasons and "failed" in reasons and "checked" in reasons
  assert sum(counts.left_out.values()) + len(entries) == len(recs)


def test_a_cpu_run_needs_a_key_named_and_the_merge_keeps_what_it_does_not_write(sweep, tmp_path):
  run = _steady_copy(sweep, tmp_path / "steady")
  with pytest.raises(xla_perf_table.TableError, match="rehearsal"):
    xla_perf_table.from_runs([run])
  key, entries, _ = xla_perf_table.from_runs([run], "sm_90")
  theirs = ('entries {\n  key: "sm_80"\n  value { entries { instruction { opcode: "all-reduce" metadata {}\n'
            '  shape { element_type: F32 dimensions: 4 } } fingerprint: "abc" network_throughput_bytes_per_sec: 7 } }\n}\n')
  path = tmp_path / "table.pbtxt"
  path.write_text(theirs)
  kept, replaced = xla_perf_table.write(str(path), key, entries)
  assert (kept, replaced) == (0, 0)
  first = path.read_text()
  assert 'fingerprint: "abc"' in first and "metadata {" in first and first.count("instruction {") == len(entries) + 1
  kept, replaced = xla_perf_table.write(str(path), key, entries[:3])  # the same points again: replaced, not added
  assert (kept, replaced) == (len(entries) - 3, 3)
  assert path.read_text().count("instruction {") == len(entries) + 1


def test_textproto_round_trips_and_reports_a_bad_line():
  text = 'a { b: 1 c: "x\\"y" d { e: F32 } } f: -2.5e3 # comment\ng: "p" "q"\n'
  msg = textproto.parse(text)
  assert textproto.parse(textproto.render(msg)) == msg
  assert textproto.first(msg, "g") == '"pq"'
  with pytest.raises(textproto.TextProtoError, match="line 2"):
    textproto.parse("a: 1\n} b")


def _table(tmp_path, entries_text: str, key: str = "sm_90") -> str:
  path = tmp_path / "t.pbtxt"
  path.write_text(f'entries {{ key: "{key}" value {{ {entries_text} }} }}\n')
  return str(path)


_AG = ('entries { instruction { opcode: "all-gather" shape { element_type: F32 dimensions: 1024 } '
       'iota_collective_device_list { num_replica_groups: 1 num_devices_per_group: 8 iota_reshape_dims: 8 '
       'iota_transpose_perm: 0 } } network_throughput_bytes_per_sec: 1000 }')


def test_the_check_names_what_xla_would_do_silently(tmp_path):
  """Each way XLA falls back, degrades or aborts without a word is one line; a sound table has none."""
  assert "no entries for sm_90" in xla_table_check.check(_table(tmp_path, _AG, key="sm_80"), "sm_90").fatal[0]
  assert "no such file" in xla_table_check.check(str(tmp_path / "nope"), "sm_90").fatal[0]
  bad = tmp_path / "bad.pbtxt"
  bad.write_text("entries { key: ")
  assert "not a text-format table" in xla_table_check.check(str(bad), "sm_90").fatal[0]
  v = xla_table_check.check(_table(tmp_path, _AG), "sm_90")
  assert v.used and v.kinds == ("all-gather",) and "fixed 5000 us" in v.notes[0]
  two_d = _AG.replace("dimensions: 1024", "dimensions: 32 dimensions: 32")
  assert "drops its whole estimator" in xla_table_check.check(_table(tmp_path, two_d), "sm_90").fatal[0]
  assert "aborts the compile" in xla_table_check.check(_table(tmp_path, _AG.replace("all-gather", "send")),
                                                       "sm_90").fatal[0]
  straddle = _AG.replace("num_devices_per_group: 8", "num_devices_per_group: 3")
  assert "straddle" in xla_table_check.check(_table(tmp_path, straddle), "sm_90").fatal[0]


def test_a_written_table_passes_the_check(sweep, tmp_path):
  run = _steady_copy(sweep, tmp_path / "steady")
  key, entries, _ = xla_perf_table.from_runs([run], "sm_90")
  xla_perf_table.write(str(tmp_path / "w.pbtxt"), key, entries)
  v = xla_table_check.check(str(tmp_path / "w.pbtxt"), "sm_90", gpus_per_node=4)
  written = {textproto.unquote(textproto.first(textproto.first(e, "instruction"), "opcode")) for e in entries}
  assert v.used and set(v.kinds) == written and len(v.notes) == (written != set(xla_perf_table.KINDS))


# ------------------------------------------------------------------------------------------ the SoL options

def _points(options, sizes=tuple(1 << k for k in range(12, 29, 2))):
  out = []
  for coll, nb, (s, g, nodes) in itertools.product(("all_reduce", "all_gather", "reduce_scatter", "all_to_all"),
                                                   sizes, ((2, 8, 2), (16, 1, 2), (4, 8, 4), (32, 1, 4))):
    p = xla_sol_fit.Point(coll, nb, s, g, nodes, 0.0)
    out.append(xla_sol_fit.Point(coll, nb, s, g, nodes, xla_sol_fit.predict(p, options)))
  return out


@pytest.mark.parametrize("seed", range(5))
def test_the_fit_recovers_options_that_made_the_times(seed):
  """Times made by XLA's model under a seeded draw of options (whole microseconds, as XLA reads them) give the
  options back, with a stated error of ~0."""
  rng = random.Random(seed)
  truth = {"nccl_op_launch_us": rng.randint(2, 60), "rtt_us": rng.randint(1, 40), "chunk_prep_us": rng.randint(1, 9),
           "nic_speed_gbps": rng.choice((12.5, 25.0, 50.0, 100.0)), "gpus_per_node": 8,
           "chunk_size_bytes": rng.choice((1 << 18, 1 << 20, 1 << 22))}
  f = xla_sol_fit.fit(_points(truth), 8, xla_sol_fit.defaults_for("NVIDIA H100 80GB HBM3"))
  assert f.max_error < 1e-6, (truth, f.options)
  assert f.options == pytest.approx(truth)
  assert all(f.how[k] == "fitted" for k in xla_sol_fit.NAMES)


def test_a_model_unlike_xlas_shows_in_the_stated_error():
  """Mutation: times where an all-reduce costs one pass, not XLA's two, cannot be fitted exactly; the stated
  worst error says so (a fit that hid it would call the options good)."""
  truth = {"nccl_op_launch_us": 20, "rtt_us": 10, "chunk_prep_us": 2, "nic_speed_gbps": 25.0, "gpus_per_node": 8,
           "chunk_size_bytes": 1 << 20}
  pts = [xla_sol_fit.Point(p.collective, p.nbytes, p.group_size, p.groups, p.nodes,
                           p.time_us / (2 if p.collective == "all_reduce" else 1) + 0.0) for p in _points(truth)]
  f = xla_sol_fit.fit(pts, 8, xla_sol_fit.defaults_for(None))
  assert f.max_error > 0.2


def test_an_option_the_points_cannot_tell_apart_is_kept_at_xlas_default():
  truth = {"nccl_op_launch_us": 20, "rtt_us": 10, "chunk_prep_us": 2, "nic_speed_gbps": 25.0, "gpus_per_node": 8,
           "chunk_size_bytes": 1 << 22}
  f = xla_sol_fit.fit(_points(truth, sizes=(4096, 16384, 65536)), 8, xla_sol_fit.defaults_for(None))
  assert f.how["chunk_prep_us"].startswith("kept at XLA's default") and f.options["chunk_prep_us"] == 6


def test_the_report_prints_the_xla_flags_and_the_options_reproduce_the_sweep_within_the_stated_error(sweep, tmp_path):
  """From the emulated cluster's sweep (its points across nodes): the XLA_FLAGS line, recorded; each measured
  time within the worst error the fit states."""
  run = _steady_copy(sweep, tmp_path / "steady")
  r = subprocess.run([sys.executable, "-m", "microbench.cli.report", run, "--xla_sol_options"], capture_output=True,
                     text=True, timeout=300, env=clean_env(), cwd=ROOT)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "XLA_FLAGS='--xla_gpu_enable_analytical_sol_latency_estimator=true" in r.stdout
  rec = json.load(open(os.path.join(run, "xla_sol_options.json"), encoding="utf-8"))
  from microbench.output import run_folder  # pylint: disable=import-outside-toplevel
  pts, _ = xla_sol_fit.points_from(run_folder.read_results(run), run_folder.read_meta(run))
  assert len(pts) == rec["points"] > 0
  errors = [abs(xla_sol_fit.predict(p, rec["options"]) / p.time_us - 1) for p in pts]
  assert max(errors) == pytest.approx(rec["max_error"], rel=1e-9, abs=1e-12)
  assert f"{rec['max_error']:.1%} (worst)" in r.stdout


def test_the_table_mode_writes_and_refuses_in_one_line(sweep, tmp_path):
  run = _steady_copy(sweep, tmp_path / "steady")
  out = tmp_path / "t.pbtxt"
  cmd = [sys.executable, "-m", "microbench.cli.report", run, f"--xla_perf_table={out}"]
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=ROOT)
  assert r.returncode == 2 and "--xla_device_key" in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr
  r = subprocess.run(cmd + ["--xla_device_key=sm_90"], capture_output=True, text=True, timeout=300, env=clean_env(),
                     cwd=ROOT)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "a rehearsal" in r.stdout and "wrote" in r.stdout and out.exists()


# ------------------------------------------------------------------- the compiled program (XLA:GPU, compile only)

def _train(args: list[str]) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "microbench.cli.train", "--target=h100", "--topology=nodes:1,gpus:8",
                         "--model=llama3", "--size=tiny", "--parallelism=fsdp:8", "--batch=8", "--store=none", *args],
                        capture_output=True, text=True, timeout=900, env=clean_env(), cwd=ROOT)


def _scaled(src: str, dest: str, factor: float) -> str:
  """The table with every throughput x `factor` (a labelled scaling, not a measurement)."""
  text = open(src, encoding="utf-8").read()
  msg = textproto.parse(text)
  for _, item in msg:
    for _, e in [(n, v) for n, v in textproto.first(item, "value") if n == "entries"]:
      i = next(k for k, (n, _) in enumerate(e) if n == "network_throughput_bytes_per_sec")
      e[i] = ("network_throughput_bytes_per_sec", str(int(int(e[i][1]) * factor)))
  with open(dest, "w", encoding="utf-8") as f:
    f.write(f"# {src} with every throughput x{factor}: scaled for a test, not measured\n" + textproto.render(msg))
  return dest


@pytest.mark.slow
@pytest.mark.gpu_compile
@pytest.mark.skipif(not __import__("microbench.aot.gpu_compile", fromlist=["x"]).plugin_available(),
                    reason="JAX's CUDA PJRT plugin is not installed: pip install -e '.[gpu-compile]'")
def test_a_table_from_a_sweep_changes_xlas_schedule_the_way_its_numbers_say(sweep, tmp_path):
  """A table written from the sweep (its CPU times: slow for an H100) and the same table 1000x faster (scaled):
  XLA:GPU compiles an FSDP step for 8 H100s with less work inside the collectives' windows under the fast one
  (a transfer it believes short needs less to hide it), none with more; the report names the changed kinds.
  A table of another key is named before the compile and the schedule said unchanged (XLA fell back)."""
  run = _steady_copy(sweep, tmp_path / "steady")
  key, entries, _ = xla_perf_table.from_runs([run], "sm_90")
  slow = str(tmp_path / "measured.pbtxt")
  xla_perf_table.write(slow, key, entries)
  fast = _scaled(slow, str(tmp_path / "fast.pbtxt"), 1000)
  r = _train([f"--xla_perf_table={fast}", f"--xla_perf_table_baseline={slow}", f"--outdir={tmp_path / 't'}"])
  assert r.returncode == 0, r.stderr[-3000:]
  summary = [json.loads(l) for l in open(tmp_path / "t" / "metrics.jsonl", encoding="utf-8")][-1]
  rows = summary["xla_perf_table"]["rows"]
  assert any(r_["inside"][1] < r_["inside"][0] for r_ in rows), rows
  assert all(r_["inside"][1] <= r_["inside"][0] for r_ in rows), rows
  print("\n".join(l for l in r.stdout.splitlines() if "->" in l))  # the figures (-s shows them)
  changed = [r_["op"] for r_ in rows if r_["changed"]]
  assert changed and all(f"{op}: " in r.stdout for op in changed)
  wrong = tmp_path / "sm_80.pbtxt"
  wrong.write_text(open(slow, encoding="utf-8").read().replace('key: "sm_90"', 'key: "sm_80"'))
  r = _train([f"--xla_perf_table={wrong}", f"--outdir={tmp_path / 'w'}"])
  assert r.returncode == 0, r.stderr[-3000:]
  assert "has no entries for sm_90 (it has sm_80)" in r.stdout
  assert "XLA compiled the same schedule with" in r.stdout


@pytest.mark.slow
@pytest.mark.gpu_compile
@pytest.mark.skipif(not __import__("microbench.aot.gpu_compile", fromlist=["x"]).plugin_available(),
                    reason="JAX's CUDA PJRT plugin is not installed: pip install -e '.[gpu-compile]'")
def test_sol_options_as_the_report_prints_them_change_the_schedule_across_nodes(tmp_path):
  """The XLA_FLAGS line's form, with a network far faster than XLA's default (options a fit could give): the
  FSDP step over two H100 nodes has less work inside its collectives' windows, none more; XLA read them."""
  fit = xla_sol_fit.Fit({"nccl_op_launch_us": 1, "rtt_us": 1, "chunk_prep_us": 1, "nic_speed_gbps": 10000.0,
                         "gpus_per_node": 8, "chunk_size_bytes": 4194304}, {}, 0, 0.0, 0.0, [])
  windows = []
  for flags in ("", fit.xla_flags()):
    out = tmp_path / f"run{len(windows)}"
    r = subprocess.run([sys.executable, "-m", "microbench.cli.train", "--target=h100", "--topology=nodes:2,gpus:8",
                        "--model=llama3", "--size=tiny", "--parallelism=fsdp:16", "--batch=16", "--store=none",
                        f"--outdir={out}"], capture_output=True, text=True, timeout=900,
                       env=clean_env(XLA_FLAGS=flags), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    windows.append([json.loads(l) for l in open(out / "metrics.jsonl", encoding="utf-8")][-1]["schedule_windows"])
  default, fast = windows
  print(f"XLA's default SoL options: {default}\nfast network: {fast}")  # the figures (-s shows them)
  assert any(fast[op]["inside"] < default[op]["inside"] for op in default), windows
  assert all(fast.get(op, {}).get("inside", 0) <= default[op]["inside"] for op in default), windows


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
def test_the_fitted_nic_speed_is_the_emulated_clusters_link(tmp_path):
  """A sweep across four testbed hosts joined by 400 Mbit/s links (0.05 GB/s): the fitted NIC speed is that link's
  (within what TCP over a shaped link delivers), and every point within the fit's stated worst error."""
  out = tmp_path / "tb"
  r = subprocess.run([sys.executable, "-m", "microbench.cli.testbed", "--hosts=4", "--host_rate=400mbit", "--",
                      sys.executable, "-m", "microbench", "--collectives=all_reduce,all_gather,reduce_scatter,all_to_all",
                      "--scopes=scale_out", "--min_bytes=64K", "--max_bytes=4M", "--samples=8", f"--outdir={out}",
                      "--store=none"], capture_output=True, text=True, timeout=900, env=clean_env(), cwd=ROOT)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  run = _steady_copy(str(out), tmp_path / "steady")  # the fit's rule on NOISY points is tested above
  from microbench.output import run_folder  # pylint: disable=import-outside-toplevel
  pts, _ = xla_sol_fit.points_from(run_folder.read_results(run), run_folder.read_meta(run))
  f = xla_sol_fit.fit(pts, 1, xla_sol_fit.defaults_for(None))
  assert 0.6 * 0.05 < f.options["nic_speed_gbps"] < 1.1 * 0.05, f.record()
  assert all(e <= f.max_error + 1e-12 for e in f.errors), f.record()
  # Bandwidth-bound rings, where the NIC term decides: within 15%. (XLA:CPU's reduce-scatter over TCP takes about
  # an all-reduce's time, twice the ring model's: the fit states that error rather than hiding it.)
  big = [e for p, e in zip(pts, f.errors) if p.nbytes >= 1 << 20 and p.collective in ("all_reduce", "all_gather")]
  assert big and max(big) < 0.15, f.record()
  assert max(f.worst_by_collective().values()) == pytest.approx(f.max_error)
