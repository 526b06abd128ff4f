"""The study's workloads as data: GPU rooflines, model shapes, the five strategies and their job sizes.

The multi-tenancy study (docs/study.md, section 1) stands a 2400-GPU training job in for with a
*proxy*: the real collectives of a strategy on zero buffers, with compute emulated from a roofline model of
the model's forward pass. Everything a proxy needs that is not communication lives here, so the schedules
(`rank_programs.py`), the job-mix generator (`generator.py`) and the report agree on one table.
"""

from __future__ import annotations

import dataclasses

from microbench.fabric import gpu_kinds, tpu_kinds

BF16_BYTES = 2  # the study's element size (s in the roofline, and what NCCL sends)
LOCAL_BATCH = 16  # B: the study's per-rank batch (its tables are for B=16)


class WorkloadError(ValueError):
  """Bad strategy/model/GPU/size input; the message is one line saying what is allowed."""


@dataclasses.dataclass(frozen=True)
class Gpu:
  name: str
  peak_flops: float  # dense bf16 FLOP/s
  bandwidth: float  # memory bytes/s


# The study's roofline constants where they are not a device's facts: the seed study's calibration, which
# reproduces its published forward times (docs/study.md, section 1): MI250X as one module of two GCDs, GB300 at
# the seed's 2.4 PFLOP/s. Every other GPU takes its dense bf16 peak and memory bandwidth from its kind
# (fabric/gpu_specs, each figure with its source).
CALIBRATION: dict[str, Gpu] = {g.name: g for g in (
    Gpu("MI250X", 383e12, 3.2e12),
    Gpu("GB300", 2.4e15, 8.0e12),
)}


def _from_kinds() -> dict[str, Gpu]:
  out = {}
  for kind in gpu_kinds.kinds().values():
    name = kind.name.upper()
    if name in CALIBRATION:
      out[name] = CALIBRATION[name]
    elif kind.xla and "memory_bandwidth" in kind.xla:
      out[name] = Gpu(name, kind.bf16_tflops * 1e12, float(kind.xla["memory_bandwidth"]))
  for tpu in tpu_kinds.kinds().values():  # a TPU chip's roofline: its bf16 peak and HBM bandwidth
    out[tpu.name.upper()] = Gpu(tpu.name.upper(), tpu.bf16_tflops * 1e12, tpu.hbm_gbytes_s * 1e9)
  return out


GPUS: dict[str, Gpu] = _from_kinds()


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """A transformer as the study's roofline sees it (L layers, width d, FFN H, sequence N)."""
  name: str
  layers: int
  d_model: int
  heads: int
  ffn: int
  seq: int
  params: int
  experts: int = 1  # E
  top_k: int = 1  # k

  @property
  def expert_params(self) -> int:
    """Parameters in the experts' MLPs (SwiGLU: three d x H matrices per expert and layer); 0 if dense."""
    return self.layers * self.experts * 3 * self.d_model * self.ffn if self.experts > 1 else 0

  @property
  def non_expert_params(self) -> int:
    return self.params - self.expert_params


MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("vit-h", 32, 1280, 16, 5120, 257, 632_404_480),
    ModelShape("llama3-8b", 32, 4096, 32, 14336, 8192, 8_030_261_248),
    ModelShape("minerva-7b", 32, 4096, 32, 14336, 4096, 7_399_542_784),
    ModelShape("llama3-70b", 80, 8192, 64, 28672, 8192, 70_553_706_496),
    ModelShape("mixtral-8x7b", 32, 4096, 32, 14336, 32768, 46_702_792_704, experts=8, top_k=2),
)}


def forward_seconds(model: ModelShape, gpu: Gpu, batch: int = LOCAL_BATCH) -> float:
  """The study's roofline forward time: attention and MLP each take FLOPs / min(peak, AI x bandwidth).

  attention: FLOPs = L(8BNd^2 + 4BN^2d), bytes = L(4d^2s + 2BNds); MLP: FLOPs = 4BNdHk L,
  bytes = L(2dHsE + 2BNds); s = 2 (bf16). Backward is twice the forward.
  """
  b, n, d, h, s, L = batch, model.seq, model.d_model, model.ffn, BF16_BYTES, model.layers
  parts = (
      (L * (8 * b * n * d * d + 4 * b * n * n * d), L * (4 * d * d * s + 2 * b * n * d * s)),
      (4 * b * n * d * h * model.top_k * L, L * (2 * d * h * s * model.experts + 2 * b * n * d * s)),
  )
  total = 0.0
  for flops, nbytes in parts:
    intensity = flops / nbytes
    total += flops / min(gpu.peak_flops, intensity * gpu.bandwidth)
  return total


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One of the study's five strategies: its proxy model, launch parameters and job sizes (GPUs)."""
  name: str  # key used everywhere (flags, JSON)
  title: str
  model: str
  sizes: tuple[int, ...]  # concurrent-run sizes (the study's table)
  extended: tuple[int, ...]  # --baseline-extended sizes
  dgx_sizes: tuple[int, ...]  # the study's DGX (8 GPUs, one node) table
  warmup: int
  runs: int
  placements: tuple[str, ...]  # allowed placement classes in concurrent runs


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("dp", "DP", "vit-h", (8, 16), (8, 16, 32, 64), (2, 4, 8), 1, 6,
             ("intra-l1", "intra-group", "inter-group")),
    Strategy("fsdp", "FSDP", "llama3-8b", (16, 32), (16, 32, 64, 128, 256), (4, 8), 1, 4,
             ("intra-l1", "intra-group-same-l1-2", "inter-group-same-l1-2")),
    Strategy("dp+pp", "DP+PP", "minerva-7b", (16, 32, 64), (16, 32, 64, 128, 256), (4, 8), 1, 4,
             ("intra-l1", "intra-group-same-l1-2", "inter-group-same-l1-2", "inter-group")),
    Strategy("dp+pp+tp", "DP+PP+TP", "llama3-70b", (224, 256, 512), (224, 256, 512, 1024), (), 1, 2,
             ("intra-group-same-l1-4", "inter-group-same-l1-4", "inter-group")),
    Strategy("dp+pp+ep", "DP+PP+EP", "mixtral-8x7b", (512, 1024), (512, 1024, 2048), (), 1, 2,
             ("intra-group", "inter-group")),
)}

