"""nccl-tests' output of several versions read into records (report/nccl_tests.py). The fixtures follow the
formats public logs show: the column layouts of old and new versions, NCCL INFO lines between rows, several runs
in one log, `N/A` and `0e+00` in the correctness column."""

from __future__ import annotations

import os

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


# nccl-tests 2.19.6 (JSON format 3): -J with -I 1 under MPI, 2 processes of one GPU each, as its writer prints it
# (one line, doubles as %lf, root as a padded string, nwrong a double, the per-iteration times of every iteration
# and of every process).
JSON_V3 = (
    '{"version":3,"start_time":"2026-07-10 09:12:01","args":["./build/all_reduce_perf","-b","1M","-e","2M",'
    '"-f","2","-g","1","-I","1","-K","1","-n","4","-J","ar.json"],"env":["NCCL_DEBUG=WARN"],'
    '"nccl_version":22703,"config":{"nthreads":1,"ngpus":1,"minimum_bytes":1048576,"maximum_bytes":2097152,'
    '"step_factor":2,"warmup_iters":1,"iterations":4,"aggregated_iterations":1,"validation":1,"graph":0,'
    '"blocking_collectives":"false","per_iter_timing":"true","per_iter_skip":1,"parallel_init":"false",'
    '"devices":[{"rank":0,"group":0,"pid":4101,"hostname":"node01","device":0,"device_hex":"0000:18:00",'
    '"device_info":"NVIDIA H100 80GB HBM3"},{"rank":1,"group":0,"pid":4102,"hostname":"node02","device":0,'
    '"device_hex":"0000:18:00","device_info":"NVIDIA H100 80GB HBM3"}]},"results":['
    '{"size":1048576,"count":262144,"type":"float","redop":"sum","root":"    -1",'
    '"out_of_place":{"time":30.250000,"alg_bw":34.663700,"bus_bw":34.663700,"nwrong":0.000000},'
    '"out_of_place_per_iter":{"skipped_iterations":1,"min_us":29.900000,"max_us":30.700000,"avg_us":30.233333,'
    '"p50_us":30.100000,"p95_us":30.700000,"p99_us":30.700000,"stdev_us":0.340000,"cv_pct":1.120000,'
    '"times_us":[95.000000,30.100000,29.900000,30.700000],'
    '"per_process_max_times_us":[[95.000000,30.100000,29.900000,30.700000],[94.100000,30.000000,29.800000,30.500000]]},'
    '"in_place":{"time":30.010000,"alg_bw":34.940900,"bus_bw":34.940900,"nwrong":0.000000},'
    '"actual_iterations":4,"experiment_name":""},'
    '{"size":2097152,"count":524288,"type":"float","redop":"sum","root":"    -1",'
    '"out_of_place":{"time":52.000000,"alg_bw":40.329800,"bus_bw":40.329800,"nwrong":0.000000},'
    '"out_of_place_per_iter":{"skipped_iterations":1,"min_us":51.000000,"max_us":53.000000,"avg_us":52.000000,'
    '"p50_us":52.000000,"p95_us":53.000000,"p99_us":53.000000,"stdev_us":0.816000,"cv_pct":1.570000,'
    '"times_us":[140.000000,51.000000,52.000000,53.000000]},'
    '"in_place":{"time":51.500000,"alg_bw":40.721400,"bus_bw":40.721400,"nwrong":null},'
    '"actual_iterations":4,"experiment_name":""}],'
    '"out_of_bounds":{"count":0,"okay":true},"average_bus_bandwidth":{"bandwidth":37.663925,"okay":"unchecked"},'
    '"errors":[],"end_time":"2026-07-10 09:12:03"}')

