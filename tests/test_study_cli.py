"""`microbench-study`'s command line: each mode's module defines only its own flags, so `MODE --help` lists
them alone, a flag of another mode is refused in one line naming its modes, and proxy's JSONL file is
--records (--out is a folder in every mode)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from microbench.cli import study as cli
from support import ROOT, clean_env

STUDY = [sys.executable, "-m", "microbench.cli.study"]
JAX_FREE = ("plan", "predict", "place", "run", "report", "gpcnet")  # start without JAX (a laptop, a login node)

# `MODE --help` in a process where the CUDA plugin looks absent (microbench's start-up would otherwise import
# JAX on a driverless host with the plugin installed), then whether JAX got imported.
HELP_PROBE = """
import importlib.util, sys
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda n, *a: None if n.startswith("jax_plugins") else find_spec(n, *a)
from microbench.cli import study
sys.argv = ["microbench-study", sys.argv[1], "--help"]
try:
  study.run()
except SystemExit:
  pass
print("JAX IMPORTED" if "jax" in sys.modules else "JAX-FREE")
"""


def study(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([*STUDY, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env(),
                        check=False)


def one_line_error(r: subprocess.CompletedProcess) -> str:
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
  assert lines[0].startswith("microbench-study: error: "), lines
  return lines[0]


@pytest.mark.parametrize("mode", cli.MODES)
def test_a_modes_help_lists_its_own_flags_only(mode):
  r = subprocess.run([sys.executable, "-c", HELP_PROBE, mode], capture_output=True, text=True, timeout=120,
                     cwd=ROOT, env=clean_env(), check=False)
  assert "Traceback" not in r.stderr, r.stderr[-2000:]
  listed = set(re.findall(r"^  --(?:\[no\])?(\w+):", r.stdout, re.M))
  own = {name for name, modes in cli.owners().items() if mode in modes}
  assert listed == own, (listed - own, own - listed)  # the sources' flags are the ones the mode defines
  assert r.stdout.startswith(f"microbench-study {mode}: ")  # the mode's docstring, not the dispatcher's
  if mode in JAX_FREE:
    assert r.stdout.rstrip().endswith("JAX-FREE"), r.stdout[-300:]


def test_help_lists_the_modes_one_line_each():
  r = study("--help")
  assert r.returncode == 0, r.stderr
  rows = [line.split() for line in r.stdout.splitlines() if line.startswith("  ")]
  assert [row[0] for row in rows] == list(cli.MODES) and all(len(row) > 3 for row in rows), r.stdout
  assert not re.search(r"^  --", r.stdout, re.M)  # no mode's flags


def test_out_is_a_folder_wherever_it_is_a_flag():
  assert set(cli.owners()["out"]) == {"plan", "predict", "place", "run", "gpcnet"}  # proxy's file is --records
  assert cli.owners()["records"] == ("proxy",)


@pytest.mark.parametrize("mode,flag,default", [
    ("run", "walltime", "200.0"), ("gpcnet", "walltime", "600.0"), ("schedule", "gpus", "8"),
    ("gpcnet", "iters", "40"), ("gpcnet", "warmup", "1"),
])
def test_defaults_are_stated_per_mode(mode, flag, default):
  r = study(mode, "--help")
  entry = r.stdout.split(f"  --{flag}:", 1)[1].split("\n  --", 1)[0]
  assert f"(default: '{default}')" in entry, entry


@pytest.mark.parametrize("mode,args,message", [
    ("report", ["--plan=x"], "--plan is a flag of `predict`, `run`, not of `report`"),
    ("plan", ["--noplots"], "--noplots is a flag of `report`, not of `plan`"),
    ("predict", ["--walltime", "5"], "--walltime is a flag of `run`, `gpcnet`, not of `predict`"),
    ("report", ["--results=x", "--distributed"], "--distributed is a flag of `proxy`, `schedule`, not of `report`"),
    ("place", ["--jobs=dp:2", "--backend=local"], "--backend is a flag of `run`, `gpcnet`, not of `place`"),
])
def test_a_flag_of_another_mode_is_refused_in_one_line(mode, args, message):
  assert one_line_error(study(mode, *args)) == f"microbench-study: error: {message}"


def test_proxys_old_out_is_refused_naming_records():
  line = one_line_error(study("proxy", "--strategy=dp", "--out=x.jsonl"))
  assert line.startswith("microbench-study: error: --out is --records in `proxy`"), line


@pytest.mark.parametrize("args,message", [
    (["plan", "--frobnicate"], "Unknown command line flag 'frobnicate'"),
    (["frobnicate"], "want one mode of plan, predict, place, run, report, proxy, schedule, gpcnet"),
    ([], "(got none)"),
    (["plan", "extra", "--out=x"], "want one mode of"),
])
def test_unknown_flags_and_modes_are_one_line(args, message):
  assert message in one_line_error(study(*args))
