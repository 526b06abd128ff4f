"""The check proven over the space the command line accepts, not over the default sweeps: seeded samples of
cases (microbench.bench.matrix) come out right, every mutant (microbench.bench.mutants) is caught, and each
rule the check excuses something by is bounded, with the bug it catches.

The fast sample runs on this process's 8 CPU devices; the slow group draws more over CPU devices up to 128 in
their own processes and over the GPU and TPU targets (scripts/check_matrix.py runs the whole space).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import ROOT, clean_env
from microbench.bench import collectives, known_inputs, matrix, mutants, program

SEED = 2026


def test_a_seeded_sample_of_the_cpu_space_comes_out_right():
  """Six cases of the whole CPU space on 8 devices (any topology, collective, variant, dtype, size and
  repetition setting): every one compiles, passes its HLO check and is right in every element and every timed
  repetition, or is refused in one line."""
  cases = matrix.cases(SEED, {"cpu": 6}, cpu_devices=(8,))
  outcomes = matrix.run_cases(cases)
  bad = [(o.case.label(), o.status, o.reason, o.wrong, o.timed_wrong) for o in outcomes if not o.honest_ok]
  assert not bad, bad
  assert sum(o.status == "ok" for o in outcomes) >= 4  # most cases ran, not skipped
  assert len({o.case.dtype for o in outcomes}) >= 3 and len({o.case.collective for o in outcomes}) >= 5


def test_the_space_covers_what_the_command_line_accepts():
  """The generator reaches every backend, collective, variant, dtype, repetition setting and mode."""
  rng = random.Random(1)
  drawn = [matrix.draw(rng, b) for b in ("cpu", *matrix.GPU_KINDS, *matrix.TPU_KINDS) for _ in range(150)]
  names = {c.collective for c in drawn}
  assert set(collectives.NAMES) | set(collectives.RAGGED) <= {n.removesuffix(collectives.INPLACE) for n in names}
  assert any(n.endswith(collectives.INPLACE) for n in names) and any("broadcast_root" in n for n in names)
  assert {f"all_reduce_{op}" for op in ("max", "min", "prod", "avg")} <= {n.removesuffix("_inplace") for n in names}
  assert {c.dtype for c in drawn} == set(matrix.DTYPES)
  assert {c.iters for c in drawn} >= {1, 6, 32} and {c.warmup for c in drawn} >= {0, 2}
  assert {c.mode for c in drawn} == {"plain", "overlap", "command_buffer"}
  cpu = [c for c in drawn if c.backend == "cpu"]
  assert max(matrix.group_sizes(cpu)) == 128 and 3 in matrix.group_sizes(cpu)
  assert max(c.devices for c in drawn if c.backend in matrix.GPU_KINDS) == 2400
  assert max(c.devices for c in drawn if c.backend in matrix.TPU_KINDS) == 256
  assert max(c.bytes for c in drawn if c.target) > 1 << 28 and min(c.bytes for c in drawn) <= 2


# ------------------------------------------------------------------------------------------------ mutants

MUTANT_CASES = [  # one case per family, on 8 devices: every mutant kind meets each one it applies to
    matrix.Case("cpu", "racks:2,nodes:2,gpus:2", 8, "all_reduce_inplace", "global", "float32", 4096, iters=6),
    matrix.Case("cpu", "racks:1,nodes:2,gpus:4", 8, "reduce_scatter_inplace", "scale_up", "bfloat16", 2048, iters=8,
                warmup=0),
    matrix.Case("cpu", "racks:1,nodes:4,gpus:2", 8, "all_gather", "scale_out", "int32", 1024, iters=6, samples=2),
    matrix.Case("cpu", "racks:1,nodes:1,gpus:8", 8, "broadcast_root3", "scale_up", "float16", 512, iters=10),
    matrix.Case("cpu", "racks:2,nodes:1,gpus:4", 8, "ppermute", "global", "float32", 96, iters=6, warmup=2),
    matrix.Case("cpu", "racks:1,nodes:2,gpus:4", 8, "ragged_all_to_all_hot_expert", "scale_up", "float32", 512,
                iters=6, samples=1),
]


@pytest.mark.parametrize("case", MUTANT_CASES, ids=lambda c: f"{c.collective}-{c.dtype}")
def test_every_mutant_is_caught(case):
  """Each fault only in the timed repetitions (every repetition, only the short arm, only the programs that
  are timed, only the last rank, only one group, only in place, only the root, every 7th repetition, a ragged
  run short or skipped) is caught: by a digest, the final carry or a replay."""
  assert matrix.run_case(case).honest_ok
  outcomes = matrix.run_mutants(case)
  base = collectives.get(case.collective)
  groups = case.devices // matrix.group_sizes_of(case.backend, case.topology)[case.scope]
  assert {o.mutant.rsplit("(", 1)[1].rstrip(")") for o in outcomes} == set(
      mutants.kinds_for(base, case.dtype, case.iters, groups))
  missed = [(o.mutant, o.status, o.reason, o.wrong, o.timed_wrong) for o in outcomes if not o.caught]
  assert not missed, missed
  assert all(o.status == "ok" and o.wrong == 0 for o in outcomes), "a timed fault passed the check program"


@pytest.mark.parametrize("kind,breaks", [
    ("short_arm_only", "no short twin"), ("undigested_only", "twins last"), ("every_kth", "digest ignores repetitions")])
def test_each_part_of_the_timed_check_is_what_catches_its_mutant(monkeypatch, kind, breaks):
  """The check's own mutations: without the short arm's twin, with the twins run after the samples (so the
  final carry is a twin's), or with a fold that ignores the repetitions, the matching mutant passes."""
  case = dataclasses.replace(MUTANT_CASES[2], samples=1)  # the one timed pair ends on the long arm
  (before,) = matrix.run_mutants(case, [kind])
  assert before.caught
  if breaks == "no short twin":
    real = program.untimed_calls
    monkeypatch.setattr(program, "untimed_calls", lambda *a, **k: [c for c in real(*a, **k) if c != "short"])
  elif breaks == "twins last":  # the samples first, then one long twin call: the final carry is the twin's
    def twins_last(short, long, carry, warmup, samples, barrier, *_, **__):
      for _ in range(samples):
        carry = program._run(long, program._run(short, carry))  # pylint: disable=protected-access
      return np.zeros(samples), np.ones(samples), program._run(long.checked, carry)  # pylint: disable=protected-access
    monkeypatch.setattr(program, "time_pairs", twins_last)
    monkeypatch.setattr(program, "chain_reps",
                        lambda w, p, s, l, g=0, period=1: (p * (s + l) + l, (p * (s + l), l)))
  else:
    monkeypatch.setattr(program, "fold", lambda acc, y, reference=None: acc)
    monkeypatch.setattr(program, "expected_acc", lambda sequence, reps: 0)
  (after,) = matrix.run_mutants(case, [kind])
  assert not after.caught, (after.status, after.reason)


# ------------------------------------------------------------------------------------------------ the digest

def _old_digest(y):
  """The digest before: a plain sum of bits XOR a position key (no mixing)."""
  bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
  return jnp.sum(bits ^ (jax.lax.iota(jnp.uint32, y.shape[0]) * jnp.uint32(0x9E3779B9)), dtype=jnp.uint32)


def test_no_structured_error_of_the_known_inputs_collides():
  """+1 on every element, a shift, a swap, doubling: over runs of consecutive integers of every power-of-two
  length and many offsets a plain keyed sum missed about one in five (`+1` on such a run cancels in the XOR);
  the mixed digest misses none of thousands."""
  rng = np.random.default_rng(0)
  new_digest = jax.jit(jax.vmap(lambda y: program.digest(y)[0]))
  old_digest = jax.jit(jax.vmap(_old_digest))
  old = new = total = 0
  for length in (2 ** k for k in range(1, 11)):
    starts = rng.integers(-(1 << 20), 1 << 20, 100)
    y = jnp.asarray(starts[:, None] + np.arange(length)[None, :], jnp.int32)
    for wrong in (y + 1, jnp.roll(y, 1, axis=1), y.at[:, 0].set(y[:, 1]).at[:, 1].set(y[:, 0]), y * 2):
      total += len(starts)
      old += int((old_digest(y) == old_digest(wrong)).sum())
      new += int((new_digest(y) == new_digest(wrong)).sum())
  assert total == 4000 and new == 0 and old > total // 20, (old, new, total)


def test_one_wrong_element_always_changes_the_digest():
  y = jnp.arange(4096, dtype=jnp.float32) * 3 - 7
  base = int(program.digest(y)[0])
  for i in range(0, 4096, 97):
    assert int(program.digest(y.at[i].add(1))[0]) != base
  for dtype in ("bfloat16", "float16", "int32", "float8_e4m3fn"):
    z = y[:64].astype(dtype)
    assert int(program.digest(z)[0]) != int(program.digest(mutants.corrupt(z))[0])


def test_fill_is_no_input_or_output_value():
  """known_inputs.FILL lies below every data letter, sum, product and extreme (and is exact), so an element
  a collective never wrote can't hold a right value."""
  for dtype, fill in known_inputs.FILL.items():
    assert float(known_inputs.as_dtype(fill, dtype)) == fill
    assert fill < known_inputs.data_value(dtype, np.arange(known_inputs.ALPHABET[dtype])).min()
    if dtype in known_inputs.HALF:
      assert fill < -known_inputs.HALF[dtype]


# ------------------------------------------------------------------------------------------------ refusals

def test_a_run_that_measures_nothing_is_one_line_and_exit_2(tmp_path):
  """Every scope skipped: not "every check passed" but one line, exit 2 (before, exit 0 with 0 points)."""
  r = subprocess.run([sys.executable, "-m", "microbench", "--topology=nodes:1,gpus:8", "--scopes=scale_out",
                      f"--outdir={tmp_path}/run"], capture_output=True, text=True, timeout=120,
                     env=clean_env(JAX_NUM_CPU_DEVICES="8"), cwd=ROOT)
  assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1].startswith("microbench: error: nothing to measure or check (scale_out:")


