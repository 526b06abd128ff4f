"""The records of fixed runs, normalized and compared with tests/golden/same_records_*: a change meant to change
nothing (a long function split into named steps) must leave every record as it was.

Normalized: what varies from run to run or machine to machine is masked (wall times and what is computed from
them: step and compile times, throughputs, TFLOP/s, MFU, the measured overheads; the machine's calibrated peak;
the environment; the run folder), floats keep 12 significant digits, keys are sorted. Compared: every value
exactly, except that floats agree within FLOAT_RTOL relative: XLA:CPU compiles for the host's own vector width,
so one CPU's float32 sums round differently from another's (a training step's gradient norm, 1.1e-7 relative,
between an AVX-512 machine and the one that made the golden). A study prediction's times are the fabric model's,
not wall times: they are kept.

Regenerate after an intended change (and read the diff): `python -m pytest tests/test_same_records.py -m ""
--update-golden` (or MICROBENCH_UPDATE_GOLDEN=1).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import run_records
from support import ROOT, clean_env, doubling

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
MASK = "<masked>"
FLOAT_RTOL = 1e-5  # ~80 float32 roundings: a machine's vector width, not a change of what is computed
# Keys whose values come from wall clocks or from this machine; a study prediction's figures are the model's.
_TRAIN_MASKED = re.compile(r"(time|_s$|_per_s|tflops|mfu|_measured|_ci$|_resolved|_share|^peak_|^environment$"
                           r"|^outdir$|^profile_dir$)")
_PREDICT_MASKED = re.compile(r"(?!)")
_NONE_MASKED = re.compile(r"(?!)")  # a derived schedule: every figure is the model's
TRAIN_ARGS = ["--model=gpt2", "--size=tiny", "--seq_len=64", "--steps=3", "--warmup_steps=1"]
TRAIN_RUNS = {  # golden file -> the run's own flags
    "same_records_train.jsonl": ["--parallelism=dp:2,fsdp:2,tp:2"],
    "same_records_train_pp.jsonl": ["--parallelism=pp:2,dp:4", "--microbatches=4", "--batch=16"],
}


def normalize(value: Any, masked: re.Pattern, key: str = "") -> Any:
  """`value` with the masked keys' values replaced and floats rounded to 12 significant digits."""
  if key and masked.search(key):
    return MASK
  if isinstance(value, dict):
    return {k: normalize(v, masked, k) for k, v in value.items()}
  if isinstance(value, list):
    return [normalize(v, masked) for v in value]
  if isinstance(value, float):
    return float(f"{value:.12g}")
  return value


def normalized_records(records: list[dict], masked: re.Pattern) -> str:
  """One sorted-keys JSON line per record, normalized: the text compared with the golden file."""
  return "".join(json.dumps(normalize(r, masked), sort_keys=True) + "\n" for r in records)


def same(a: Any, b: Any) -> bool:
  """Equal values, floats within FLOAT_RTOL relative (bools and everything else exactly)."""
  if isinstance(a, bool) or isinstance(b, bool):
    return a is b
  if isinstance(a, (int, float)) and isinstance(b, (int, float)) and float in (type(a), type(b)):
    return math.isclose(a, b, rel_tol=FLOAT_RTOL, abs_tol=1e-12)
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(map(same, a, b))
  return a == b


def _line_differs(a: str, b: str) -> bool:
  try:
    return not same(json.loads(a), json.loads(b))
  except json.JSONDecodeError:  # a line of an indented document: its bytes
    return a != b


def first_difference(got: str, want: str) -> str | None:
  """None when the texts hold the same values (`same`); else the first differing line of each, to read."""
  if got == want:
    return None
  try:
    if same(json.loads(got), json.loads(want)):  # one indented document
      return None
  except json.JSONDecodeError:  # JSON lines: compared line by line below
    pass
  g, w = got.splitlines(), want.splitlines()
  i = next((i for i, (a, b) in enumerate(zip(g, w)) if _line_differs(a, b)), min(len(g), len(w)))
  if i == len(g) == len(w):
    return None
  return (f"line {i + 1}: got {g[i] if i < len(g) else '<end>'!r}\n"
          f"        want {w[i] if i < len(w) else '<end>'!r}")


def check_golden(name: str, text: str, update: bool) -> None:
  path = os.path.join(GOLDEN, name)
  if update or not os.path.exists(path):
    with open(path, "w") as f:
      f.write(text)
    if not update:
      pytest.skip(f"{name} written (no golden file yet); rerun to compare")
    return
  with open(path) as f:
    diff = first_difference(text, f.read())
  assert diff is None, f"{name} differs from this run's records ({diff}); if intended: --update-golden"


def predict_records(tmp_path) -> list[dict]:
  """A study prediction on the testbed's generated plan (the plan command's defaults, size divisor 8, its
  first 8 experiments), at the rehearsal scales of docs/study.md: the fabric model (microbench.fabric.jobs)
  on the hand-written proxies."""
  from microbench.study import generator, machines, predict  # pylint: disable=g-import-not-at-top
  machine = machines.parse("testbed")
  settings = generator.Settings(machine, size_divisor=8, max_experiments=8)
  experiments, dropped = generator.generate(settings)
  plan = str(tmp_path / "plan")
  generator.write(plan, settings, experiments, dropped)
  pred = predict.predict(plan, bytes_scale=1e-4, compute_scale=0.02)
  return [{"experiment": eid, **job} for eid, e in pred["experiments"].items() for job in e["jobs"]] + \
      [{"key": k, **v} for k, v in pred["keys"].items()]


