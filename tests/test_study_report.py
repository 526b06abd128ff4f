"""The study report's aggregates weigh jobs, not samples, and compare baselines like for like. Planted cases:
three jobs slowed 3x beside one unaffected rack-local job that, iterating fast, gives most of the samples (pooled,
the cell read ~0%); a 2- and 8-GPU DP baseline in one placement class beside an 8-GPU one in another (pooled
over placements, the efficiency measured the placement). Pooling variants are shown to fail the same checks."""

from __future__ import annotations

import statistics

import pytest

from microbench.study import sigma_report, stats

BASE_THR = 100.0


def _samples(unit, kind, job, key, thr, n, experiment=None):
  return [sigma_report.Sample(unit, kind, experiment, job, key, 0, i, thr * (1 + 0.001 * (i % 5)), 1.0, 0.1)
          for i in range(n)]


def _mix():
  """One experiment: j0-j2 (8 samples each) 3x slower than alone, j3 rack-local, 116 samples, unaffected."""
  keys = {f"j{i}": ("dp", "vit-h", 4, "inter-group") for i in range(3)}
  keys["j3"] = ("fsdp", "llama3-8b", 2, "intra-l1")
  samples = []
  for job, key in keys.items():
    samples += _samples(f"b-{job}", "baseline", job, key, BASE_THR, 10)
  for job in ("j0", "j1", "j2"):
    samples += _samples("e000", "concurrent", job, keys[job], BASE_THR / 3, 8, "e000")
  samples += _samples("e000", "concurrent", "j3", keys["j3"], BASE_THR, 116, "e000")
  units = {"e000": {"unit": "e000", "kind": "concurrent", "meta": {"placement_bin": "low", "entropy_bin": "high"},
                    "jobs": [], "ended": "done"}}
  units.update({f"b-{j}": {"unit": f"b-{j}", "kind": "baseline", "jobs": []} for j in keys})
  return samples, units


def _check_cell(cells):
  """Three of four jobs ran ~200% slower: the cell's figure is theirs, with four jobs and 140 samples."""
  jobs = cells[("low", "high")]
  assert len(jobs) == 4 and sum(j.n_samples for j in jobs) == 140
  assert sigma_report.cell_median(jobs) == pytest.approx(200.0, abs=2.0)
  assert statistics.fmean(j.median_pct for j in jobs) == pytest.approx(150.0, abs=2.0)


def test_slowdown_cells_weigh_each_job_once():
  samples, units = _mix()
  slow = sigma_report.slowdowns(samples, sigma_report.by_key(samples))
  assert len(slow) == 140
  assert statistics.median(v for _, v in slow) == pytest.approx(0.0, abs=1.0)  # what pooling reported
  _check_cell(sigma_report.bin_cells(slow, units))


def test_pooled_samples_fail_the_cell_check():
  """Mutation: every sample its own 'job' (the old pooling) reads ~0% and must fail."""
  samples, units = _mix()
  slow = sigma_report.slowdowns(samples, sigma_report.by_key(samples))
  pooled = {("low", "high"): [sigma_report.JobSlowdown(s.unit, s.job, v, 1) for s, v in slow]}
  with pytest.raises(AssertionError):
    _check_cell(pooled)


def test_markdown_states_the_weighting():
  samples, units = _mix()
  keys = sigma_report.by_key(samples)
  cells = sigma_report.bin_cells(sigma_report.slowdowns(samples, keys), units)
  md = sigma_report.markdown(keys, units, cells, {}, [], "")
  assert "over jobs" in md
  row = next(line for line in md.splitlines() if line.startswith("| low |"))
  assert row.split("|")[4].strip().startswith("200.") and "4 jobs, 140 samples" in row


def _baselines():
  return (_samples("b0", "baseline", "j0", ("dp", "vit-h", 2, "intra-l1"), 100.0, 6)
          + _samples("b1", "baseline", "j0", ("dp", "vit-h", 8, "intra-l1"), 380.0, 6)
          + _samples("b2", "baseline", "j0", ("dp", "vit-h", 8, "inter-group"), 136.0, 6)
          + _samples("b3", "baseline", "j0", ("fsdp", "llama3-8b", 2, "intra-l1"), 7.0, 6))


def _check_scaling(scaling):
  """The intra-l1 DP series scales at 0.95; the lone inter-group and FSDP baselines have no reference."""
  (g0, t0), (g, t) = scaling[("dp", "vit-h", "intra-l1")]
  assert (g0, g) == (2, 8) and (t / t0) * (g0 / g) == pytest.approx(0.95, rel=0.01)
  assert [g for g, _ in scaling[("dp", "vit-h", "inter-group")]] == [8]
  assert [g for g, _ in scaling[("fsdp", "llama3-8b", "intra-l1")]] == [2]


def test_scaling_compares_one_placement_class():
  scaling = sigma_report.baseline_scaling(_baselines())
  _check_scaling(scaling)
  md = sigma_report.markdown({}, {}, {}, scaling, [], "")
  rows = {tuple(c.strip() for c in line.split("|")[1:5]): line.split("|")[6].strip() for line in md.splitlines()
          if line.startswith(("| dp |", "| fsdp |"))}
  assert rows == {("dp", "vit-h", "intra-l1", "2"): "ref.", ("dp", "vit-h", "intra-l1", "8"): "0.95",
                  ("dp", "vit-h", "inter-group", "8"): "-", ("fsdp", "llama3-8b", "intra-l1", "2"): "-"}
  assert "like for like" in md


def test_scaling_pooled_over_placements_fails_the_check():
  """Mutation: the old per-strategy pooling (geomean over placements at each GPU count) must fail."""
  per: dict[tuple, dict[int, list[float]]] = {}
  for s in _baselines():
    per.setdefault((s.key[0], s.key[1], "intra-l1"), {}).setdefault(s.key[2], []).append(s.throughput)
  pooled = {k: [(g, stats.geomean(v)) for g, v in sorted(d.items())] for k, d in per.items()}
  pooled[("dp", "vit-h", "inter-group")] = [(8, 136.0)]
  with pytest.raises(AssertionError):
    _check_scaling(pooled)
