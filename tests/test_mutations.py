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


REAL_OPERATORS = tuple(f"{b}_{op}" for b in ("all_reduce", "reduce_scatter") for op in ("max", "min", "prod", "avg"))


@pytest.mark.long
def test_every_wrong_collective_is_caught_and_every_real_one_passes():
  r = subprocess.run([sys.executable, "tests/_mutations.py"], capture_output=True, text=True, timeout=600,
                     env=clean_env(), cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  results = json.loads(r.stdout.strip().splitlines()[-1])
  print(f"mutation run: {results.pop('seconds'):.1f} s")
  planned = results.pop("planned")
  assert len(results) == planned
  # Real collectives in every (dtype, group size) cell; every mutant in every dtype it allows and at every group
  # size of its kind (16 collective mutants at 5 sizes, 29 operator mutants at 3), though not in every pair.
  cells: dict[str, set[tuple[str, str]]] = {}
  for key in results:
    name, dtype, n = key.rsplit("/", 2)
    cells.setdefault(name, set()).add((dtype, n))
  for name, got in cells.items():
    dtypes, sizes = {d for d, _ in got}, {int(n) for _, n in got}
    operator = " for " in name or "missing the last rank (" in name or name.startswith(REAL_OPERATORS)
    assert sizes == ({2, 3, 18} if operator else {2, 3, 18, 32, 72}), f"{name}: group sizes {sorted(sizes)}"
    assert len(dtypes) == (3 if "narrower" in name or "avg" in name else 4), f"{name}: {sorted(dtypes)}"
    if not name.startswith(WRONG):
      assert len(got) == len(dtypes) * len(sizes), f"{name}: a real collective missed a cell"
  assert len([n for n in cells if n.startswith(WRONG)]) == 16 + 29
  missed = [k for k, wrong in results.items() if k.startswith(WRONG) and wrong == 0]
  false_alarms = [k for k, wrong in results.items() if not k.startswith(WRONG) and wrong != 0]
  assert not missed, f"wrong collectives that passed the check: {missed}"
  assert not false_alarms, f"real collectives that failed the check: {false_alarms}"
