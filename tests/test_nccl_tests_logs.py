"""nccl-tests' output of several versions read into records (report/nccl_tests.py). The fixtures follow the
formats public logs show: the column layouts of old and new versions, NCCL INFO lines between rows, several runs
in one log, `N/A` and `0e+00` in the correctness column."""

from __future__ import annotations

import pytest

from microbench.report import nccl_tests

# nccl-tests 2.13 and later: redop and root columns, #wrong, the binary named, NCCL INFO lines in between; two runs.
NEW = """\
# Collective test starting: all_reduce_perf
# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid   6899 on     node01 device  0 [0000:04:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   6900 on     node01 device  1 [0000:05:00] NVIDIA H100 80GB HBM3
node01:6899:6899 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
node01:6899:6899 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    10.51    0.00    0.00      0    10.22    0.00    0.00      0
node01:6899:6912 [0] NCCL INFO Channel 00/24 :    0   1
    16777216       4194304     float     sum      -1    95.30  176.04  176.04      0    94.87  176.84  176.84      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 88.02
#
# Collective test starting: all_gather_perf
# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1048576 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
#  Rank  0 Group  0 Pid   7001 on     node01 device  0 [0000:04:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   7002 on     node01 device  1 [0000:05:00] NVIDIA H100 80GB HBM3
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
     1048576        131072  bfloat16    none      -1    12.00   87.38   43.69      0    11.50   91.18   45.59    N/A
# Out of bounds values : 0 OK
"""

# nccl-tests 2.0-2.10: no root column, the correctness column as a maximum error, no binary named.
OLD = """\
# nThread 1 nGpus 8 minBytes 8 maxBytes 1048576 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
# Using devices
#   Rank  0 Pid  12001 on    dgx-01 device  0 [0x07] Tesla V100-SXM2-32GB
#
#                                                     out-of-place                       in-place
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576        262144   float     sum    36.82   28.48   49.84  5e-07    36.49   28.74   50.29  5e-07
# Out of bounds values : 0 OK
"""

# all_gather before the redop column: size count type, then the two groups.
OLDEST_ALL_GATHER = """\
#       size         count    type     time   algbw   busbw  error     time   algbw   busbw  error
     4194304        131072   float    40.10  104.60   91.52  0e+00    39.80  105.38   92.21  0e+00
"""


def test_new_versions_two_runs_and_nccl_info_lines():
  recs, errors = nccl_tests.read(NEW)
  assert errors == []
  assert [(r["collective"], r["bytes"], r["run"]) for r in recs] == [
      ("all_reduce", 8, 0), ("all_reduce", 16777216, 0), ("all_gather", 1048576, 1)]
  big = recs[1]
  assert (big["count"], big["dtype"], big["redop"], big["root"]) == (4194304, "float32", "sum", -1)
  assert (big["time_us"], big["algbw_gbps"], big["busbw_gbps"], big["wrong"]) == (95.30, 176.04, 176.04, 0)
  assert (big["inplace_time_us"], big["inplace_busbw_gbps"], big["inplace_wrong"]) == (94.87, 176.84, 0)
  assert big["ranks"] == 2 and big["devices"] == ["NVIDIA H100 80GB HBM3"]
  ag = recs[2]
  assert ag["dtype"] == "bfloat16" and ag["redop"] is None and ag["inplace_wrong"] is None  # N/A
  assert ag["busbw_gbps"] == 43.69 and ag["line"] == 26


def test_old_versions_follow_their_own_header():
  """A reader with the new layout's fixed columns would take the old table's time for a root and its busbw for
  an algbw: every value here sits one column left of where the new layout puts it."""
  recs, errors = nccl_tests.read(OLD, collective="all_reduce_perf")
  assert errors == [] and len(recs) == 1
  r = recs[0]
  assert "root" not in r and (r["time_us"], r["algbw_gbps"], r["busbw_gbps"]) == (36.82, 28.48, 49.84)
  assert r["wrong"] == pytest.approx(5e-07) and r["inplace_busbw_gbps"] == 50.29 and r["ranks"] == 1
  recs, errors = nccl_tests.read(OLDEST_ALL_GATHER, collective="all_gather")
  assert errors == [] and recs[0]["busbw_gbps"] == 91.52 and recs[0]["wrong"] == 0.0 and "redop" not in recs[0]


