"""A training request checked and laid on the machine: model, strategy degrees, placement, mesh.

Everything that can be refused is refused here, with one line saying why and what is allowed, before a
step is compiled: strategies come from `microbench.meshes.parallelism`, placement on the machine from
`microbench.cluster.machine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from microbench.meshes import parallelism as par
from microbench.meshes.topology import Topology, TopologyError, parse_topology
from microbench.fabric import tpu_kinds
from microbench.aot import gpu_compile, tpu_compile
from microbench.models import ModelError, ModelSpec, context, get_model, pipeline, pipeline_schedule
from microbench.models.layers import CONTEXT_IMPLS, REMAT_POLICIES, Execution
from microbench.models.train_step import Trainer, variable_spec

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ATTENTION_CHOICES = ("auto", "xla", "cudnn")
DEFAULT_SCHEDULE = "1f1b"  # pipeline schedule when --schedule is not given


class ConfigError(ValueError):
  """A request that can't run; the message is one line saying why and what is allowed."""


# What setting up a --target can raise, each with a one-line message: GPU and TPU kinds and compilers.
TARGET_ERRORS = (gpu_compile.TargetError, gpu_compile.KindError, tpu_compile.TargetError,
                 tpu_kinds.KindError)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: str = "gpt2"
  size: str | None = None  # default per model family
  layers: int | None = None  # override the size's depth
  parallelism: str | None = None  # default: data parallel over every device
  placement: str = "tp_inner"
  batch: int = 8  # global
  seq_len: int | None = None  # default: the model's context
  steps: int = 10
  warmup_steps: int = 2
  dtype: str = "float32"
  learning_rate: float = 3e-4
  clip_norm: float = 1.0  # global gradient-norm clipping; 0: off
  grad_accum: int = 1  # microbatches per step
  remat: str = "dots_with_no_batch_dims_saveable"
  scan_layers: bool = True
  attention: str = "auto"  # auto: cuDNN's fused kernel on NVIDIA GPUs where it applies, XLA elsewhere
  compile_only: bool = False  # compile and report memory, FLOPs and communication; run nothing
  seed: int = 0
  capacity_factor: float | None = None  # MoE expert capacity (model default when None; <= 0: dropless)
  moe_dispatch: str | None = None  # MoE token exchange (microbench.models.moe.DISPATCHES; default auto)
  microbatches: int | None = None  # pipeline microbatches per step (pp only; default: the stage count)
  schedule: str | None = None  # pipeline schedule (pp only; default 1f1b)
  virtual_stages: int = 1  # layer chunks per stage (--schedule=interleaved)
  context_impl: str = "ring"  # attention over a sequence split by cp
  measure_overheads: bool = True  # pp: time the step without its bubble; ep: without its all-to-alls
  preset: str | None = None  # the study preset that set this request (recorded, not interpreted here)
  preset_note: str | None = None  # what the preset scaled to fit the devices
  outdir: str | None = None  # run folder; default runs/train/<name>-<UTC time>
  profile_steps: int = 0
  topology: str | None = None
  nodes_per_rack: int | None = None
  target: str | None = None  # compile for this GPU or TPU kind's compile-only devices (implies compile_only)
  write: bool = True  # False: no files (library use, tests)
  # XLA options for the step's compile (library use: tests turn LLVM optimisation off to compile faster;
  # SPMD partitioning, which decides the collectives and shardings, is the same).
  compiler_options: dict[str, Any] | None = None
  # A collective performance table XLA:GPU's scheduler reads (a GPU --target), and what the step compiled with
  # it is compared against: None is XLA's built-in table (train/xla_table_effect.py).
  xla_perf_table: str | None = None
  xla_perf_table_baseline: str | None = None
  verbose: bool = True


