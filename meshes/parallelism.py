"""Parallel training strategies as data: degrees, mesh axes, placement on the machine, logical-axis rules.

A strategy is one row of `STRATEGIES`: the mesh axis it owns and the model dimension names it shards
over that axis. The logical-axis rules (model name -> mesh axes) are derived from that table, so this
module is the one place that decides how a model is split; models only name their dimensions
(`batch`, `embed`, `heads`, ...). The mesh always carries every axis of the vocabulary (MaxText-style:
`stage`, `data`, `fsdp`, `expert`, `context`, `tensor`); axes of a strategy that is not used have size 1,
so adding pipeline, expert or context parallelism later is a new row plus its code, not a new vocabulary.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax
import numpy as np

from microbench.meshes.topology import Topology


class ParallelismError(ValueError):
  """Bad `--parallelism` / `--placement` input; the message is one line saying what is allowed."""


@dataclasses.dataclass(frozen=True)
class Strategy:
  flag: str  # the key in --parallelism
  title: str
  axis: str  # mesh axis it owns
  shards: tuple[str, ...]  # logical dimension names it splits over that axis


# Mesh axes, outermost first in the default placement (tensor innermost: it stays inside a node).
MESH_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")

STRATEGIES: tuple[Strategy, ...] = (
    Strategy("pp", "pipeline parallel", "stage", ("layers",)),
    Strategy("dp", "data parallel", "data", ("batch",)),
    # FSDP (ZeRO-3): the batch is split like DP, and every weight along its `embed` (or output-channel)
    # dimension, so parameters, gradients and optimizer state are sharded; XLA gathers weights for use.
    Strategy("fsdp", "fully sharded data parallel", "fsdp", ("batch", "embed", "conv_out")),
    # EP: experts split over `expert`; the batch too (outside the experts it is data parallel), tokens
    # go to their experts' owners and back with all-to-all (microbench.models.moe).
    Strategy("ep", "expert parallel", "expert", ("batch", "experts")),
    Strategy("cp", "context (sequence) parallel", "context", ("act_seq",)),
    # Megatron TP: QKV and MLP-up split by columns (heads / mlp), attention-out and MLP-down by rows,
    # the vocabulary split in the embedding and the LM head.
    Strategy("tp", "tensor parallel", "tensor",
             ("heads", "kv_heads", "mlp", "vocab", "act_heads", "act_kv_heads", "act_mlp", "act_vocab")),
)
STRATEGY_BY_FLAG = {s.flag: s for s in STRATEGIES}

# Every dimension name a model may use. Names no strategy shards are replicated.
LOGICAL_NAMES = (
    # activations
    "batch", "act_seq", "act_embed", "act_heads", "act_kv_heads", "act_head_dim", "act_mlp", "act_vocab",
    # parameters
    "layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "pos", "norm", "experts",
    "patch", "classes", "conv_h", "conv_w", "conv_in", "conv_out",
)

LogicalRules = tuple[tuple[str, tuple[str, ...] | None], ...]


def logical_rules() -> LogicalRules:
  """The rules table (name -> mesh axes, in mesh-axis order), derived from `STRATEGIES`."""
  rules = []
  for name in LOGICAL_NAMES:
    axes = tuple(a for a in MESH_AXES for s in STRATEGIES if s.axis == a and name in s.shards)
    rules.append((name, axes or None))
  return tuple(rules)


RULES: LogicalRules = logical_rules()


def spec_for(names: Sequence[str | None], rules: LogicalRules = RULES) -> jax.P:
  """PartitionSpec for an array whose dimensions carry these logical names (None: not sharded)."""
  table = dict(rules)
  out = []
  for n in names:
    if n is None:
      out.append(None)
      continue
    if n not in table:
      raise KeyError(f"unknown logical axis name {n!r}; add it to microbench.meshes.parallelism.LOGICAL_NAMES")
    axes = table[n]
    out.append(None if axes is None else (axes[0] if len(axes) == 1 else axes))
  return jax.P(*out)


def vary(tree, axes: Sequence[str] | None = None):
  """Each array typed as varying over the manual mesh `axes` (default: every manual axis of the current
  mesh) where it isn't yet: shard_map's type check needs loop carries, both branches of a cond and a custom
  VJP's outputs to agree with their counterparts."""
  axes = tuple(jax.sharding.get_abstract_mesh().manual_axes) if axes is None else tuple(axes)

  def one(a):
    missing = tuple(n for n in axes if n not in jax.typeof(a).manual_axis_type.varying)
    return jax.lax.pcast(a, missing, to="varying") if missing else a
  return jax.tree.map(one, tree)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Pins an activation's sharding by logical names; a no-op outside a mesh or without active rules.

  Rules come from flax's `nnx.logical_axis_rules` context, which the trainer sets while tracing, so a
  model runs unchanged on one device.
  """
  from flax.core import spmd  # pylint: disable=g-import-not-at-top

  rules = spmd.get_logical_axis_rules()
  mesh = jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, spec_for(names, rules))


# ZeRO-3: mesh axes over which a weight stays sharded at rest and is gathered only where it is used.
GATHERED_AXES = ("fsdp",)


def filter_axes(axes: str | Sequence[str] | None, *, keep: Sequence[str] | None = None,
                drop: Sequence[str] = ()) -> tuple[str, ...] | None:
  """A rule's or spec entry's mesh axes, only those in `keep` (all when None) and none of `drop`; None when
  none is left (the dimension is not split)."""
  if axes is None:
    return None
  kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes)
               if (keep is None or a in keep) and a not in drop)
  return kept or None


def constrain_for_use(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Pins a weight to the layout it is used in: its rules' sharding minus `GATHERED_AXES` (the FSDP
  all-gather happens here), tensor-parallel splits kept. A no-op outside a mesh, like `constrain`."""
  from flax.core import spmd  # pylint: disable=g-import-not-at-top

  rules = spmd.get_logical_axis_rules()
  if not rules or jax.sharding.get_abstract_mesh().empty:
    return x
  use = tuple((n, filter_axes(a, drop=GATHERED_AXES)) for n, a in rules)
  return jax.lax.with_sharding_constraint(x, spec_for(names, use))


