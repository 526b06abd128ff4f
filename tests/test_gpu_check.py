"""scripts/gpu_check.py, the one-GPU self-check, runs its whole path on CPU (`--smoke`) and writes its report."""

import json
import subprocess
import sys

import pytest

from support import ROOT, clean_env

pytestmark = pytest.mark.slow


def test_gpu_check_smoke_on_cpu(tmp_path):
  out = tmp_path / "gpu_check.json"
  r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", f"--out={out}"], capture_output=True,
                     text=True, timeout=300, env=clean_env(), cwd=ROOT)
  assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
  report = json.loads(out.read_text())
  assert {report[item]["verdict"] for item in "abcd"} == {"pass"}
  # (a): the toolkit's loop carries XLA's known trip count; the old runtime-bound loop has none.
  assert report["a"]["timed_loop_trip_counts"] == [500] and report["a"]["runtime_bound_loop_trip_counts"] == [None]
  # (b): microseconds per repetition from k=10 vs k=1000, for both loop kinds.
  assert isinstance(report["b"]["known_trip_count"]["per_rep_us"], float) and "runtime_trip_count" in report["b"]
  # (c): one device, nothing recorded.
  assert report["c"]["records"] == 0 and report["c"]["said_degenerate"]
  for item in "abcd":
    assert f"gpu_check ({item})" in r.stdout