@dataclasses.dataclass
class Plan:
  cfg: TrainConfig
  spec: ModelSpec
  parallelism: par.Parallelism
  axis_order: tuple[str, ...]
  topology: Topology
  topology_note: str
  mesh: jax.sharding.Mesh
  placement: dict[str, str]
  attention: str = "xla"  # the implementation that runs ("auto" resolved)
  attention_note: str = ""  # why

  @property
  def stages(self) -> int:
    return self.parallelism.degree("pp")

  @property
  def microbatches(self) -> int:
    """Pipeline microbatches (1 without pp)."""
    return pipeline_microbatches(self.cfg, self.stages)

  @property
  def schedule(self) -> str | None:
    """Pipeline schedule (None without pp)."""
    return (self.cfg.schedule or DEFAULT_SCHEDULE) if self.stages > 1 else None

  def execution(self, without: str | None = None) -> Execution:
    """How the layers run for this request (`without`: a timing arm, see microbench.models.layers.WITHOUT)."""
    c = self.cfg
    return Execution(remat=c.remat, scan=c.scan_layers, attention=self.attention, context_impl=c.context_impl,
                     schedule=self.schedule or DEFAULT_SCHEDULE, microbatches=self.microbatches,
                     virtual_stages=c.virtual_stages, without=without)


def pipeline_microbatches(cfg: TrainConfig, stages: int) -> int:
  """Microbatches a pipeline of `stages` runs (--microbatches, default the stage count); 1 without pp."""
  return (cfg.microbatches or stages) if stages > 1 else 1


def check_request(cfg: TrainConfig) -> tuple[ModelSpec, par.Parallelism, Topology | None]:
  """Everything that can be checked before JAX sees a device."""
  try:
    spec = get_model(cfg.model, cfg.size, cfg.layers, cfg.seq_len, cfg.capacity_factor, cfg.moe_dispatch)
    parallelism = par.parse_parallelism(cfg.parallelism) if cfg.parallelism else None
    topology = _parse_topology(cfg)
    if parallelism is not None:
      par.axis_order(cfg.placement, parallelism)
  except (ModelError, par.ParallelismError, TopologyError, *TARGET_ERRORS) as e:
    raise ConfigError(str(e)) from None
  if cfg.dtype not in DTYPES:
    raise ConfigError(f"--dtype={cfg.dtype}: choose {' or '.join(DTYPES)}")
  if cfg.batch < 1:
    raise ConfigError(f"--batch={cfg.batch} must be >= 1")
  if cfg.steps < 1 or cfg.warmup_steps < 0 or cfg.warmup_steps >= cfg.steps:
    raise ConfigError(f"--steps={cfg.steps} must exceed --warmup_steps={cfg.warmup_steps} (>= 0): the summary"
                      " needs at least one step after warm-up")
  if cfg.profile_steps < 0:
    raise ConfigError(f"--profile_steps={cfg.profile_steps} must be >= 0")
  if cfg.remat not in REMAT_POLICIES:
    raise ConfigError(f"--remat={cfg.remat}: choose one of {', '.join(REMAT_POLICIES)}")
  if cfg.attention not in ATTENTION_CHOICES:
    raise ConfigError(f"--attention={cfg.attention}: choose one of {', '.join(ATTENTION_CHOICES)}")
  if cfg.grad_accum < 1:
    raise ConfigError(f"--grad_accum={cfg.grad_accum} must be >= 1")
  if cfg.clip_norm < 0:
    raise ConfigError(f"--clip_norm={cfg.clip_norm} must be >= 0 (0 turns clipping off)")
  if cfg.grad_accum > 1 and spec.family == "resnet":
    raise ConfigError("--grad_accum applies to the transformer models; ResNet's BatchNorm statistics would"
                      " differ per microbatch")
  if parallelism is not None and (tp := parallelism.degree("tp")) > 1:
    for what, n in spec.tp_dims().items():
      if n % tp:
        raise ConfigError(f"tp:{tp} does not divide {cfg.model}-{spec.size}'s {what} ({n});"
                          " choose a tensor-parallel degree that divides it")
  if parallelism is not None and (ep := parallelism.degree("ep")) > 1:
    experts = getattr(getattr(spec.config, "moe", None), "num_experts", 0)
    if not experts:
      raise ConfigError(f"ep:{ep} splits experts and {cfg.model} has none; use --model=mixtral or another strategy")
    if experts % ep:
      raise ConfigError(f"ep:{ep} does not divide {cfg.model}-{spec.size}'s {experts} experts; choose an"
                        " expert-parallel degree that divides it")
  _check_pipeline(cfg, spec, parallelism)
  _check_context(cfg, spec, parallelism)
  _check_perf_table(cfg)
  return spec, parallelism, topology


