"""The study's five strategies as microbench-train requests: `--preset=study-dp|study-fsdp|study-dp-pp|
study-dp-pp-tp|study-dp-pp-ep` (docs/study.md, section 1).

A preset sets the model, sequence, degrees, microbatches, schedule and batch the study uses, scaled to the
devices present, and says what it scaled:
- degrees: the study's launch rule for a job of that many GPUs (`workloads.degrees`: FSDP's F = min(g, 8);
  DP+PP's S = 2 up to 8 GPUs, else 8; TP = 4 and EP = 8 innermost, then S = 8), each shrunk to a divisor
  of the device count when the job is smaller than the study's;
- microbatches and schedule: M = 16, GPipe order (the study's hybrids send all M forwards, then all M
  backwards);
- batch: the study's 16 samples per data-parallel rank (a pipeline and its tensor group share one batch;
  an expert-parallel rank takes its own, `workloads.samples_per_iteration`);
- layers: on an accelerator, the study's depth if the training state (float32 parameters, gradients and
  AdamW's two moments: 16 bytes per parameter on its shard) fits half the device's memory, else the largest
  multiple of the stage count that does (the other half is for activations and gathered weights:
  `--compile_only` shows the real figure); on CPU, where no virtual device has memory of its own, a small
  shape of the same family (the CPU rehearsal), at least one layer per stage.
Flags given explicitly win over the preset's values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from microbench.study import workloads as wl

PRESETS = {"study-dp": "dp", "study-fsdp": "fsdp", "study-dp-pp": "dp+pp", "study-dp-pp-tp": "dp+pp+tp",
           "study-dp-pp-ep": "dp+pp+ep"}
SCHEDULE = "gpipe"
FIELDS = ("model", "size", "seq_len", "layers", "parallelism", "batch", "microbatches", "schedule", "dtype")
STATE_BYTES_PER_PARAM = 16  # float32 parameter, gradient, AdamW mu and nu
MEMORY_SHARE = 0.5  # of the device's memory the training state may take when layers are fitted


class PresetError(ValueError):
  """An unknown preset, or one that can't be laid on these devices; one line."""


@dataclasses.dataclass(frozen=True)
class Shape:
  model: str
  size: str
  seq_len: int | None  # None: the model's own (ViT: patches + 1)


# The study's models (microbench-train families and sizes) and their CPU rehearsal shapes.
STUDY_SHAPES = {"dp": Shape("vit", "h14", None), "fsdp": Shape("llama3", "8b", 8192),
                "dp+pp": Shape("minerva", "7b", 4096), "dp+pp+tp": Shape("llama3", "70b", 8192),
                "dp+pp+ep": Shape("mixtral", "8x7b", 32768)}
CPU_SHAPES = {"dp": Shape("vit", "tiny", None), "fsdp": Shape("llama3", "tiny", 128),
              "dp+pp": Shape("llama3", "tiny", 128), "dp+pp+tp": Shape("llama3", "small", 128),
              "dp+pp+ep": Shape("mixtral", "tiny", 128)}


def parallelism(strategy: str, devices: int) -> str:
  """The study's degrees for `devices` as a --parallelism string."""
  d = wl.degrees(strategy, devices)
  return {"dp": f"dp:{d.data}", "fsdp": f"dp:{d.data},fsdp:{d.inner}", "dp+pp": f"pp:{d.stages},dp:{d.data}",
          "dp+pp+tp": f"pp:{d.stages},dp:{d.data},tp:{d.inner}",
          "dp+pp+ep": f"pp:{d.stages},dp:{d.data},ep:{d.inner}"}[strategy]


