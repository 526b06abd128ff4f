"""The sweep's settings are checked in the library: a sweep started from Python is refused with the line the
command prints, and a good one runs without absl parsing any flag."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from microbench.bench import run as bench_run
from microbench.bench import settings
from microbench.bench.settings import SettingsError, SweepSettings

# (settings, the message `microbench: error: ` is followed by): one per check moved out of the command.
REFUSED = [
    (dict(collectives=("allreduce",)), "unknown collective allreduce: choose from all_reduce, all_gather,"
     " reduce_scatter, all_to_all, broadcast, ppermute, ragged_all_to_all, ragged_all_to_all_skewed,"
     " ragged_all_to_all_hot_expert, ragged_all_to_all_empty_sends or all"),
    (dict(scopes=("rack",)), "unknown scope rack: choose from scale_up, scale_out, rack_scale, global or all"),
    (dict(op=("mean",)), "unknown reduction operator mean: choose from sum, max, min, prod, avg or all"),
    (dict(min_bytes="1M", max_bytes="1K"), "--min_bytes=1M is larger than --max_bytes=1K"),
    (dict(max_bytes="12Q"), "bad size '12Q': use a byte count with an optional K, M or G suffix (8, 64K, 32M, 1G)"),
    (dict(min_bytes="0"), "--min_bytes and --max_bytes must be positive"),
    (dict(step_factor=1.0), "--step_factor=1.0 must be > 1"),
    (dict(step_factor=1.02), "--step_factor=1.02 puts neighbouring sizes on one TensorBoard step"
     " (step = round(10 x log2(bytes))): use >= 1.0718"),
    (dict(iters=0), "--iters=0 must be >= 1"),
    (dict(samples=0), "--samples=0 must be >= 1"),
    (dict(iters=4), "--iters=4: use 1 (latency mode: one operation per sample) or >= 6 (the long timed program;"
     " the short one runs 2)"),
    (dict(hang_timeout=0.0), "--hang_timeout=0.0 must be > 0"),
    (dict(sample_ms=-1.0), "--sample_ms=-1.0 must be >= 0"),
    (dict(warmup=-1), "--warmup=-1 must be >= 0"),
    (dict(inject_crash="x"), "--inject_crash='x': expected RANK:NUMBER, e.g. 1:50"),
    (dict(inject_delay="1:x"), "--inject_delay='1:x': expected RANK:NUMBER, e.g. 1:50"),
    (dict(fabric="summit"), "unknown fabric 'summit'; choose one of leonardo, lumi, alps, jupiter, dgx, nvl72 or"
     " testbed"),
    (dict(profile_points=("first",)), "--profile_points=first: give point numbers, e.g. 1,5"),
    (dict(profile_points=("0",)), "--profile_points=0: points are numbered from 1"),
    (dict(profile_points=("1",), iters=1), "--profile_points traces the timed programs: not in latency mode"
     " (--iters=1)"),
    (dict(root=-1), "--root=-1: the broadcast's source is a group rank, >= 0"),
    (dict(overlap="auto", command_buffer="yes"), "--command_buffer=yes with --overlap: the overlap arms are"
     " compiled without command buffers; measure them apart"),
    (dict(overlap="auto", iters=1), "--overlap times its three arms by difference: not in latency mode (--iters=1)"),
    (dict(collectives=("all_reduce",), dtype=("float8_e4m3fn",)), "all_reduce in float8_e4m3fn: XLA:GPU hands no"
     " fp8 reduction to NCCL (fp8 runs all_gather, all_to_all, ppermute and broadcast)"),
    (dict(topology="nodes:2"), "topology 'nodes:2' does not say how many GPUs a node has: add gpus:G (e.g."
     " nodes:2,gpus:8; gpus:1 for one device per node)"),
    (dict(target="h100", samples=5, warmup=2), "--warmup, --samples do nothing with --target=h100 (compile only: no"
     " process runs, nothing is timed); drop them, or drop --target to run"),
]

# The same refusals from the command line: its stderr is this line and nothing else.
CLI_ARGS = {
    "iters=4": ["--iters=4"],
    "min_bytes=1M": ["--min_bytes=1M", "--max_bytes=1K"],
    "target=h100": ["--target=h100", "--samples=5", "--warmup=2"],
}


def _refusal(s: SweepSettings) -> str:
  """The line the library refuses `s` with (failing the test when it does not)."""
  with pytest.raises(SettingsError) as refused:
    bench_run.start(s)
  return str(refused.value)


@pytest.mark.parametrize("fields,message", REFUSED, ids=[
    ",".join(f"{k}={v if not isinstance(v, tuple) else ','.join(v)}" for k, v in f.items()) for f, _ in REFUSED])
def test_a_bad_setting_is_refused_by_the_library_with_the_commands_message(fields, message, tmp_path):
  assert _refusal(SweepSettings(**fields, outdir=str(tmp_path / "run"))) == message
  assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.parametrize("name", list(CLI_ARGS))
def test_the_command_prints_the_librarys_message(name, tmp_path):
  from support import ROOT, clean_env  # pylint: disable=g-import-not-at-top
  fields = next(f for f, _ in REFUSED if ",".join(f"{k}={v}" for k, v in f.items()).startswith(name))
  message = _refusal(SweepSettings(**fields))
  r = subprocess.run([sys.executable, "-m", "microbench", *CLI_ARGS[name], f"--outdir={tmp_path / 'x'}"],
                     capture_output=True, text=True, timeout=120, env=clean_env(JAX_NUM_CPU_DEVICES="8"), cwd=ROOT)
  assert r.returncode == 2 and r.stderr == f"microbench: error: {message}\n", r.stderr


def test_a_good_setting_runs_a_sweep_without_absl_flags(tmp_path):
  """No parsed flags: the library's own defaults are what the config text and meta.json compare with."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  was_parsed = flags.FLAGS.is_parsed()
  out = tmp_path / "run"
  s = SweepSettings(collectives=("all_reduce",), scopes=("scale_up",), min_bytes="1K", max_bytes="1K",
                    iters=6, samples=2, sample_ms=0.0, outdir=str(out))
  assert bench_run.start(s) == 0
  assert flags.FLAGS.is_parsed() == was_parsed  # the library neither needs nor parses the flags
  recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
  assert [(r["collective"], r["scope"], r["bytes"], r["status"], r["wrong"]) for r in recs] == [
      ("all_reduce", "scale_up", 1024, "ok", 0)]
  meta = json.loads((out / "meta.json").read_text())
  assert meta["flags"] == settings.recorded(s) and meta["flags"]["collectives"] == ["all_reduce"]