def test_a_study_prediction_records_what_it_recorded(tmp_path, update_golden):
  check_golden("same_records_predict.jsonl", normalized_records(predict_records(tmp_path), _PREDICT_MASKED),
               update_golden)


def test_one_figure_changed_fails_the_comparison_and_a_time_changed_does_not():
  with open(os.path.join(GOLDEN, "same_records_train.jsonl")) as f:
    want = f.read()
  records = [json.loads(line) for line in want.splitlines()]
  assert normalized_records(records, _TRAIN_MASKED) == want  # normalizing is idempotent
  summary = records[-1]
  assert summary["kind"] == "summary" and summary["median_step_time_s"] == MASK
  altered = json.loads(json.dumps(records))
  altered[-1]["final_loss"] = altered[-1]["final_loss"] * (1 + 3 * FLOAT_RTOL)  # one figure, in its 5th digit
  diff = first_difference(normalized_records(altered, _TRAIN_MASKED), want)
  assert diff is not None and f"line {len(records)}:" in diff
  altered[-1]["final_loss"] = records[-1]["final_loss"]
  altered[-1]["steps"] = altered[-1]["steps"] + 1  # a count: exactly
  assert first_difference(normalized_records(altered, _TRAIN_MASKED), want) is not None
  rounded = json.loads(json.dumps(records))
  rounded[1]["grad_norm"] = float(np.nextafter(np.float32(rounded[1]["grad_norm"]), np.float32(2)))  # one ulp
  assert first_difference(normalized_records(rounded, _TRAIN_MASKED), want) is None
  retimed = json.loads(json.dumps(records))
  retimed[-1]["median_step_time_s"] = 12.5  # a wall time: masked, so not a difference
  retimed[1]["step_time_s"] = 0.001
  assert first_difference(normalized_records(retimed, _TRAIN_MASKED), want) is None


@pytest.mark.slow
@pytest.mark.parametrize("golden", list(TRAIN_RUNS))
def test_a_tiny_training_run_records_what_it_recorded(tmp_path, update_golden, golden):
  out = tmp_path / "run"
  r = subprocess.run([sys.executable, "-m", "microbench.cli.train", *TRAIN_ARGS, *TRAIN_RUNS[golden],
                      f"--outdir={out}"], capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
                     env=clean_env(JAX_NUM_CPU_DEVICES="8", PYTHONHASHSEED="0"))
  assert r.returncode == 0, r.stderr[-3000:]
  with open(out / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  check_golden(golden, normalized_records(records, _TRAIN_MASKED), update_golden)


@pytest.mark.slow
def test_a_derived_pipeline_proxy_records_what_it_recorded(update_golden):
  """microbench.study.step_collectives on a pipelined step: its tick loop read tick by tick (`schedule`'s JSON,
  figures of the model, none masked)."""
  r = subprocess.run([sys.executable, "-m", "microbench.cli.study", "schedule", "--proxy_from=gpt2-tiny,dp+pp",
                      "--gpus=8"], capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
                     env=clean_env(PYTHONHASHSEED="0"))
  assert r.returncode == 0, r.stderr[-3000:]
  check_golden("same_records_schedule_pp.jsonl", normalized_records([json.loads(r.stdout)], _NONE_MASKED),
               update_golden)


SWEEP_RUNS = {  # golden file -> the sweep's flags: a CPU sweep (ragged included) and a compile-only target
    "same_records_sweep.json": ["--collectives=all_reduce,all_gather,ragged_all_to_all", "--scopes=global",
                                "--min_bytes=1K", "--max_bytes=64K", "--sample_ms=0"],
    "same_records_target_h100.json": ["--target=h100", "--topology=nodes:1,gpus:8", "--min_bytes=1K",
                                      "--max_bytes=64K"],
}


@pytest.mark.slow
@pytest.mark.parametrize("golden", [
    "same_records_sweep.json",
    pytest.param("same_records_target_h100.json", marks=pytest.mark.gpu_compile)])
def test_a_sweep_records_what_it_recorded(tmp_path, update_golden, golden):
  """results.jsonl and results.csv of a sweep, timing-dependent values and every float masked
  (tests/run_records.py): which points ran, their status, checks, programs and HLO findings."""
  from microbench.aot import gpu_compile  # pylint: disable=import-outside-toplevel
  if "target" in golden and not gpu_compile.plugin_available():
    pytest.skip("needs the gpu-compile extra: pip install -e '.[gpu-compile]'")
  out = tmp_path / "run"
  r = subprocess.run([sys.executable, "-m", "microbench", *doubling(SWEEP_RUNS[golden]), f"--outdir={out}"],
                     capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
                     env=clean_env(PYTHONHASHSEED="0"))
  assert r.returncode == 0, r.stderr[-3000:]
  got = run_records.masked(str(out))
  text = json.dumps({k: got[k] for k in ("results.jsonl", "results.csv")}, indent=1, sort_keys=True) + "\n"
  check_golden(golden, text, update_golden)