# nccl-tests 2.17.8 (format 1): one process driving 8 GPUs, no per-iteration data, bfloat16 all_gather, the
# summary's key misspelt as that version wrote it.
JSON_V1 = (
    '{"version":1,"start_time":"2025-10-20 14:00:00","args":["/opt/nccl-tests/build/all_gather_perf","-g","8",'
    '"-d","bfloat16","-b","8M","-e","8M","-J","ag.json"],"env":[],"nccl_version":22603,"config":{"nthreads":1,'
    '"ngpus":8,"minimum_bytes":8388608,"maximum_bytes":8388608,"step_factor":2,"warmup_iters":5,"iterations":20,'
    '"aggregated_iterations":1,"validation":1,"graph":0,"blocking_collectives":"false","parallel_init":"false",'
    '"devices":[{"rank":0,"group":0,"pid":900,"hostname":"dgx1","device":0,"device_hex":"0000:07:00",'
    '"device_info":"NVIDIA A100-SXM4-80GB"}]},"results":[{"size":8388608,"count":524288,"type":"bfloat16",'
    '"redop":"none","root":"    -1","out_of_place":{"time":61.200000,"alg_bw":137.065000,"bus_bw":119.932000,'
    '"nwrong":0.000000},"in_place":{"time":60.800000,"alg_bw":137.967000,"bus_bw":120.721000,"nwrong":0.000000},'
    '"actual_iterations":20,"experiment_name":""}],"out_of_bounds":{"count":0,"okay":true},'
    '"average_bus_bandwidith":{"bandwidith":120.326500,"okay":"unchecked"},"errors":[],'
    '"end_time":"2025-10-20 14:00:01"}')


def test_json_output_with_per_iteration_times():
  recs, errors = nccl_tests.read_json(JSON_V3, source="ar.json")
  assert errors == [] and [r["bytes"] for r in recs] == [1048576, 2097152]
  r = recs[0]
  assert (r["collective"], r["dtype"], r["redop"], r["root"], r["count"]) == ("all_reduce", "float32", "sum", -1,
                                                                              262144)
  assert (r["time_us"], r["busbw_gbps"], r["wrong"], r["inplace_busbw_gbps"]) == (30.25, 34.6637, 0.0, 34.9409)
  assert r["ranks"] == 2 and r["devices"] == ["NVIDIA H100 80GB HBM3"] and r["nccl_version"] == "2.27.3"
  assert r["samples_us"] == [30.1, 29.9, 30.7]  # the warm-up iteration -K 1 skipped is not a sample
  assert "inplace_samples_us" not in r and recs[1]["inplace_wrong"] is None  # nwrong null: not checked


def test_json_of_the_first_format_and_one_process_of_eight_gpus():
  recs, errors = nccl_tests.read_json(JSON_V1)
  assert errors == [] and len(recs) == 1
  r = recs[0]
  assert (r["collective"], r["dtype"], r["redop"], r["ranks"]) == ("all_gather", "bfloat16", None, 8)
  assert r["busbw_gbps"] == 119.932 and "samples_us" not in r


def test_malformed_json_is_one_line_and_the_rest_is_used(tmp_path):
  cut = JSON_V3[:JSON_V3.index('{"size":2097152') + 60]  # the job died writing the second result
  recs, errors = nccl_tests.read_json(cut, source="ar.json")
  assert [r["bytes"] for r in recs] == [1048576] and recs[0]["collective"] == "all_reduce"
  assert len(errors) == 1 and errors[0].startswith("ar.json: not valid JSON")
  assert "results[1]" in errors[0] and "1 result(s) read" in errors[0]
  inf = JSON_V3.replace('"bus_bw":34.663700', '"bus_bw":inf')  # %lf prints an infinity so
  recs, errors = nccl_tests.read_json(inf, source="ar.json")
  assert [r["bytes"] for r in recs] == [2097152]
  assert len(errors) == 1 and "results[0]" in errors[0] and "\n" not in errors[0]
  odd = JSON_V3.replace('{"size":1048576,', '{"size":"1M",')
  recs, errors = nccl_tests.read_json(odd, source="ar.json")
  assert [r["bytes"] for r in recs] == [2097152] and errors == ["ar.json: results[0]: not a result object with an"
                                                                " integer size"]
  nameless = JSON_V3.replace('"./build/all_reduce_perf",', "")
  assert nccl_tests.read_json(nameless, source="x.json")[1] == [
      "x.json: the file does not say which collective it ran (no binary in 'args'): name it, e.g. all_reduce=x.json"]
  assert nccl_tests.read_json(nameless, "all_reduce")[0][0]["collective"] == "all_reduce"
  (tmp_path / "ar.json").write_text(JSON_V3)
  (tmp_path / "empty.json").write_text('{"version":3,"results":[]}')
  assert len(nccl_tests.read_file(str(tmp_path / "ar.json"))[0]) == 2
  with pytest.raises(nccl_tests.NcclTestsError, match="empty 'results'"):
    nccl_tests.read_file(str(tmp_path / "empty.json"))