def test_in_place_keeps_a_users_registered_class():
  """`--inplace=yes` runs the user's own collective in place (its op, in nccl-tests' layout), not the built-in."""
  class MyGather(collectives.AllGather):
    name = "my_gather"

    def op(self, x, axes, n, platform):
      return super().op(x, axes, n, platform) + 0
  collectives.register(MyGather)
  try:
    inplace = collectives.with_inplace("my_gather")
    assert isinstance(inplace, MyGather) and inplace.inplace and inplace.in_count(64, 4) == 64
    assert isinstance(collectives.with_inplace("reduce_scatter_max"), collectives.InPlaceReduceScatter)
  finally:
    del collectives.REGISTRY["my_gather"]


def test_command_buffers_refuse_the_ragged_all_to_all_in_one_line():
  from support import run_cli  # pylint: disable=import-outside-toplevel
  r = run_cli(["--collectives=ragged_all_to_all_skewed", "--command_buffer=yes"])
  assert r.returncode == 2 and "outside command buffers" in r.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------------ slow groups

@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("devices", [48, 128])
def test_larger_cpu_samples_and_their_mutants_in_processes_of_their_own(devices, tmp_path):
  """Groups of up to 128 CPU devices (an all-gather there was refused for the digest's reduce-window passes): a
  seeded sample each, honest cases right and mutants caught (one per case, a seeded draw: on 48 devices a
  ragged case's every mutant is 25 s of XLA:CPU's ragged all-to-all; the fast suite plants every kind on 8)."""
  out = tmp_path / "m.json"
  r = subprocess.run([sys.executable, "scripts/check_matrix.py", f"--seed={devices}", "--cpu=2", "--gpu=0", "--tpu=0",
                      "--max_mutants=1", f"--cpu_devices={devices}", f"--out={out}"], capture_output=True, text=True, timeout=1500,
                     env=clean_env(), cwd=ROOT)
  summary = json.loads(out.read_text())["summary"]
  assert r.returncode == 0 and not summary["honest_failures"] and not summary["mutants_missed"], summary
  assert summary["mutants"] > 0


