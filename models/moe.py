"""Mixture-of-experts MLP (Mixtral-style: top-k router, SwiGLU experts) with expert parallelism.

Tokens are routed in groups: each shard of the batch (over every mesh axis that splits `batch`) routes
its own tokens, as GShard does, so no token crosses a data-parallel boundary to be routed. Each group
fills a `[E, C, D]` dispatch buffer (expert, slot, model dim) with capacity `C = ceil(cf * G * k / E)`
slots per expert; assignments past capacity are dropped (counted) and contribute nothing. First choices
take slots before second choices (Switch/GShard priority). With experts sharded over the `expert` axis,
the buffer goes to the experts' owners with one all-to-all and comes back with another; the expert
matmuls run on every source's tokens at once.

The auxiliary losses are computed over the whole batch (sums reduced over the group axes), so they do
not depend on how the batch is split: Switch's load-balancing loss `E * sum_e f_e * P_e` (f_e: share
of assignments routed to e, P_e: mean router probability of e) and ST-MoE's router z-loss
`mean(logsumexp(logits)^2)`.

Dispatch (`dispatch_for`): `all_to_all` (capacity-padded buffers, every platform) or, on GPU,
`ragged_all_to_all` (XLA's ragged all-to-all: assignments sorted by expert, each owner sent exactly its
rows, grouped matmuls with `ragged_dot`; capacity is then per receiving device). XLA:CPU has no ragged
all-to-all, so the ragged path is tested here against an emulation of its documented semantics.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from microbench.meshes import parallelism as par
from microbench.meshes.parallelism import constrain
from microbench.models.layers import EXCHANGED, param

EXPERT = "expert"
STATS = ("moe_dropped", "moe_assignments", "moe_load_balance", "moe_z_loss", "moe_expert_assignments")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  num_experts: int
  top_k: int = 2
  capacity_factor: float = 1.25  # <= 0: capacity = group size, so nothing is ever dropped
  aux_loss_coef: float = 0.01  # load balancing (Switch)
  z_loss_coef: float = 0.001  # router z-loss (ST-MoE)
  dispatch: str = "auto"  # see dispatch_for


def capacity(group_tokens: int, cfg: MoeConfig) -> int:
  """Slots per expert for a group of tokens."""
  if cfg.capacity_factor <= 0:
    return group_tokens
  return max(1, math.ceil(cfg.capacity_factor * group_tokens * cfg.top_k / cfg.num_experts))


DISPATCHES = ("auto", "all_to_all", "ragged_all_to_all")


def dispatch_for(platform: str, requested: str = "auto") -> str:
  """The token exchange that runs: `requested`, or for `auto` the ragged all-to-all on GPU (XLA has it
  there) and the capacity-padded all-to-all elsewhere (XLA:CPU reports ragged-all-to-all unimplemented)."""
  if requested != "auto":
    return requested
  return "ragged_all_to_all" if platform in ("gpu", "cuda", "rocm") else "all_to_all"


def exchange(buf_ECD: jax.Array, axis: str | None) -> jax.Array:
  """Sends block e of the expert dim to the owner of expert e; returns, per source, its tokens for
  this device's experts, sources outermost (`[ep * E_local, C, D]`). Its own inverse."""
  if axis is None:
    return buf_ECD
  return jax.lax.all_to_all(buf_ECD, axis, 0, 0, tiled=True)


def experts_ffn(x_ECD: jax.Array, w_up: jax.Array, w_gate: jax.Array, w_down: jax.Array) -> jax.Array:
  """SwiGLU of each local expert on its slots: [E_l, N, D] -> [E_l, N, D]."""
  dt = x_ECD.dtype
  h = jnp.einsum("end,edf->enf", x_ECD, w_up.astype(dt))
  g = jnp.einsum("end,edf->enf", x_ECD, w_gate.astype(dt))
  return jnp.einsum("enf,efd->end", jax.nn.silu(g) * h, w_down.astype(dt))


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis: str):
  """XLA's ragged all-to-all (`jax.lax.ragged_all_to_all`): slices of `operand` to their owners."""
  return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                   axis_name=axis)


