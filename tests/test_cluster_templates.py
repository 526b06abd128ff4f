"""The SLURM templates without a cluster: every one parses, and slurm_nccl_tests.sbatch, run with srun, python and
nccl-tests' binaries replaced by stubs that record their arguments, gives nccl-tests and microbench the same
collectives, sizes, step and dtype, and hands the report every log. (Under a real SLURM, the sweep templates
run in tests/test_slurm.py and tests/test_gpu_binding.py.)"""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest

from support import ROOT
from microbench.bench import sizes
from microbench.report import nccl_tests

TEMPLATE = os.path.join(ROOT, "scripts", "slurm_nccl_tests.sbatch")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "scripts", "slurm_*.sbatch")))
                         + [os.path.join(ROOT, "scripts", "mpirun_example.sh")], ids=os.path.basename)
def test_templates_are_valid_bash(path):
  subprocess.run(["bash", "-n", path], check=True)


_RECORD = '#!/bin/bash\npython3 -c \'import json, sys; print(json.dumps(sys.argv[1:]))\' "{name}" "$@" >> "{calls}"\n'


def _run(tmp_path, template: str, args: list[str] = (), json_capable: bool = True, **env: str) -> list[list[str]]:
  """Runs `template` as sbatch would (SLURM's variables set) with stubs; returns every recorded call."""
  stubs, tests_dir, submit = tmp_path / "bin", tmp_path / "nccl-tests", tmp_path / "submit"
  for d in (stubs, tests_dir, submit):
    d.mkdir()
  calls = tmp_path / "calls.jsonl"
  for name in ("srun", "python"):
    (stubs / name).write_text(_RECORD.format(name=name, calls=calls))
    (stubs / name).chmod(0o755)
  for binary in ("all_reduce_perf", "all_gather_perf", "reduce_scatter_perf", "alltoall_perf", "broadcast_perf",
                 "sendrecv_perf"):  # their usage text is what the template looks for
    (tests_dir / binary).write_text("[-J,--output_file <file> write output]" if json_capable else "usage")
    (tests_dir / binary).chmod(0o755)
  base = {k: v for k, v in os.environ.items() if k in ("HOME", "LANG")}
  base.update(PATH=f"{stubs}:/usr/bin:/bin", SLURM_SUBMIT_DIR=str(submit), SLURM_JOB_NAME="microbench-nccl-tests",
              SLURM_JOB_ID="77", NCCL_TESTS_DIR=str(tests_dir), **env)
  r = subprocess.run(["bash", template, *args], capture_output=True, text=True, timeout=60, env=base, check=False)
  assert r.returncode == 0, r.stderr
  return [json.loads(line) for line in calls.read_text().splitlines()]


def _flags(argv: list[str]) -> dict[str, str]:
  return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def disagreements(calls: list[list[str]]) -> list[str]:
  """What nccl-tests and microbench were not both given: collectives, sizes (each tool's units), step, dtype,
  one process per GPU over the whole job, and every log handed to the report."""
  nccl = [c[1:] for c in calls if c[0] == "srun" and any(a.endswith("_perf") for a in c)]
  bench = [c for c in calls if c[0] == "srun" and "microbench" in c]
  report = [c for c in calls if c[0] == "python" and "microbench.cli.report" in c]
  if len(bench) != 1 or len(report) != 1 or not nccl:
    return [f"expected nccl-tests runs, one microbench and one report: {calls}"]
  mb, out = _flags(bench[0]), []
  ran = []
  for argv in nccl:
    binary = next(a for a in argv if a.endswith("_perf"))
    opts = dict(zip(argv[argv.index(binary) + 1::2], argv[argv.index(binary) + 2::2]))
    ran.append(nccl_tests.collective_of(binary))
    for flag, name, same in (("-b", "min_bytes", lambda a, b: sizes.parse_size(a) == sizes.parse_size(b)),
                             ("-e", "max_bytes", lambda a, b: sizes.parse_size(a) == sizes.parse_size(b)),
                             ("-f", "step_factor", lambda a, b: float(a) == float(b)),
                             ("-d", "dtype", lambda a, b: nccl_tests.DTYPES.get(a, a) == b)):
      if flag not in opts or not same(opts[flag], mb.get(name, "")):
        out.append(f"{binary} {flag} {opts.get(flag)} but microbench --{name}={mb.get(name)}")
    if opts.get("-g") != "1":
      out.append(f"{binary} -g {opts.get('-g')}: not one process per GPU")
  if sorted(ran) != sorted(mb.get("collectives", "").split(",")):
    out.append(f"nccl-tests ran {ran}, microbench --collectives={mb.get('collectives')}")
  if mb.get("scopes") != "global" or "--distributed" not in bench[0]:
    out.append(f"microbench over {mb.get('scopes')} (distributed: {'--distributed' in bench[0]}), not the whole job")
  specs = _flags(report[0]).get("nccl_tests", "").split(",")
  handed = {s.split("=", 1)[0]: s.split("=", 1)[1] for s in specs if "=" in s}
  if sorted(handed) != sorted(ran) or report[0][report[0].index("microbench.cli.report") + 1] != mb.get("outdir"):
    out.append(f"the report got {specs} for {report[0]}")
  for c in ran:
    argv = nccl[ran.index(c)]
    wrote = argv[argv.index("-J") + 1] if "-J" in argv else None
    if wrote and not handed.get(c, "").endswith(".log") and handed.get(c) != wrote:
      out.append(f"{c}: nccl-tests wrote {wrote}, the report reads {handed.get(c)}")
  return out