@pytest.mark.slow
def test_an_all_gather_over_64_cpu_devices_passes(tmp_path):
  r = subprocess.run([sys.executable, "-m", "microbench", "--topology=nodes:1,gpus:64", "--collectives=all_gather",
                      "--min_bytes=4K", "--max_bytes=1M", "--samples=2", f"--outdir={tmp_path}/run"],
                     capture_output=True, text=True, timeout=900, env=clean_env(JAX_NUM_CPU_DEVICES="64"), cwd=ROOT)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
  recs = [json.loads(l) for l in open(tmp_path / "run" / "results.jsonl", encoding="utf-8")]
  assert recs and all(x["status"] == "ok" and x["wrong"] == 0 and x["timed_wrong"] == 0 for x in recs)


def _target_sample(backends: tuple[str, ...], count: int, tmp_path) -> dict:
  out = tmp_path / "m.json"
  args = [f"--{'gpu' if backends[0] in matrix.GPU_KINDS else 'tpu'}={count}", "--cpu=0"]
  args.append(f"--{'tpu' if backends[0] in matrix.GPU_KINDS else 'gpu'}=0")
  r = subprocess.run([sys.executable, "scripts/check_matrix.py", "--seed=5", *args, f"--max_bytes={1 << 26}",
                      f"--out={out}"],
                     capture_output=True, text=True, timeout=2400, env=clean_env(), cwd=ROOT)
  summary = json.loads(out.read_text())["summary"]
  assert r.returncode == 0 and not summary["honest_failures"], summary
  return summary


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MICROBENCH_MATRIX_TARGETS", "1") == "1", reason="targets off")
def test_a_sample_of_every_gpu_kind_compiles_and_checks(tmp_path):
  from microbench.aot import gpu_compile  # pylint: disable=import-outside-toplevel
  if not gpu_compile.plugin_available():
    pytest.skip("JAX's CUDA PJRT plugin is not installed: pip install -e '.[gpu-compile]'")
  summary = _target_sample(matrix.GPU_KINDS, 6, tmp_path)
  assert set(summary["by_backend"]) == set(matrix.GPU_KINDS)


@pytest.mark.slow
def test_a_sample_of_every_tpu_kind_compiles_and_checks(tmp_path):
  from microbench.aot import tpu_compile  # pylint: disable=import-outside-toplevel
  if not tpu_compile.libtpu_available():
    pytest.skip("libtpu is not installed: pip install -e '.[tpu-compile]'")
  summary = _target_sample(matrix.TPU_KINDS, 6, tmp_path)
  assert set(summary["by_backend"]) == set(matrix.TPU_KINDS)