def _check_perf_table(cfg: TrainConfig) -> None:
  import os  # pylint: disable=g-import-not-at-top
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
  if cfg.xla_perf_table_baseline and not cfg.xla_perf_table:
    raise ConfigError("--xla_perf_table_baseline compares against --xla_perf_table: give the table too")
  if not cfg.xla_perf_table:
    return
  if not cfg.target or machine.is_tpu_target(cfg.target):
    raise ConfigError(f"--xla_perf_table is read by XLA:GPU's scheduler: compile for a GPU --target (h100, b200,"
                      f" ...), not {cfg.target or 'the devices here'}")
  for path in (cfg.xla_perf_table, cfg.xla_perf_table_baseline):
    if path and path != "builtin" and not os.path.isfile(path):
      raise ConfigError(f"{path}: no such table file (XLA would silently use its built-in table)")


def _parse_topology(cfg: TrainConfig):
  """--topology as the target reads it: a TPU slice (`4x4x4,slices:2`) for a TPU --target, GPU nodes
  (`racks:R,nodes:N,gpus:G`) otherwise; None when not given."""
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
  if not cfg.topology:
    return None
  return machine.parse_target_topology(cfg.target, cfg.topology) if cfg.target else parse_topology(cfg.topology)


def _check_pipeline(cfg: TrainConfig, spec: ModelSpec, parallelism: par.Parallelism | None) -> None:
  pp = parallelism.degree("pp") if parallelism is not None else 1
  if pp == 1:
    for flag, given in (("microbatches", cfg.microbatches is not None), ("schedule", cfg.schedule is not None),
                        ("virtual_stages", cfg.virtual_stages != 1)):
      if given:
        raise ConfigError(f"--{flag} applies to pipeline parallelism (pp:S in --parallelism); without a pipeline"
                          " use --grad_accum for microbatches")
    return
  if not spec.has_blocks:
    raise ConfigError(f"pp:{pp} splits a model's stack of layers and {cfg.model} has none to split (its stages"
                      " differ in shape); use dp or fsdp")
  if cfg.grad_accum > 1:
    raise ConfigError(f"--grad_accum={cfg.grad_accum} with pp:{pp}: the pipeline's microbatches are its gradient"
                      " accumulation; use --microbatches instead")
  if parallelism.degree("cp") > 1:
    raise ConfigError(f"cp with pp is not supported: the context exchanges would run inside one stage's branch of"
                      f" the pipeline, where XLA's CPU runtime deadlocks; use cp:{parallelism.degree('cp')}"
                      " without pp")
  try:
    pipeline_schedule.check(cfg.schedule or DEFAULT_SCHEDULE, pp, pipeline_microbatches(cfg, pp), cfg.virtual_stages)
    pipeline.check_layers(spec.config.num_layers, pp, cfg.virtual_stages)
  except pipeline_schedule.ScheduleError as e:
    raise ConfigError(str(e)) from None


def _check_context(cfg: TrainConfig, spec: ModelSpec, parallelism: par.Parallelism | None) -> None:
  if cfg.context_impl not in CONTEXT_IMPLS:
    raise ConfigError(f"unknown --context_impl={cfg.context_impl!r}; choose one of {', '.join(CONTEXT_IMPLS)}")
  cp = parallelism.degree("cp") if parallelism is not None else 1
  if cp == 1:
    return
  if spec.kind != "lm":
    raise ConfigError(f"cp:{cp} splits a token sequence over devices; {cfg.model} is not a language model (use"
                      " gpt2, llama3, minerva or mixtral)")
  b = spec.config.block
  try:
    context.check(cfg.context_impl, cp, spec.seq_len, b.num_heads, b.num_kv_heads, parallelism.degree("tp"))
  except context.ContextError as e:
    raise ConfigError(str(e)) from None


def cpu_devices_wanted(cfg: TrainConfig) -> Topology | None:
  """How many CPU devices to emulate when the user chose none: the request's device count."""
  if cfg.topology:
    return parse_topology(cfg.topology)
  if cfg.parallelism:
    n = par.parse_parallelism(cfg.parallelism).num_devices
    return Topology(1, 1, n)
  return None