def test_nccl_tests_and_microbench_get_the_same_sweep(tmp_path):
  calls = _run(tmp_path, TEMPLATE, ["--iters=10"])
  assert disagreements(calls) == []
  assert len([c for c in calls if c[0] == "srun"]) == 5  # four collectives' nccl-tests, then microbench
  bench = next(c for c in calls if "microbench" in c)
  assert bench[-1] == "--iters=10" and "--kill-on-bad-exit=1" in bench
  assert all("-J" in c for c in calls if any(a.endswith("_perf") for a in c))


def test_the_settings_reach_both_tools(tmp_path):
  calls = _run(tmp_path, TEMPLATE, json_capable=False, COLLECTIVES="all_reduce,ppermute", MIN_BYTES="64K",
               MAX_BYTES="256M", STEP_FACTOR="4", DTYPE="bfloat16", SRUN_MPI="pmix")
  assert disagreements(calls) == []
  ar = next(c for c in calls if any(a.endswith("all_reduce_perf") for a in c))
  assert "--mpi=pmix" in ar and "-J" not in ar  # an older nccl-tests: its text log goes to the report
  report = next(c for c in calls if c[0] == "python")
  assert report[-1].endswith("all_reduce=runs/microbench-nccl-tests-77/nccl-tests/all_reduce.log,"
                             "ppermute=runs/microbench-nccl-tests-77/nccl-tests/ppermute.log")


@pytest.mark.parametrize("edit", [
    ('-e "$MAX_BYTES"', "-e 512M"),  # a size of its own
    ('-f "$STEP_FACTOR"', "-f 4"),  # another step
    ('-d "${TYPE[$DTYPE]}"', "-d half"),  # another dtype
    ("--scopes=global", "--scopes=scale_up"),  # microbench over part of the job
    ("[all_gather]=all_gather_perf", "[all_gather]=reduce_scatter_perf"),  # the wrong binary
    ("-g 1", "-g 8"),  # one process driving 8 GPUs
])
def test_a_template_whose_tools_disagree_is_caught(tmp_path, edit):
  """The agreement check is proven by the edits it catches, each a plausible slip in the template."""
  old, new = edit
  text = open(TEMPLATE, encoding="utf-8").read()
  assert old in text
  broken = tmp_path / "broken.sbatch"
  broken.write_text(text.replace(old, new))
  assert disagreements(_run(tmp_path, str(broken))), edit


def test_bad_settings_are_one_line(tmp_path):
  stubs = tmp_path / "bin"
  stubs.mkdir()
  for env, says in (({"DTYPE": "complex64"}, "DTYPE=complex64: nccl-tests has no such type"),
                    ({"COLLECTIVES": "all_reduce,gather"}, "COLLECTIVES: gather has no nccl-tests binary"),
                    ({"COLLECTIVES": "all_reduce"}, f"NCCL_TESTS_DIR={tmp_path} has no all_reduce_perf"),
                    ({}, "set NCCL_TESTS_DIR")):
    full = dict(PATH=f"{stubs}:/usr/bin:/bin", SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NAME="x", SLURM_JOB_ID="1",
                **({"NCCL_TESTS_DIR": str(tmp_path)} if env else {}), **env)
    (stubs / "srun").write_text("#!/bin/sh\nexit 0\n")
    (stubs / "srun").chmod(0o755)
    r = subprocess.run(["bash", TEMPLATE], capture_output=True, text=True, timeout=60, env=full, check=False)
    assert r.returncode != 0 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, (env, r.stderr)
    assert not (tmp_path / "runs").exists()  # refused before anything ran


def test_the_sizes_mean_the_same_bytes_in_both_tools():
  """nccl-tests' -b/-e read K, M and G as powers of 1024 (its parsesize), as microbench's sizes do."""
  nccl_units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
  for text in ("64K", "1M", "1G", "8"):
    want = int(text[:-1]) * nccl_units[text[-1]] if text[-1] in nccl_units else int(text)
    assert sizes.parse_size(text) == want


