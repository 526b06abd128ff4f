"""The study's five strategies as microbench-train presets: degrees from the study's launch rule for the devices
present, layers fitted to accelerator memory, the CPU rehearsal shapes, explicit flags winning, and every
preset training on 8 CPU devices (its communication fingerprint is in the golden file, test_golden_comm.py)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import pytest  # noqa: E402

from microbench.meshes import parallelism as par  # noqa: E402
from microbench import train  # noqa: E402
from microbench.study import presets  # noqa: E402

GIB = 2**30


@pytest.mark.parametrize("devices,want", [
    (8, {"study-dp": "dp:8", "study-fsdp": "dp:1,fsdp:8", "study-dp-pp": "pp:2,dp:4",
         "study-dp-pp-tp": "pp:2,dp:1,tp:4", "study-dp-pp-ep": "pp:1,dp:1,ep:8"}),
    (64, {"study-dp": "dp:64", "study-fsdp": "dp:8,fsdp:8", "study-dp-pp": "pp:8,dp:8",
          "study-dp-pp-tp": "pp:8,dp:2,tp:4", "study-dp-pp-ep": "pp:8,dp:1,ep:8"}),
])
def test_degrees_follow_the_study(devices, want):
  for name, degrees in want.items():
    fields, note = presets.resolve(name, devices, "cpu", None, {})
    assert fields["parallelism"] == degrees and f"degrees {degrees}" in note
    if "pp:1" not in degrees and "pp" in degrees:
      assert fields["microbatches"] == 16 and fields["schedule"] == "gpipe"
  # The study's batch: 16 samples per data-parallel rank; a pipeline (and its tensor group) shares one.
  assert presets.resolve("study-dp-pp-tp", 64, "cpu", None, {})[0]["batch"] == 16 * 2
  assert presets.resolve("study-dp-pp-ep", 64, "cpu", None, {})[0]["batch"] == 16 * 8


def test_accelerator_layers_fit_half_the_memory():
  fields, note = presets.resolve("study-dp-pp-tp", 8, "gpu", 80 * GIB, {})
  assert (fields["model"], fields["size"], fields["dtype"]) == ("llama3", "70b", "bfloat16")
  layers, degrees = fields["layers"], fields["parallelism"]
  assert layers % 2 == 0 and 2 <= layers < 80 and "layers 80 ->" in note
  state = lambda n: presets.state_bytes_per_device("llama3", "70b", n, degrees)
  assert state(layers) <= 40 * GIB < state(layers + 2)  # the largest multiple of the 2 stages that fits
  # Where the study's job is big enough, its whole depth fits.
  assert presets.resolve("study-dp-pp-tp", 64, "gpu", 80 * GIB, {})[0]["layers"] == 80


def test_state_bytes_are_the_shards_of_the_parameters():
  """llama3-tiny under fsdp:8: every weight split 8 ways along `embed` (64), norms replicated."""
  full = presets.state_bytes_per_device("llama3", "tiny", 2, "dp:1")
  sharded = presets.state_bytes_per_device("llama3", "tiny", 2, "fsdp:8")
  norms = 16 * 64 * (2 * 2 + 1)  # two per block, one final; 16 bytes per parameter
  assert sharded == (full - norms) // 8 + norms


def test_cpu_rehearsal_and_explicit_flags():
  fields, note = presets.resolve("study-dp-pp-tp", 8, "cpu", None, {})
  assert (fields["model"], fields["size"], fields["seq_len"]) == ("llama3", "small", 128) and "dtype" not in fields
  assert "CPU rehearsal shape llama3-small" in note
  fields, note = presets.resolve("study-dp-pp-tp", 8, "cpu", None, {"size": "tiny", "parallelism": "pp:2,tp:2,dp:2",
                                                                     "batch": 8})
  assert not {"size", "parallelism", "batch"} & set(fields) and fields["layers"] == 2
  assert "CPU rehearsal" not in note and "degrees" not in note


def test_unknown_preset_is_one_line():
  with pytest.raises(presets.PresetError, match=r"^unknown --preset='study-tp'; choose one of study-dp, study-fsdp,"):
    presets.resolve("study-tp", 8, "cpu", None, {})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_every_preset_trains_on_8_cpu_devices(name):
  fields, note = presets.resolve(name, 8, "cpu", None, {})
  cfg = train.TrainConfig(**fields, steps=2, warmup_steps=1, measure_overheads=False, preset=name, preset_note=note,
                          write=False, verbose=False, compiler_options={"xla_backend_optimization_level": 0})
  r = train.run(cfg, train.plan(cfg, jax.devices()[:8]))
  assert all(math.isfinite(x) for x in r.losses)
  assert r.summary["parallelism"] == str(par.parse_parallelism(fields["parallelism"]))
  item = r.summary["item"]
  assert r.summary[f"{item}_per_s"] > 0
  if "pp:2" in fields["parallelism"]:
    assert r.summary["pipeline_schedule"] == "gpipe" and r.summary["microbatches"] == 16
    assert r.summary["comm"]["collective-permute"]["count"] > 0
  if name == "study-dp-pp-ep":
    assert r.summary["comm"]["all-to-all"]["bytes"] > 0 and r.summary["moe_dispatch"] == "all_to_all"
    assert 0 <= r.summary["moe_dropped_fraction"] < 0.2
