"""scripts/validate_collectives.py matches predictions to measured points by the requested size: at 6 ranks an
all-gather's 1 MiB is measured as 1048560 B, and matching on `bytes` lost such points without a word."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


@pytest.fixture(scope="module")
def script():
  spec = importlib.util.spec_from_file_location(
      "validate_collectives", os.path.join(ROOT, "scripts", "validate_collectives.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _rec(coll: str, requested: int, n: int, time_us: float, **extra) -> dict:
  """A record as the sweep writes it: the size rounded down to a multiple of n float32 elements."""
  count = requested // 4 // n * n
  return {"collective": coll, "scope": "scale_out", "dtype": "float32", "requested_bytes": requested,
          "bytes": count * 4, "count": count, "group_size": n, "status": "ok", "wrong": 0, "time_us": time_us,
          **extra}


@pytest.fixture
def six_rank_run(tmp_path):
  recs = [_rec("all_reduce", MiB, 6, 100.0), _rec("all_gather", MiB, 6, 200.0),
          _rec("all_gather", 4 * MiB, 6, 700.0, also_requested=[4 * MiB + 8]),
          _rec("all_gather", 16 * MiB, 6, 2800.0, status="failed", reason="compile failed: OOM")]
  (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  return str(tmp_path)


PRED = {("all_reduce", MiB): (110.0, "ring", "host"), ("all_gather", MiB): (190.0, "ring", "host"),
        ("all_gather", 4 * MiB + 8): (690.0, "ring", "host"), ("all_gather", 16 * MiB): (2700.0, "ring", "host"),
        ("all_reduce", 4 * MiB): (400.0, "ring", "host")}


def test_rounded_sizes_are_matched_and_every_dropped_point_is_named(script, six_rank_run):
  rows, dropped = script.compare(PRED, script.measured(six_rank_run))
  got = {(c, s): m for c, s, m, _ in rows}
  assert got[("all_gather", MiB)] == 200.0  # measured as 1048560 B
  assert got[("all_gather", 4 * MiB + 8)] == 700.0  # a size that rounded onto another's count
  assert got[("all_reduce", MiB)] == 100.0
  assert sorted(dropped) == [f"all_gather {16 * MiB} B: status failed: compile failed: OOM",
                             f"all_reduce {4 * MiB} B: not measured"]


def test_matching_on_bytes_would_fail_the_check(script, six_rank_run, monkeypatch):
  """Mutation: the old key (`bytes`) loses the 6-rank all-gathers; the check above must notice."""
  with open(os.path.join(six_rank_run, "results.jsonl"), encoding="utf-8") as f:
    recs = [json.loads(line) for line in f]
  monkeypatch.setattr(script, "measured", lambda out: {(r["collective"], r["bytes"]): r for r in recs})
  with pytest.raises(AssertionError):
    test_rounded_sizes_are_matched_and_every_dropped_point_is_named(script, six_rank_run)