def top_k_weights(logits_GE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """(combine weights [G, k], chosen experts [G, k]): each token's k largest logits, weighted by the router
  probabilities renormalised over those k (Mixtral), so a token's weights sum to 1 whatever mass the other
  experts had. A softmax of the k chosen logits is that renormalisation without forming the full one."""
  top_v_Gk, top_i_Gk = jax.lax.top_k(logits_GE, k)
  return jax.nn.softmax(top_v_Gk, axis=-1), top_i_Gk


def combine(y_kGD: jax.Array, weights_Gk: jax.Array, keep_kG: jax.Array) -> jax.Array:
  """[k, G, D] expert outputs -> [G, D]: each token's kept assignments weighted once by their combine weight;
  a dropped assignment contributes nothing (the token's residual carries it)."""
  return jnp.sum(y_kGD * (weights_Gk.T * keep_kG)[..., None].astype(y_kGD.dtype), axis=0)


def _padded(x_GD, idx_kG, cfg: MoeConfig, ep_axis, w_up, w_gate, w_down, move: bool = True):
  """Capacity-padded dispatch: [E, C, D] buffers, C slots per expert. Returns (y_kGD, keep_kG). `move=False`
  (a timing arm) keeps each buffer where it is: the same work without the all-to-alls."""
  g, d = x_GD.shape
  k, e = idx_kG.shape[0], cfg.num_experts
  c = capacity(g, cfg)
  # Slot of each assignment in its expert's buffer, first choices first.
  onehot_kGE = jax.nn.one_hot(idx_kG, e, dtype=jnp.int32)
  pos_kGE = jnp.cumsum(onehot_kGE.reshape(k * g, e), axis=0).reshape(k, g, e) - 1
  pos_kG = jnp.sum(pos_kGE * onehot_kGE, axis=-1)
  keep_kG = pos_kG < c
  slot_kG = jnp.where(keep_kG, pos_kG, c)  # c is out of bounds: the scatter drops it

  x_kGD = jnp.broadcast_to(x_GD[None], (k, g, d))
  buf_ECD = jnp.zeros((e, c, d), x_GD.dtype).at[idx_kG, slot_kG].set(x_kGD, mode="drop")
  ep = jax.lax.axis_size(ep_axis) if ep_axis else 1
  el = e // ep
  # [ep * E_l, C, D], sources outermost
  buf = checkpoint_name(exchange(buf_ECD, ep_axis if move else None), EXCHANGED)
  buf = buf.reshape(ep, el, c, d).swapaxes(0, 1).reshape(el, ep * c, d)
  out = experts_ffn(buf, w_up, w_gate, w_down)
  out = out.reshape(el, ep, c, d).swapaxes(0, 1).reshape(e, c, d)
  out_ECD = checkpoint_name(exchange(out, ep_axis if move else None), EXCHANGED)
  return out_ECD[idx_kG, jnp.minimum(slot_kG, c - 1)], keep_kG


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
  return jnp.cumsum(a, axis=axis) - a


def _local_rows(operand, output, *_):
  """The timing arm's stand-in for a ragged exchange: rows copied in place, nothing sent."""
  n = min(operand.shape[0], output.shape[0])
  return output.at[:n].set(operand[:n])


def _ragged_offsets(expert_A, e: int, ep: int, el: int, rows: int, ep_axis):
  """Every device's rows per expert ([src, E], an all-gather) and the offsets they fix for every pair: where
  src's rows begin in dst's buffer, how many dst accepts from src, and where dst's rows begin in src's sorted
  buffer (each [src, dst])."""
  i32 = jnp.int32
  counts_E = jnp.zeros((e,), i32).at[expert_A].add(1)
  counts = jax.lax.all_gather(counts_E, ep_axis) if ep_axis else counts_E[None]  # [src, E]
  to_dev = counts.reshape(ep, ep, el).sum(-1)  # [src, dst] rows
  start = jnp.minimum(_exclusive_cumsum(to_dev, 0), rows)  # where src's rows begin in dst's buffer
  allowed = jnp.clip(rows - _exclusive_cumsum(to_dev, 0), 0, to_dev)  # rows dst accepts from src
  send_off = _exclusive_cumsum(to_dev, 1)  # where dst's rows begin in src's sorted buffer
  return counts, start, allowed, send_off


def _ragged_kept(expert_A, order, send_off, allowed, me, el: int, k: int, g: int):
  """Which assignments are sent ([k, G]): the first `allowed` of each destination's run of sorted ones."""
  a = k * g
  dst_A = jnp.sort(expert_A) // el
  keep_sorted = jnp.arange(a) - send_off[me][dst_A] < allowed[me][dst_A]
  return jnp.zeros((a,), bool).at[order].set(keep_sorted).reshape(k, g)


def _ragged_experts(recv, counts, allowed, me, ep: int, el: int, rows: int, w_up, w_gate, w_down):
  """The received rows (source-major, each source's run sorted by expert) regrouped by local expert, run
  through the experts with `ragged_dot`, and put back in the order they came in (unused rows zero)."""
  mine = jax.lax.dynamic_slice_in_dim(counts, me * el, el, axis=1)  # [src, E_l]
  kept = jnp.clip(allowed[:, me][:, None] - _exclusive_cumsum(mine, 1), 0, mine)  # [src, E_l]
  bounds = jnp.cumsum(kept.reshape(-1))
  # Group of each row (ep * E_l for the unused tail): how many group ends it is past.
  group_r = jnp.sum(jnp.arange(rows)[:, None] >= bounds[None, :], axis=1)
  expert_r = jnp.where(group_r < ep * el, group_r % el, el)
  perm = jnp.argsort(expert_r, stable=True)
  sizes = kept.sum(0)
  dt = recv.dtype
  xg = recv[perm]
  h = jax.lax.ragged_dot(xg, w_up.astype(dt), sizes)
  gate = jax.lax.ragged_dot(xg, w_gate.astype(dt), sizes)
  out = jax.lax.ragged_dot(jax.nn.silu(gate) * h, w_down.astype(dt), sizes)
  out = jnp.where((jnp.arange(rows) < sizes.sum())[:, None], out, 0)
  return jnp.zeros_like(out).at[perm].set(out)


def _ragged(x_GD, idx_kG, cfg: MoeConfig, ep_axis, w_up, w_gate, w_down, move: bool = True):
  """Ragged dispatch: assignments sorted by expert, each owner sent exactly its rows.

  Every device learns the whole count matrix (an all-gather of E integers per device), so senders and
  receivers agree on every offset without a handshake. A receiver takes at most R = ceil(cf * G * k) rows
  (its average share with headroom; all of them when cf <= 0); rows past R (the last sources' last
  experts) are dropped. Received rows are regrouped by local expert for `ragged_dot` and sent back the
  same way. Returns (y_kGD, keep_kG).
  """
  g, d = x_GD.shape
  k, e = idx_kG.shape[0], cfg.num_experts
  ep = jax.lax.axis_size(ep_axis) if ep_axis else 1
  me = jax.lax.axis_index(ep_axis) if ep_axis else 0
  el, a = e // ep, k * g
  rows = ep * a if cfg.capacity_factor <= 0 else max(1, math.ceil(cfg.capacity_factor * a))

  expert_A = idx_kG.reshape(a)  # choice-major: first choices first within each expert
  order = jnp.argsort(expert_A, stable=True)
  x_sorted = x_GD[jnp.tile(jnp.arange(g), k)[order]]
  counts, start, allowed, send_off = _ragged_offsets(expert_A, e, ep, el, rows, ep_axis)
  keep_kG = _ragged_kept(expert_A, order, send_off, allowed, me, el, k, g)

  if ep_axis:
    # output_offsets: where each of this device's slices lands in its receiver's buffer.
    send = ragged_exchange if move else _local_rows
    recv = checkpoint_name(send(x_sorted, jnp.zeros((rows, d), x_GD.dtype), send_off[me], allowed[me], start[me],
                                allowed[:, me], ep_axis), EXCHANGED)
  else:
    recv = jnp.zeros((rows, d), x_GD.dtype).at[:a].set(x_sorted[:rows]) if rows >= a else x_sorted[:rows]

  out = _ragged_experts(recv, counts, allowed, me, ep, el, rows, w_up, w_gate, w_down)
  dt = recv.dtype
  if ep_axis:
    back = checkpoint_name(send(out, jnp.zeros((a, d), dt), start[:, me], allowed[:, me], send_off[:, me],
                                allowed[me], ep_axis), EXCHANGED)
  else:
    back = jnp.zeros((a, d), dt).at[:min(a, rows)].set(out[:min(a, rows)])
  y_A = jnp.zeros_like(back).at[order].set(back)
  return y_A.reshape(k, g, d), keep_kG


def _route_and_run(x_GD, router_DE, w_up, w_gate, w_down, cfg: MoeConfig, ep_axis: str | None,
                   sum_axes: tuple[str, ...], move: bool = True):
  """One group: route, dispatch, run the experts, combine. Returns (y_GD, aux_loss, stats)."""
  f32 = jnp.float32
  g, _ = x_GD.shape
  e, k = cfg.num_experts, cfg.top_k
  total = (lambda a: jax.lax.psum(a, sum_axes)) if sum_axes else (lambda a: a)

  logits_GE = x_GD.astype(f32) @ router_DE.astype(f32)
  probs_GE = jax.nn.softmax(logits_GE, axis=-1)
  weights_Gk, top_i_Gk = top_k_weights(logits_GE, k)
  idx_kG = top_i_Gk.T

  dispatch = dispatch_for(jax.default_backend(), cfg.dispatch)
  run = _ragged if dispatch == "ragged_all_to_all" else _padded
  y_kGD, keep_kG = run(x_GD, idx_kG, cfg, ep_axis, w_up, w_gate, w_down, move)
  y_GD = combine(y_kGD, weights_Gk, keep_kG)

  tokens = total(jnp.asarray(g, f32))
  assigned_E = total(jnp.sum(jax.nn.one_hot(idx_kG, e, dtype=f32), axis=(0, 1)))  # [E], the whole batch's
  share_E = assigned_E / (tokens * k)
  prob_E = total(jnp.sum(probs_GE, axis=0)) / tokens
  load_balance = e * jnp.sum(share_E * prob_E)
  z_loss = total(jnp.sum(jax.nn.logsumexp(logits_GE, axis=-1) ** 2)) / tokens
  aux = cfg.aux_loss_coef * load_balance + cfg.z_loss_coef * z_loss
  stats = {"moe_dropped": total(jnp.sum(~keep_kG).astype(f32)), "moe_assignments": tokens * k,
           "moe_load_balance": load_balance, "moe_z_loss": z_loss, "moe_expert_assignments": assigned_E}
  return y_GD, aux, stats


def group_axes() -> tuple[str, ...]:
  """Mesh axes of size > 1 that split `batch` (the project's rules): tokens are routed per shard."""
  return par.mesh_axes_for("batch", min_size=2)


def moe_ffn(x_BTD: jax.Array, router_DE, w_up, w_gate, w_down, cfg: MoeConfig, move: bool = True):
  """[B, T, D] -> ([B, T, D], aux_loss, stats): routed per batch shard, experts over `expert`.

  Where the batch axes are already manual (inside a pipeline stage), the local tokens and local experts
  are used directly; otherwise a shard_map over them makes them so.
  """
  b, t, d = x_BTD.shape
  axes = group_axes()
  mesh = jax.sharding.get_abstract_mesh()
  ep_axis = EXPERT if EXPERT in axes else None
  if ep_axis and cfg.num_experts % mesh.shape[EXPERT]:
    raise ValueError(f"ep:{mesh.shape[EXPERT]} does not divide the {cfg.num_experts} experts")

  def group(x, r, wu, wg, wd):
    bl = x.shape[0]
    y, aux, stats = _route_and_run(x.reshape(bl * t, d), r, wu, wg, wd, cfg, ep_axis, axes, move)
    return y.reshape(bl, t, d), aux, stats

  auto = tuple(a for a in axes if a not in mesh.manual_axes)
  if not auto:
    return group(x_BTD, router_DE, w_up, w_gate, w_down)
  if len(auto) != len(axes):
    raise NotImplementedError(f"MoE with batch axes {axes} partly manual ({set(axes) - set(auto)}): make all"
                              " or none of them manual around it")
  wspec = jax.P(ep_axis)
  stats_tree = {k: jax.P() for k in STATS}
  return jax.shard_map(group, in_specs=(jax.P(axes), jax.P(), wspec, wspec, wspec),
                       out_specs=(jax.P(axes), jax.P(), stats_tree), axis_names=set(axes))(
                           x_BTD, router_DE, w_up, w_gate, w_down)


class MoeMlp(nnx.Module):
  """Router [D, E] (float32 routing) and E SwiGLU experts, `experts` split over the `expert` axis.

  `exchange=False` builds the timing arm that skips the token exchange (values meaningless)."""

  def __init__(self, d_model: int, d_ff: int, cfg: MoeConfig, rngs: nnx.Rngs, out_std: float,
               exchange: bool = True):
    e = cfg.num_experts
    self.cfg, self.move = cfg, exchange
    self.router = param(rngs, (d_model, e), ("embed", None))
    self.w_up = param(rngs, (e, d_model, d_ff), ("experts", "embed", "mlp"))
    self.w_gate = param(rngs, (e, d_model, d_ff), ("experts", "embed", "mlp"))
    self.w_down = param(rngs, (e, d_ff, d_model), ("experts", "mlp", "embed"), jax.nn.initializers.normal(out_std))

  def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    # Expert weights cast to the compute dtype on their shard (so an FSDP gather moves compute-dtype bytes);
    # the router routes in float32.
    cast = lambda v: constrain(v[...].astype(x_BTD.dtype), v.get_metadata()["out_sharding"][-3:])
    return moe_ffn(x_BTD, self.router[...], cast(self.w_up), cast(self.w_gate), cast(self.w_down), self.cfg,
                   self.move)