# The template under a real SLURM (the emulated cluster's), with a stand-in for nccl-tests that prints its table
# and writes its JSON as nccl-tests 2.19 does, rank 0 only: the steps, the sweep and the report for real.
FAKE_NCCL_TESTS = r'''#!{python}
# usage text a real binary holds: [-J,--output_file <file>]
import json, os, sys
args = sys.argv[1:]
opt = dict(zip(args[::2], args[1::2]))
units = {{"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}}
size = lambda t: int(t[:-1]) * units[t[-1]] if t[-1] in units else int(t)
lo, hi, f = size(opt["-b"]), size(opt["-e"]), int(opt["-f"])
if os.environ.get("SLURM_PROCID", "0") != "0":
  sys.exit(0)
n = int(os.environ["SLURM_NTASKS"])
print("# Collective test starting: " + os.path.basename(sys.argv[0]))
print("# nThread 1 nGpus 1 minBytes %d maxBytes %d step: %d(factor)" % (lo, hi, f))
for r in range(n):
  print("#  Rank %2d Group  0 Pid %6d on %10s device  0 [0000:18:00] Fake GPU" % (r, 1000 + r, "node%d" % r))
print("#  size  count  type  redop  root  time  algbw  busbw  #wrong  time  algbw  busbw  #wrong")
results, s = [], lo
while s <= hi:
  t = 10.0 + s / 1e4
  bus = s / t / 1e3 * 2 * (n - 1) / n
  print("%12d  %12d  %8s  %6s  %6d  %7.2f  %6.2f  %6.2f  %6d  %7.2f  %6.2f  %6.2f  %6d"
        % (s, s // 4, "float", "sum", -1, t, s / t / 1e3, bus, 0, t, s / t / 1e3, bus, 0))
  results.append({{"size": s, "count": s // 4, "type": "float", "redop": "sum", "root": "    -1",
                  "out_of_place": {{"time": t, "alg_bw": s / t / 1e3, "bus_bw": bus, "nwrong": 0.0}},
                  "out_of_place_per_iter": {{"skipped_iterations": 0, "times_us": [t * 0.99, t, t * 1.01, t]}},
                  "in_place": {{"time": t, "alg_bw": s / t / 1e3, "bus_bw": bus, "nwrong": 0.0}},
                  "actual_iterations": 4, "experiment_name": ""}})
  s *= f
if "-J" in opt:
  with open(opt["-J"], "w") as out:
    json.dump({{"version": 3, "args": sys.argv, "nccl_version": 22703, "config": {{"nthreads": 1, "ngpus": 1,
               "devices": [{{"rank": r, "device_info": "Fake GPU"}} for r in range(n)]}}, "results": results}}, out)
'''


@pytest.mark.cluster
@pytest.mark.usefixtures("needs_slurm")
def test_the_nccl_tests_template_under_slurm(tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  from support import clean_env  # pylint: disable=g-import-not-at-top
  from microbench.cluster import slurm_testbed as stb  # pylint: disable=g-import-not-at-top
  from microbench.cluster import testbed as tbm  # pylint: disable=g-import-not-at-top
  tests_dir = tmp_path / "nccl-tests"
  tests_dir.mkdir()
  (tests_dir / "all_reduce_perf").write_text(FAKE_NCCL_TESTS.format(python=sys.executable))
  (tests_dir / "all_reduce_perf").chmod(0o755)
  submit = tmp_path / "submit"  # the job's runs/ folder goes here, not into the checkout
  submit.mkdir()
  bed = tbm.Testbed.new(hosts=2, racks=1, host_rate=400_000_000, uplink_rate=100_000_000)
  bed.up()
  work = tempfile.mkdtemp(prefix="ncclt")
  cluster = stb.SlurmTestbed(bed, work, gpus=2, slurmd_timeout=10)
  try:
    cluster.up()
    job = cluster.submit(["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1",
                          f"--output={tmp_path}/job.out", TEMPLATE, "--iters=6", "--samples=2"],
                         cwd=str(submit), env=clean_env(NCCL_TESTS_DIR=str(tests_dir), COLLECTIVES="all_reduce",
                                                        MIN_BYTES="64K", MAX_BYTES="128K"))
    state = cluster.wait(job, timeout=300)
    log = open(tmp_path / "job.out", encoding="utf-8").read()
    assert state == ("COMPLETED", "0:0"), log[-3000:]
  finally:
    cluster.down()
    bed.down()
    shutil.rmtree(work, ignore_errors=True)
  out = submit / "runs" / f"microbench-nccl-tests-{job}"
  table = (out / "report" / "nccl_tests.md").read_text()
  rows = [line for line in table.splitlines() if line.startswith("| all_reduce | float32 |")]
  assert [r.split("|")[3].strip() for r in rows] == ["65536", "131072"], log[-3000:]
  assert all("| global | 4 |" in r for r in rows)  # the whole job's 4 processes, as nccl-tests' 4 ranks
  assert (out / "nccl-tests" / "all_reduce.json").exists() and (out / "report" / "nccl_tests.png").exists()
  assert glob.glob(str(out / "report" / "nccl-tests" / "events.out.tfevents*"))
