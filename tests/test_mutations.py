"""The proof of the correctness check: deliberately wrong collectives, through the same build/check path,
are caught in every dtype and group size (tests/_mutations.py, in its own process with 72 CPU devices)."""

import json
import subprocess
import sys

import pytest

from support import ROOT, clean_env

pytestmark = pytest.mark.slow

WRONG = ("all_reduce missing", "all_reduce counting", "reduce_scatter missing", "reduce_scatter counting",
         "all_gather with", "all_to_all with", "broadcast from", "ppermute shifted", "all_reduce that never",
         "all_reduce computing", "all_reduce negating", "all_reduce output shifted", "all_reduce leaving",
         "reduce_scatter delivering", "all_reduce summing in a narrower", "reduce_scatter computing")


def test_every_wrong_collective_is_caught_and_every_real_one_passes():
  r = subprocess.run([sys.executable, "tests/_mutations.py"], capture_output=True, text=True, timeout=600,
                     env=clean_env(), cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  results = json.loads(r.stdout.strip().splitlines()[-1])
  print(f"mutation run: {results.pop('seconds'):.1f} s")
  # (16 wrong + 6 real) collectives x 4 dtypes x 5 group sizes, less the narrower-type mutant in bfloat16;
  # operators: 20 swapped all-reduce pairs, 5 reduce-scatter ones, 4 missing ranks, 8 real (max, min, prod, avg
  # of both), each in 4 dtypes but none with avg in int32 (refused): 8 + 1 + 1 + 2 of them; at 3 group sizes.
  assert len(results) == (22 * 4 - 1) * 5 + (37 * 4 - 12) * 3
  missed = [k for k, wrong in results.items() if k.startswith(WRONG) and wrong == 0]
  false_alarms = [k for k, wrong in results.items() if not k.startswith(WRONG) and wrong != 0]
  assert not missed, f"wrong collectives that passed the check: {missed}"
  assert not false_alarms, f"real collectives that failed the check: {false_alarms}"