def test_a_log_that_does_not_name_its_collective_says_how_to():
  recs, errors = nccl_tests.read(OLD, source="dgx.log")
  assert recs == [] and len(errors) == 1
  assert errors[0].startswith("dgx.log:9:") and "name it, e.g. all_reduce=dgx.log" in errors[0]


def test_a_bad_row_is_one_line_naming_it_and_nothing_else_is_lost():
  cut = NEW.replace("    16777216       4194304     float     sum      -1    95.30  176.04  176.04      0    94.87",
                    "    16777216       4194304     float     sum      -1    95.30  176.04")
  recs, errors = nccl_tests.read(cut, source="job.out")
  assert [r["bytes"] for r in recs] == [8, 1048576]  # the rows before and after are kept
  assert len(errors) == 1 and errors[0].startswith("job.out:15: 10 fields where the header has 13: 16777216 ")
  garbled = NEW.replace("95.30  176.04  176.04", "95.30  fast  176.04")
  recs, errors = nccl_tests.read(garbled, source="job.out")
  assert errors == ["job.out:15: algbw_gbps 'fast' is not a number"] and len(recs) == 2
  headless = "\n".join(line for line in NEW.splitlines()[:17] if "size" not in line)
  recs, errors = nccl_tests.read(headless, source="x.log")
  assert recs == [] and errors == ["x.log:12: a result row before nccl-tests' column header",
                                   "x.log:14: a result row before nccl-tests' column header"]


def test_files_that_cannot_be_read_or_hold_no_table_are_one_line(tmp_path):
  with pytest.raises(nccl_tests.NcclTestsError, match="cannot read nccl-tests log .*missing.log"):
    nccl_tests.read_file(str(tmp_path / "missing.log"))
  (tmp_path / "empty.log").write_text("node01:1:1 [0] NCCL INFO NCCL version 2.21.5\n")
  with pytest.raises(nccl_tests.NcclTestsError, match="no nccl-tests result rows"):
    nccl_tests.read_file(str(tmp_path / "empty.log"))
  (tmp_path / "ok.log").write_text(NEW)
  recs, errors = nccl_tests.read_file(str(tmp_path / "ok.log"))
  assert len(recs) == 3 and not errors


@pytest.mark.parametrize("name,want", [("all_reduce_perf", "all_reduce"), ("./build/alltoall_perf_mpi", "all_to_all"),
                                       ("sendrecv_perf", "ppermute"), ("all_gather", "all_gather")])
def test_binaries_map_to_collective_names(name, want):
  assert nccl_tests.collective_of(name) == want


def _jax_point(busbw, samples, size=16777216, n=2, dtype="float32"):
  time_us = float(sorted(samples)[len(samples) // 2]) if samples else 100.0
  return {"collective": "all_reduce", "dtype": dtype, "bytes": size, "scope": "scale_up", "group_size": n,
          "busbw_gbps": busbw, "time_us": time_us, "samples_us": samples}


def test_a_jax_point_beside_nccl_tests_says_slower_only_beyond_its_noise():
  recs, _ = nccl_tests.read(NEW)
  steady = [95.0, 95.2, 95.1, 94.9, 95.3, 95.0]
  slow = nccl_tests.compare([_jax_point(88.0, steady)], recs)
  assert len(slow) == 1 and slow[0][2] == 16777216 and slow[0][6] == 176.04
  assert slow[0][8] == pytest.approx(88.0 / 176.04) and slow[0][10] == "JAX slower"
  same = nccl_tests.compare([_jax_point(176.0, steady)], recs)[0]
  assert same[10] == "same within noise"
  noisy = nccl_tests.compare([_jax_point(150.0, [60.0, 95.0, 140.0, 70.0, 120.0])], recs)[0]
  assert noisy[10] == "same within noise"  # a wide spread resolves nothing
  assert nccl_tests.compare([_jax_point(150.0, [])], recs)[0][10] == "unknown (no samples)"
  # Another size, dtype or group size is not the same measurement.
  assert nccl_tests.compare([_jax_point(150.0, steady, size=8 << 20)], recs) == []
  assert nccl_tests.compare([_jax_point(150.0, steady, dtype="bfloat16")], recs) == []
  assert nccl_tests.compare([_jax_point(150.0, steady, n=8)], recs) == []