def plan(cfg: TrainConfig, devices: Sequence[jax.Device] | None = None) -> Plan:
  """Checks the request against the devices and lays the mesh on the machine.

  `devices` (library use) takes those devices as one node instead of every device of the job.
  """
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top

  spec, parallelism, topology = check_request(cfg)
  if devices is not None:
    devices = list(devices)
    topology, note = Topology(1, 1, len(devices)), f"{len(devices)} given devices as one node"
  elif cfg.target:
    try:
      topology, _, machine_mesh, note = machine.resolve_target(cfg.target, topology, cfg.nodes_per_rack)
    except (TopologyError, *TARGET_ERRORS) as e:
      raise ConfigError(str(e)) from None
    devices = list(machine_mesh.devices.flat)
  else:
    try:
      topology, machine_mesh, note = machine.resolve(topology, cfg.nodes_per_rack)
    except TopologyError as e:
      raise ConfigError(str(e)) from None
    devices = list(machine_mesh.devices.flat)  # node-contiguous
  if parallelism is None:
    parallelism = par.parse_parallelism(f"dp:{len(devices)}")
    cfg = dataclasses.replace(cfg, parallelism=str(parallelism))
    spec, parallelism, _ = check_request(cfg)
  try:
    parallelism = par.parse_parallelism(cfg.parallelism, len(devices))
    order = par.axis_order(cfg.placement, parallelism)
  except par.ParallelismError as e:
    raise ConfigError(str(e)) from None
  if cfg.batch % parallelism.batch_shards:
    splitters = " x ".join(s.flag for s in par.STRATEGIES
                           if "batch" in s.shards and parallelism.degree(s.flag) > 1) or "dp"
    raise ConfigError(f"--batch={cfg.batch} is not divisible by {splitters} = {parallelism.batch_shards}:"
                      " every batch shard needs the same number of examples")
  if cfg.batch % (parallelism.batch_shards * cfg.grad_accum):
    raise ConfigError(f"--batch={cfg.batch} is not divisible by dp x fsdp x grad_accum ="
                      f" {parallelism.batch_shards * cfg.grad_accum}: every microbatch needs the same number of"
                      " examples on every batch shard")
  pp = parallelism.degree("pp")
  microbatches = pipeline_microbatches(cfg, pp)
  if pp > 1 and cfg.batch % (parallelism.batch_shards * microbatches):
    raise ConfigError(f"--batch={cfg.batch} is not divisible by microbatches x batch shards = {microbatches} x"
                      f" {parallelism.batch_shards}: every pipeline microbatch needs the same number of examples on"
                      " every batch shard")
  mesh = par.build_mesh(parallelism, devices, order)
  attention, why = choose_attention(cfg.attention, spec, cfg.dtype, devices[0], parallelism)
  placement = (describe_tpu_placement(mesh, order) if devices[0].platform == "tpu"
               else par.describe_placement(parallelism, order, topology))
  return Plan(cfg, spec, parallelism, order, topology, note, mesh, placement, attention, why)


def describe_tpu_placement(mesh: jax.sharding.Mesh, order: Sequence[str]) -> dict[str, str]:
  """Where each used mesh axis's groups lie on a TPU pod, from what the chips say of themselves: among one
  host's chips, across hosts of one slice (both over ICI), or across slices (over DCN)."""
  host = np.vectorize(lambda d: f"{getattr(d, 'slice_index', 0) or 0}/{d.process_index}", otypes=[object])
  sl = np.vectorize(lambda d: int(getattr(d, "slice_index", 0) or 0), otypes=[int])
  hosts, slices = host(mesh.devices), sl(mesh.devices)
  out = {}
  for i, axis in enumerate(order):
    n = mesh.devices.shape[i]
    if n == 1:
      continue
    h = np.moveaxis(hosts, i, -1).reshape(-1, n)
    s = np.moveaxis(slices, i, -1).reshape(-1, n)
    if all(len(set(g)) == 1 for g in h):
      where = "among one host's chips (ICI)"
    elif all(len(set(g)) == 1 for g in s):
      where = f"across {len(set(h[0]))} hosts of one slice (ICI)"
    else:
      where = f"across {len(set(s[0]))} slices (DCN){'' if len(set(h[0])) == len(set(s[0])) else ' and hosts in each (ICI)'}"
    out[axis] = f"{n} {where}"
  return out