def state_bytes_per_device(model: str, size: str, layers: int, parallelism_text: str) -> int:
  """Training-state bytes on the most loaded device: each parameter's shard under the rules, x 16."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from microbench.meshes import parallelism as par  # pylint: disable=g-import-not-at-top
  from microbench.models import get_model  # pylint: disable=g-import-not-at-top
  from microbench.models.train_step import variable_spec  # pylint: disable=g-import-not-at-top

  spec = get_model(model, size, layers=layers)
  sizes = par.parse_parallelism(parallelism_text).axis_sizes
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: spec.make(jnp.float32, 0))
  total = 0
  for v in jax.tree.leaves(nnx.state(abstract, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
    shard = 1
    for dim, entry in zip(v.shape, variable_spec(v)):
      axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
      split = 1
      for a in axes:
        split *= sizes[a]
      shard *= -(-dim // split)
    total += shard
  return STATE_BYTES_PER_PARAM * total


def fit_layers(model: str, size: str, full_layers: int, stages: int, parallelism_text: str,
               device_memory: int) -> int:
  """The largest multiple of `stages` up to `full_layers` whose training state fits MEMORY_SHARE of the
  device (at least `stages`: one layer per stage). The state is linear in depth: measured at 1 and 2 stages'
  worth of layers."""
  a = state_bytes_per_device(model, size, stages, parallelism_text)
  b = state_bytes_per_device(model, size, 2 * stages, parallelism_text)
  per_chunk = max(1, b - a)  # one more layer per stage
  budget = MEMORY_SHARE * device_memory
  chunks = int((budget - (a - per_chunk)) // per_chunk)
  return max(stages, min(full_layers, chunks * stages) // stages * stages)


def resolve(name: str, devices: int, platform: str, memory: int | None,
            explicit: dict[str, Any]) -> tuple[dict[str, Any], str]:
  """(TrainConfig fields, a note saying what was scaled) for preset `name` on `devices` devices of
  `platform` with `memory` bytes each (None: unknown); fields in `explicit` (the flags the user gave) are
  left to the user."""
  from microbench.models import get_model  # pylint: disable=g-import-not-at-top

  if name not in PRESETS:
    raise PresetError(f"unknown --preset={name!r}; choose one of {', '.join(PRESETS)}")
  strategy = PRESETS[name]
  study = STUDY_SHAPES[strategy]
  cpu = platform == "cpu"
  shape = CPU_SHAPES[strategy] if cpu else study
  model = explicit.get("model", shape.model)
  size = explicit.get("size", shape.size if model == shape.model else None)
  seq_len = explicit.get("seq_len", shape.seq_len if (model, size) == (shape.model, shape.size) else None)
  par_text = explicit.get("parallelism") or parallelism(strategy, devices)
  from microbench.meshes import parallelism as par  # pylint: disable=g-import-not-at-top
  try:
    degrees = par.parse_parallelism(par_text)
  except par.ParallelismError as e:
    raise PresetError(str(e)) from None
  stages = degrees.degree("pp")
  full = get_model(model, size).config.num_layers
  notes = [f"{name}: the study's {wl.strategy(strategy).title} ({study.model}-{study.size}) on {devices} devices"]
  if cpu and "model" not in explicit and "size" not in explicit:
    notes.append(f"CPU rehearsal shape {model}-{size} (the study's widths need accelerator memory)")
  if "layers" in explicit:
    layers = explicit["layers"]
  elif memory is None:
    layers = -(-max(full, stages) // stages) * stages
  else:
    layers = fit_layers(model, size, full, stages, par_text, memory)
  if layers != full and "layers" not in explicit:
    notes.append(f"layers {full} -> {layers}" + ("" if memory is None else f" (training state within"
                                                 f" {MEMORY_SHARE:.0%} of {memory / 2**30:.0f} GiB per device)"))
  if "parallelism" not in explicit:
    notes.append(f"degrees {par_text}")
  fields: dict[str, Any] = {"model": model, "size": size, "seq_len": seq_len, "layers": layers,
                            "parallelism": par_text,
                            "batch": wl.samples_per_iteration(strategy, devices)}
  if stages > 1:
    fields.update(microbatches=wl.MICROBATCHES, schedule=SCHEDULE)
    notes.append(f"{wl.MICROBATCHES} microbatches, {SCHEDULE}")
  if not cpu:
    fields["dtype"] = "bfloat16"
  fields = {k: v for k, v in fields.items() if k not in explicit}
  return fields, "; ".join(notes)