def axis_size(name: str) -> int:
  """Size of mesh axis `name` in the active mesh (1 outside a mesh, or when the mesh has no such axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty or name not in mesh.axis_names else int(mesh.shape[name])


def mesh_axes_for(name: str, min_size: int = 1) -> tuple[str, ...]:
  """The active mesh's axes that the project's rules table maps logical `name` to (those present, of size
  >= `min_size`), in rule order; () outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  return tuple(a for a in (dict(RULES)[name] or ()) if a in mesh.axis_names and mesh.shape[a] >= min_size)


def mesh_degree(names: Sequence[str]) -> int:
  """How many ways the active mesh splits an array dimension with any of these logical names (1 outside
  a mesh): e.g. `mesh_degree(("batch",))` is the number of batch shards."""
  from flax.core import spmd  # pylint: disable=g-import-not-at-top

  rules, mesh = dict(spmd.get_logical_axis_rules() or ()), jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  axes = {a for n in names for a in (rules.get(n) or ())}
  return int(np.prod([mesh.shape[a] for a in axes if a in mesh.shape]))


# ---------------------------------------------------------------------------------------------------------
# --parallelism


@dataclasses.dataclass(frozen=True)
class Parallelism:
  """Degree of each strategy; their product is the device count."""
  degrees: tuple[tuple[str, int], ...]  # (flag, degree) for every strategy, in STRATEGIES order

  def degree(self, flag: str) -> int:
    return dict(self.degrees)[flag]

  @property
  def axis_sizes(self) -> dict[str, int]:
    return {STRATEGY_BY_FLAG[f].axis: d for f, d in self.degrees}

  @property
  def num_devices(self) -> int:
    return int(np.prod([d for _, d in self.degrees]))

  @property
  def batch_shards(self) -> int:
    """How many ways the global batch is split (every axis that shards `batch`)."""
    return int(np.prod([self.axis_sizes[a] for a in (dict(RULES)["batch"] or ())]))

  def __str__(self) -> str:
    used = [f"{f}:{d}" for f, d in self.degrees if d > 1]
    return ",".join(used) or "dp:1"