def _cudnn_obstacle(spec: ModelSpec, dtype: str, device: jax.Device, parallelism: par.Parallelism) -> str | None:
  """Why cuDNN's fused attention can't run this request (None: it can), checked before anything compiles."""
  version = getattr(getattr(device, "client", None), "platform_version", "") or ""
  if device.platform != "gpu" or "rocm" in version.lower():
    return f"cuDNN attention needs an NVIDIA GPU (this is {device.device_kind}, platform {device.platform})"
  if dtype != "bfloat16":
    return f"cuDNN attention needs bfloat16 compute (--dtype={dtype})"
  capability = tuple(int(x) for x in str(getattr(device, "compute_capability", "0.0")).split(".")[:2])
  if capability < (8, 0):
    return f"cuDNN flash attention needs compute capability >= 8.0 (this GPU has {capability})"
  head_dim, limit = spec.config.block.head_dim, 256 if capability >= (9, 0) else 128
  if head_dim % 8 or head_dim > limit:
    return f"cuDNN attention needs a head dimension that is a multiple of 8 and <= {limit} (this model: {head_dim})"
  if parallelism.axis_sizes.get("context", 1) > 1:
    return "cuDNN attention can't take a sequence-sharded input (context parallelism)"
  if parallelism.degree("pp") > 1:  # seen compiling for H100: its sharding rule fails inside the pipeline's
    # partially manual shard_map ("custom_partitioner: ... check_compatible_aval")
    return "cuDNN attention's custom partitioner fails inside the pipeline's shard_map (pipeline parallelism)"
  if spec.seq_len % 2:  # JAX's cuDNN path refuses odd lengths when training ("Unsupported sequence length")
    return f"cuDNN attention's training kernels need an even sequence length (this model: {spec.seq_len})"
  return None


def choose_attention(requested: str, spec: ModelSpec, dtype: str, device: jax.Device,
                     parallelism: par.Parallelism) -> tuple[str, str]:
  """The attention implementation to run and why: `auto` takes cuDNN's fused kernel where it applies."""
  if not spec.has_blocks:
    return "xla", "no attention layers"
  obstacle = _cudnn_obstacle(spec, dtype, device, parallelism)
  if requested == "cudnn":
    if obstacle:
      raise ConfigError(f"--attention=cudnn: {obstacle}; use --attention=auto or xla")
    return "cudnn", "requested"
  if requested == "xla":
    return "xla", "requested"
  return ("xla", f"auto: {obstacle}") if obstacle else ("cudnn", "auto: NVIDIA GPU, bfloat16, supported head size")


def check_shardable(trainer: Trainer, p: Plan) -> None:
  """Every sharded parameter dimension divides evenly, and every used mesh axis splits something."""
  sizes = p.parallelism.axis_sizes
  used = {a for a, n in sizes.items() if n > 1}
  touched = set()
  for names in p.spec.batch_spec().values():
    touched |= {a for e in par.spec_for(names) if e for a in (e if isinstance(e, tuple) else (e,))}
  flat = jax.tree_util.tree_flatten_with_path(trainer.abstract_params,
                                              is_leaf=lambda x: hasattr(x, "get_metadata"))[0]
  for path, v in flat:
    spec = variable_spec(v)
    for dim, entry in zip(v.shape, spec):
      axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
      touched |= set(axes)
      n = int(np.prod([sizes[a] for a in axes])) if axes else 1
      if dim % n:
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        raise ConfigError(f"{'x'.join(f'{a}:{sizes[a]}' for a in axes)} does not divide dimension {dim} of"
                          f" parameter {name} {tuple(v.shape)}; choose degrees that divide the model's dims")
  if p.spec.kind == "lm":  # context parallelism splits activations only: the sequence
    touched |= {a for e in par.spec_for(("act_seq",)) if e for a in (e if isinstance(e, tuple) else (e,))}
  idle = sorted(used - touched)
  if idle:
    flags = [s.flag for s in par.STRATEGIES if s.axis in idle]
    raise ConfigError(f"{p.cfg.model} names no dimension that {','.join(flags)} splits; use"
                      f" {'dp or fsdp' if p.spec.family == 'resnet' else 'another strategy'}")