@pytest.mark.parametrize("fail_long,reason", [
    (False, "HLO check failed: planted"), (True, "HLO check failed (timed program): planted")])
def test_an_hlo_check_failing_is_recorded_with_its_stage(fail_long, reason, tmp_path, monkeypatch):
  """run_point's steps share one HLO-stage helper: a failure names the stage, the point is an error."""
  from microbench.bench import hlo_check, program  # pylint: disable=g-import-not-at-top
  real = program.build_timed

  def planted(coll, mesh, plan, count, dtype, reps, **kw):
    if fail_long == (reps != program.SHORT_REPS):  # the short arm, or the long one sized by the probe
      raise hlo_check.HloMismatch("planted")
    return real(coll, mesh, plan, count, dtype, reps, **kw)

  monkeypatch.setattr(program, "build_timed", planted)
  out = tmp_path / "run"
  s = SweepSettings(collectives=("all_reduce",), scopes=("scale_up",), min_bytes="1K", max_bytes="1K",
                    iters=6, samples=2, sample_ms=0.0, outdir=str(out))
  assert bench_run.start(s) == 1
  [rec] = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
  assert rec["status"] == "error" and rec["reason"] == reason


@pytest.mark.parametrize("check,fields", [
    ("_check_timing", dict(iters=4)), ("_check_sizes", dict(min_bytes="1M", max_bytes="1K")),
    ("_check_overlap", dict(overlap="auto", iters=1)), ("_check_run_only", dict(target="h100", samples=5)),
])
def test_a_removed_check_is_caught(check, fields, monkeypatch):
  """The refusal tests above fail when a check is removed (no sweep starts: execute is stubbed)."""
  monkeypatch.setattr(bench_run, "execute", lambda *a, **k: 0)
  monkeypatch.setattr(settings, check, lambda s: (1, None) if check == "_check_sizes" else None)
  with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
    _refusal(SweepSettings(**fields))


def test_the_settings_defaults_are_the_flags_defaults():
  """meta.json's config text marks what differs from these: the command's flags must agree with them."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  import microbench.cli.bench  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import  (defines the flags)
  every = settings.defaults()
  for f in dataclasses.fields(SweepSettings):
    if f.name != "compilation_cache":  # the command's auto; API callers get none unless they ask
      assert flags.FLAGS[f.name].default == every[f.name], f.name
  assert set(settings.recorded(SweepSettings())) == {*settings.RECORDED, "outdir", "resume", "distributed"}


def test_the_sweep_library_reads_no_flags():
  """Settings in the library, flags at the edge: nothing under microbench/bench imports absl."""
  bench = pathlib.Path(settings.__file__).parent
  for path in sorted(bench.glob("*.py")):
    text = path.read_text()
    assert "absl" not in text and "UsageError" not in text, os.path.relpath(path, bench)
