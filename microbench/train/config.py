"""A training request checked and laid on the machine: model, strategy degrees, placement, mesh.

Everything that can be refused is refused here, with one line saying why and what is allowed, before a
step is compiled: strategies come from `meshes.parallelism`, placement on the machine from
`microbench.cluster.machine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshes import parallelism as par
from meshes.topology import Topology, TopologyError, parse_topology
from models import ModelError, ModelSpec, get_model
from models.train_step import Trainer, variable_spec

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class ConfigError(ValueError):
  """A request that can't run; the message is one line saying why and what is allowed."""


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
  seed: int = 0
  capacity_factor: float | None = None  # MoE expert capacity (model default when None; <= 0: dropless)
  moe_dispatch: str | None = None  # MoE token exchange (models.moe.DISPATCHES; default auto)
  outdir: str | None = None  # run folder; default runs/train/<name>-<UTC time>
  profile_steps: int = 0
  topology: str | None = None
  nodes_per_rack: int | None = None
  write: bool = True  # False: no files (library use, tests)
  # XLA options for the step's compile (library use: tests turn LLVM optimisation off to compile faster;
  # SPMD partitioning, which decides the collectives and shardings, is the same).
  compiler_options: dict[str, Any] | None = None
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


def check_request(cfg: TrainConfig) -> tuple[ModelSpec, par.Parallelism, Topology | None]:
  """Everything that can be checked before JAX sees a device."""
  try:
    spec = get_model(cfg.model, cfg.size, cfg.layers, cfg.seq_len, cfg.capacity_factor, cfg.moe_dispatch)
    parallelism = par.parse_parallelism(cfg.parallelism) if cfg.parallelism else None
    topology = parse_topology(cfg.topology) if cfg.topology else None
    if parallelism is not None:
      par.axis_order(cfg.placement, parallelism)
  except (ModelError, par.ParallelismError, TopologyError) as e:
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
  return spec, parallelism, topology


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
  mesh = par.build_mesh(parallelism, devices, order)
  return Plan(cfg, spec, parallelism, order, topology, note, mesh,
              par.describe_placement(parallelism, order, topology))


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
  idle = sorted(used - touched)
  if idle:
    flags = [s.flag for s in par.STRATEGIES if s.axis in idle]
    raise ConfigError(f"{p.cfg.model} names no dimension that {','.join(flags)} splits; use"
                      f" {'dp or fsdp' if p.spec.family == 'resnet' else 'another strategy'}")