PER_ITER = """\
# Collective test starting: all_reduce_perf
# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1048576 step: 2(factor) warmup iters: 1 iters: 4 agg iters: 1 validation: 1 graph: 0 unalign: 0
# Per-Iteration Report: CUDA event timing; i_* uses max over process rows
#                                                        out-of-place (+ per-iteration)                                in-place (+ per-iteration)
#       size         count      type   redop    root     time   algbw   busbw  #wrong    i_min    i_max    i_p99    i_cv%     time   algbw   busbw  #wrong    i_min    i_max    i_p99    i_cv%  timestamp
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)     (us)     (us)      (%)     (us)  (GB/s)  (GB/s)             (us)     (us)     (us)      (%)  %Y-%m-%d %H:%M:%S
     1048576        262144     float     sum      -1    30.25   34.66   34.66       0    29.90    30.70    30.70     1.12    30.01   34.94   34.94       0    29.80    30.40    30.40     0.90  2026-07-10 09:12:02
"""


def test_text_with_per_iteration_columns_and_timestamps():
  recs, errors = nccl_tests.read(PER_ITER)
  assert errors == [] and len(recs) == 1
  r = recs[0]
  assert (r["busbw_gbps"], r["iter_min_us"], r["iter_cv_pct"], r["inplace_busbw_gbps"]) == (34.66, 29.9, 1.12, 34.94)
  assert r["timestamp"] == "2026-07-10 09:12:02"
  cpu = PER_ITER.replace(" time   algbw", " cputime   algbw")
  assert nccl_tests.read(cpu)[0][0]["time_us"] == 30.25


def test_nccl_tests_samples_widen_the_interval_and_can_decide_it():
  """With nccl-tests' per-iteration times (JSON, -I 1) both sides' noise is in the interval: a steady JAX point
  against a noisy nccl-tests one resolves less than against their average alone."""
  theirs, _ = nccl_tests.read_json(JSON_V3)
  jax = [_jax_point(30.0, [30.2, 30.1, 30.3, 30.2, 30.25, 30.15], size=1048576)]
  text_only = [{k: v for k, v in r.items() if k != "samples_us"} for r in theirs]
  one = nccl_tests.matches(jax, text_only)[0]
  both = nccl_tests.matches(jax, theirs)[0]
  assert one["noise"] == "JAX samples only" and both["noise"] == "both sides' samples"
  assert (both["hi"] - both["lo"]) > 2 * (one["hi"] - one["lo"])
  noisy = [dict(theirs[0], samples_us=[10.0, 60.0, 25.0, 40.0])]
  assert nccl_tests.matches([_jax_point(30.0, [], size=1048576)], noisy)[0]["noise"] == "nccl-tests samples only"


def test_intervals_hold_together_over_the_points():
  """Bonferroni: the same point's interval is wider when it is one of many (a per-point 95% would mark about
  one in twenty of a healthy comparison)."""
  recs, _ = nccl_tests.read(NEW)
  point = _jax_point(170.0, [95.0, 95.4, 94.6, 95.8, 94.2, 95.0])
  alone = nccl_tests.matches([point], recs)[0]
  many = nccl_tests.matches([point] * 40, recs)[0]
  assert many["lo"] < alone["lo"] and many["hi"] > alone["hi"]