def parse_parallelism(text: str, num_devices: int | None = None) -> Parallelism:
  """Parses `dp:2,fsdp:2,tp:2` (omitted strategies are 1) and checks the product is the device count."""
  known = ",".join(s.flag for s in STRATEGIES)
  values = {s.flag: 1 for s in STRATEGIES}
  seen = set()
  for part in filter(None, (p.strip() for p in text.split(","))):
    m = re.fullmatch(r"([a-z]+)\s*[:=]\s*(\d+)", part)
    if not m or m.group(1) not in values:
      raise ParallelismError(f"bad --parallelism item {part!r}: expected NAME:DEGREE with NAME in {known}"
                             " (e.g. dp:2,fsdp:2,tp:2)")
    flag, deg = m.group(1), int(m.group(2))
    if flag in seen:
      raise ParallelismError(f"--parallelism={text} names {flag} twice")
    if deg < 1:
      raise ParallelismError(f"--parallelism={text}: the degree of {flag} must be >= 1")
    seen.add(flag)
    values[flag] = deg
  par = Parallelism(tuple((s.flag, values[s.flag]) for s in STRATEGIES))
  if num_devices is not None and par.num_devices != num_devices:
    degrees = " x ".join(f"{f}:{d}" for f, d in par.degrees if d > 1) or "1"
    raise ParallelismError(f"--parallelism={text} uses {degrees} = {par.num_devices} devices but"
                           f" {num_devices} are available; the degrees must multiply to {num_devices}")
  return par


# ---------------------------------------------------------------------------------------------------------
# Placement: which mesh axis is innermost (fastest-varying over the node-contiguous device order).

PLACEMENTS = {
    "tp_inner": MESH_AXES,  # tensor inside a node (scale-up), data/FSDP across nodes
    "tp_outer": ("tensor",) + tuple(a for a in MESH_AXES if a != "tensor"),
}


def axis_order(placement: str, par: Parallelism) -> tuple[str, ...]:
  """Mesh axis order, outermost first: a named placement or an explicit comma list of mesh axes.

  An explicit list must name every axis whose degree is > 1; the others go outermost.
  """
  if placement in PLACEMENTS:
    return PLACEMENTS[placement]
  names = [a.strip() for a in placement.split(",") if a.strip()]
  allowed = ", ".join(PLACEMENTS) + " or a comma list of mesh axes (" + ",".join(MESH_AXES) + ")"
  bad = [a for a in names if a not in MESH_AXES]
  if not names or bad or len(set(names)) != len(names):
    raise ParallelismError(f"bad --placement={placement!r}: expected {allowed}")
  used = [a for a, n in par.axis_sizes.items() if n > 1]
  missing = [a for a in used if a not in names]
  if missing:
    raise ParallelismError(f"--placement={placement} leaves out {','.join(missing)}, which --parallelism uses")
  rest = [a for a in MESH_AXES if a not in names]
  return tuple(rest + names)


def build_mesh(par: Parallelism, devices: Sequence[jax.Device], order: Sequence[str]) -> jax.sharding.Mesh:
  """Mesh over `devices` taken in the given (node-contiguous) order, axes laid out as `order`.

  Axes are Auto: the rules pin parameters and activations, and XLA places the collectives that FSDP
  and TP imply; Explicit axes would instead need an annotation on every contraction.
  """
  sizes = par.axis_sizes
  shape = tuple(sizes[a] for a in order)
  grid = np.array(list(devices), dtype=object).reshape(shape)
  return jax.sharding.Mesh(grid, tuple(order), axis_types=(jax.sharding.AxisType.Auto,) * len(order))


def describe_placement(par: Parallelism, order: Sequence[str], topology: Topology) -> dict[str, str]:
  """Where each used mesh axis's groups lie on the machine: inside a node, a rack, or across racks."""
  sizes = par.axis_sizes
  shape = [sizes[a] for a in order]
  pos = np.arange(int(np.prod(shape))).reshape(shape)
  out = {}
  for i, axis in enumerate(order):
    if sizes[axis] == 1:
      continue
    groups = np.moveaxis(pos, i, -1).reshape(-1, sizes[axis])
    nodes = groups // topology.gpus
    racks = groups // (topology.gpus * topology.nodes)
    if all(len(set(g)) == 1 for g in nodes):
      where = "inside a node (scale-up)"
    elif topology.racks > 1 and all(len(set(g)) == 1 for g in racks):
      where = f"across {len(set(nodes[0]))} nodes of one rack (rack-scale)"
    elif topology.racks == 1:
      where = f"across {len(set(nodes[0]))} nodes (scale-out)"
    else:
      where = f"across {len(set(nodes[0]))} nodes in {len(set(racks[0]))} racks (scale-out)"
    out[axis] = f"{sizes[axis]} {where}"
  return out