DP_BUCKETS = 50
FSDP_UNITS = 16
MICROBATCHES = 16
TP_DEGREE = 4
EP_DEGREE = 8


def strategy(name: str) -> Strategy:
  key = name.strip().lower()
  if key not in STRATEGIES:
    raise WorkloadError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
  return STRATEGIES[key]


def model(name: str) -> ModelShape:
  if name not in MODELS:
    raise WorkloadError(f"unknown proxy model {name!r}; choose one of {', '.join(MODELS)}")
  return MODELS[name]


def gpu(name: str) -> Gpu:
  key = {g.lower(): g for g in GPUS}.get(name.strip().lower())
  if key is None:
    raise WorkloadError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)}")
  return GPUS[key]


@dataclasses.dataclass(frozen=True)
class Degrees:
  """How a job of `gpus` ranks is split: data x stage x inner (tensor or expert), inner fastest.

  For FSDP, `inner` is the sharding factor F and `data` the replicas; for DP only `data` is > 1.
  """
  data: int
  stages: int = 1
  inner: int = 1

  @property
  def gpus(self) -> int:
    return self.data * self.stages * self.inner


def _largest_divisor_at_most(n: int, cap: int) -> int:
  return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def degrees(name: str, gpus: int) -> Degrees:
  """The study's launch parameters for a job of `gpus`, shrunk (never grown) to fit small jobs.

  FSDP: F = min(g, 8). DP+PP: S = 2 if g <= 8 else 8. DP+PP+TP: TP = 4, S = 8. DP+PP+EP: EP = 8, S = 8.
  A degree that does not divide the job is replaced by its largest divisor below it, so a scaled-down
  job keeps the strategy's shape (the study's own sizes are all divisible).
  """
  s = strategy(name).name
  if gpus < 1:
    raise WorkloadError(f"a {s} job needs at least 1 GPU, got {gpus}")
  if s == "dp":
    return Degrees(gpus)
  if s == "fsdp":
    f = _largest_divisor_at_most(gpus, 8)
    return Degrees(gpus // f, 1, f)
  if s == "dp+pp":
    st = _largest_divisor_at_most(gpus, 2 if gpus <= 8 else 8)
    return Degrees(gpus // st, st, 1)
  inner = _largest_divisor_at_most(gpus, TP_DEGREE if s == "dp+pp+tp" else EP_DEGREE)
  st = _largest_divisor_at_most(gpus // inner, 8)
  return Degrees(gpus // (inner * st), st, inner)


def samples_per_iteration(name: str, gpus: int, batch: int = LOCAL_BATCH) -> int:
  """Samples one iteration of the whole job processes: the local batch times the data-parallel ranks.

  DP and FSDP ranks each take a batch; a pipeline (and its tensor group) shares one; expert-parallel
  ranks hold different tokens, so each takes a batch like a data-parallel rank.
  """
  d = degrees(name, gpus)
  s = strategy(name).name
  if s in ("dp", "fsdp", "dp+pp+ep"):
    return batch * (d.gpus // d.stages)
  return batch * d.data


def scaled_sizes(name: str, divisor: int, table: str = "concurrent") -> tuple[int, ...]:
  """The strategy's job sizes divided by `divisor` (for machines smaller than the study's), dropping zeros."""
  st = strategy(name)
  base = {"concurrent": st.sizes, "extended": st.extended, "dgx": st.dgx_sizes}[table]
  if divisor < 1:
    raise WorkloadError(f"--size_divisor={divisor} must be >= 1")
  return tuple(sorted({g // divisor for g in base if g // divisor >= 1}))


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def split(total: int, parts: int) -> list[int]:
  """`total` split into `parts` near-equal integers, the remainder on the first ones (as the study does)."""
  base, rem = divmod(total, parts)
  return [base + (1 if i < rem else 0) for i in range(parts)]