@pytest.mark.slow
def test_report_draws_json_output_beside_a_sweep_in_a_figure_and_tensorboard(tmp_path):
  """`microbench-report RUN --nccl_tests=ar.json`: the table, OUT/nccl_tests.png, and the TensorBoard run
  OUT/nccl-tests whose busbw tags are the sweep's own (so its charts draw nccl-tests beside JAX) with the ratio
  and its bounds; a JSON file cut short is one line on stderr, and what it holds is still used."""
  import re  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  from tensorboard.plugins.custom_scalar import layout_pb2  # pylint: disable=g-import-not-at-top
  from support import ROOT, clean_env  # pylint: disable=g-import-not-at-top
  from microbench.output import run_folder  # pylint: disable=g-import-not-at-top
  from test_report import synthetic_records, write_sweep  # pylint: disable=g-import-not-at-top
  recs = synthetic_records(20.0, 40.0, collectives=("all_reduce",), scopes=(("scale_up", 2),),
                           sizes=[1 << 20, 1 << 21], samples=8, sample_noise=0.01)
  run = write_sweep(tmp_path / "A", recs) or str(tmp_path / "A")
  cut = tmp_path / "cut.json"
  cut.write_text(JSON_V3[:JSON_V3.index('{"size":2097152') + 60])
  (tmp_path / "ar.json").write_text(JSON_V3)
  r = subprocess.run([sys.executable, "-m", "microbench.cli.report", run, f"--out={tmp_path / 'rep'}",
                      f"--nccl_tests={tmp_path / 'ar.json'},{cut}"], capture_output=True, text=True, timeout=120,
                     env=clean_env(), cwd=ROOT)
  assert r.returncode == 0, r.stderr
  assert [x for x in r.stderr.splitlines() if "microbench-report:" in x] == [
      x for x in r.stderr.splitlines() if x.startswith(f"microbench-report: {cut}: not valid JSON")]
  assert len(re.findall(r"^\| all_reduce \| float32 \| 1048576 \|", r.stdout, re.M)) == 2  # both files' 1M
  assert (tmp_path / "rep" / "nccl_tests.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  folder = tmp_path / "rep" / "nccl-tests"
  acc = event_accumulator.EventAccumulator(str(folder), size_guidance={"tensors": 0, "scalars": 0, "images": 0})
  acc.Reload()
  base = "all_reduce/scale_up/float32"
  busbw = [(e.step, round(e.value, 4)) for e in acc.Scalars(f"busbw_gbps/{base}")]
  assert busbw == [(run_folder.size_step(1 << 20), 34.6637), (run_folder.size_step(1 << 21), 40.3298)]
  ratio = {e.step: e.value for e in acc.Scalars(f"nccl_tests_ratio/{base}")}
  lo = {e.step: e.value for e in acc.Scalars(f"nccl_tests_ratio_lo/{base}")}
  hi = {e.step: e.value for e in acc.Scalars(f"nccl_tests_ratio_hi/{base}")}
  assert ratio.keys() == lo.keys() == hi.keys() and all(lo[s] <= ratio[s] <= hi[s] for s in ratio)
  assert acc.Tags()["images"] == ["nccl_tests/figure"]
  layout = layout_pb2.Layout()
  layout.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
  ratio_chart = layout.category[0].chart[0].multiline.tag[0]
  assert re.match(ratio_chart, f"nccl_tests_ratio_hi/{base}") and not re.match(ratio_chart, f"busbw_gbps/{base}")
  # The sweep's own busbw chart (written by every sweep) picks up nccl-tests' line: the same tag.
  charts = [tags for _, cs in run_folder.sweep_layout(["all_reduce"], ["scale_up"]) for _, tags in cs]
  assert any(re.match(t, f"busbw_gbps/{base}") for tags in charts for t in tags)
  # Writing the report again replaces the run's events rather than doubling every point.
  subprocess.run([sys.executable, "-m", "microbench.cli.report", run, f"--out={tmp_path / 'rep'}",
                  f"--nccl_tests={tmp_path / 'ar.json'}"], capture_output=True, timeout=120, env=clean_env(), cwd=ROOT,
                 check=True)
  assert len([n for n in os.listdir(folder) if n.startswith("events.")]) == 1


def test_the_figure_draws_every_series_and_its_intervals():
  from microbench.report import nccl_tests_views  # pylint: disable=g-import-not-at-top
  theirs, _ = nccl_tests.read_json(JSON_V3)
  jax = [_jax_point(30.0, [30.2, 30.1, 30.3, 30.2], size=1048576), _jax_point(41.0, [51.0, 51.2, 50.9], size=2097152)]
  points = nccl_tests.matches(jax, theirs)
  fig = nccl_tests_views.figure(points)
  bw, ratio = fig.axes[0], fig.axes[1]
  assert [t.get_text() for t in bw.get_legend().get_texts()] == ["nccl-tests float32 (n=2)",
                                                                   "JAX scale_up/float32 (n=2)"]
  lines = {line.get_label(): list(line.get_ydata()) for line in bw.get_lines()}
  assert lines["JAX scale_up/float32 (n=2)"] == [30.0, 41.0] and lines["nccl-tests float32 (n=2)"] == [34.6637, 40.3298]
  assert lines["_in-place"] == [34.9409, 40.7214]
  # Two scopes matching the same rows: nccl-tests drawn once.
  two = nccl_tests.matches(jax + [dict(p, scope="global") for p in jax], theirs)
  labels = [x.get_label() for x in nccl_tests_views.figure(two).axes[0].get_lines()]
  assert labels.count("nccl-tests float32 (n=2)") == 1
  assert list(ratio.get_lines()[0].get_ydata()) == pytest.approx([30.0 / 34.6637, 41.0 / 40.3298])
  assert len(ratio.collections) == 1  # the intervals' bars
  assert "both sides' samples" in fig._suptitle.get_text()  # pylint: disable=protected-access
