"""Pipeline parallelism: a stack of layers split over the `stage` mesh axis, run by a schedule table.

The layers' stacked parameters (leading dims `[V, L/V]`, the second sharded over `stage`) stay where
they are; microbatches move. Inside a `shard_map` that is manual over `stage` only (data, fsdp, tensor
and expert stay automatic, so the layers' own sharding rules still apply), one `lax.scan` step per tick
of the schedule (`microbench.models.pipeline_schedule`) runs this device's forward and backward of the tick,
each under a `lax.cond` (a device with nothing to do runs nothing), then moves activations one stage on
and gradients one stage back with `ppermute`. The backward recomputes its chunk's forward from the
stashed input (`jax.vjp`), so only stage inputs are kept between a microbatch's forward and backward.

Forward and backward of the whole pipeline happen in one pass (1F1B interleaves them), so the loss and
every gradient come out together; `pipeline_loss` is a `custom_vjp` whose backward only scales those
gradients, which lets `jax.grad` of the model's loss see an ordinary differentiable function.

Every mesh axis that splits the batch (`data`, `fsdp`, `expert`) is manual too: each batch shard
accumulates its own gradients over the microbatches and they are reduced once, after the last
microbatch (as Megatron does); left automatic, XLA would all-reduce every microbatch's gradients inside
the loop. Weights enter whole except along `stage` and `expert` (each device runs its own layers and
experts), so FSDP gathers a stage's weights once per step at the boundary and reduce-scatters their
gradients once at the end (MaxText's pipeline option `pipeline_fsdp_ag_once`), not per microbatch.
Inside, the layers see the sharding rules without the manual axes (tensor parallelism stays automatic);
an MoE layer finds its batch axes already manual and exchanges tokens over `expert` directly.

The last virtual stage runs the head (final norm, LM head, loss) on each microbatch as its forward
finishes; the embedding stays outside (the input-activation gradient comes back out). The head's
parameters and the input-activation gradient are replicated over `stage`, so both are summed over
`stage` (an all-reduce) at the end of the step; Megatron keeps them on the first/last stage instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from microbench.meshes import parallelism as par
from microbench.models import pipeline_schedule as ps
from microbench.models.layers import BlockStack, Stats, run_layers, stack_chunks, unstack_chunks  # noqa: F401
from microbench.models.pipeline_schedule import Schedule

AXIS = "stage"
# Weight dims that stay split inside the stages (the layer code runs on its local slice of these).
LOCAL_WEIGHT_AXES = (AXIS, "expert")

# stage_fn(chunk_params, x_bTD) -> (y_bTD, aux_loss, stats): one chunk of layers on one microbatch. aux_loss
# (float32 scalar) is added to the objective (MoE load balancing); stats (dict of float32 scalars) are
# summed over microbatches and stages, never differentiated.
StageFn = Callable[[Any, jax.Array], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]
# head_fn(head_params, y_bTD, targets_b) -> float32 scalar loss of one microbatch.
HeadFn = Callable[[Any, jax.Array, Any], jax.Array]


def to_microbatches(x: jax.Array, m: int) -> jax.Array:
  """[B, ...] -> [M, B/M, ...], microbatch i taking examples i, i+M, ...: each microbatch then spans
  every data-parallel shard of the batch (a contiguous split would put whole microbatches on one)."""
  return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def transfer_pairs(stages: int, virtual: int, step: int) -> list[tuple[int, int]]:
  """ppermute pairs moving data `step` (+1 forward, -1 backward) stages; circular when chunks wrap from
  the last device to the first (interleaved)."""
  if virtual > 1:
    return [(i, (i + step) % stages) for i in range(stages)]
  return [(i, i + step) for i in range(stages) if 0 <= i + step < stages]


def batch_axes() -> tuple[str, ...]:
  """The mesh axes that split `batch` (from the project's rules), present in the current mesh."""
  return par.mesh_axes_for("batch")


def _manual() -> tuple[str, ...]:
  return (AXIS, *batch_axes())


def _varying(x):
  """Marks values as differing per stage and batch shard (shard_map's type check needs loop carries and
  both branches of a cond to agree)."""
  return par.vary(x, _manual())


def _spec_axes(spec: jax.P) -> set[str]:
  return {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}



def _run(stage_fn: StageFn, head_fn: HeadFn, sched: Schedule, lp_specs, layer_params, head_params, x_MbTD,
         targets_M):
  """The schedule inside shard_map (manual over `stage` and the batch axes): (loss, stats, layer grads,
  head grads, input grads), each already reduced over stages and batch shards."""
  s, v, m = sched.stages, sched.virtual, sched.microbatches
  d = jax.lax.axis_index(AXIS)
  # Every input typed as differing per stage and data shard before anything is differentiated: the
  # transpose of a use of a replicated value is a psum, and a collective inside a branch that only some
  # stages take deadlocks (and one per microbatch is the cost this function exists to avoid).
  layer_params, head_params, x_MbTD, targets_M = _varying((layer_params, head_params, x_MbTD, targets_M))
  f32 = jnp.float32
  table = jnp.asarray(sched.table)
  moves = jnp.asarray(ps.sends(sched))  # [ticks, 2]: the same on every device
  fwd_pairs, bwd_pairs = transfer_pairs(s, v, +1), transfer_pairs(s, v, -1)
  stats_shape = jax.eval_shape(
      lambda: stage_fn(jax.tree.map(lambda a: a[0], layer_params), _varying(x_MbTD[0]))[2])

  def chunk(params, c):
    return jax.tree.map(lambda a: a[c], params)

  def stage_value(params, x):
    y, aux, _ = stage_fn(params, x)
    return _varying((y, aux.astype(f32)))

  def tick(carry, xs):
    rows, move = xs
    stash_x, stash_g, g_layers, g_head, dx_M, loss, stats = carry
    row = rows[d]
    fc, fm, fs, fg = (jnp.maximum(row[i], 0) for i in (ps.F_CHUNK, ps.F_MB, ps.F_SLOT, ps.F_GSLOT))
    bc, bm, bs, bg = (jnp.maximum(row[i], 0) for i in (ps.B_CHUNK, ps.B_MB, ps.B_SLOT, ps.B_GSLOT))
    rx, rg = row[ps.RECV_X], row[ps.RECV_G]

    def forward(args):
      stash_g, g_head, loss, stats = args
      x = jnp.where((d == 0) & (fc == 0), x_MbTD[fm], stash_x[fs])
      y, aux, st = stage_fn(chunk(layer_params, fc), x)
      stats = jax.tree.map(lambda a, b: a + b.astype(f32), stats, st)

      def head(args):
        stash_g, g_head, loss = args
        loss_m, (gh, dy) = jax.value_and_grad(head_fn, argnums=(0, 1))(head_params, y, targets_M[fm])
        g_head = jax.tree.map(jnp.add, g_head, gh)
        return stash_g.at[fg].set(dy.astype(stash_g.dtype)), g_head, loss + loss_m.astype(f32)

      stash_g, g_head, loss = jax.lax.cond((d == s - 1) & (fc == v - 1), head, _varying,
                                           (stash_g, g_head, loss))
      return y.astype(x_MbTD.dtype), stash_g, g_head, loss + aux.astype(f32), stats

    def no_forward(args):
      stash_g, g_head, loss, stats = args
      return _varying(jnp.zeros_like(x_MbTD[0])), stash_g, g_head, loss, stats

    send_x, stash_g, g_head, loss, stats = jax.lax.cond(row[ps.F_CHUNK] >= 0, forward, no_forward,
                                                        (stash_g, g_head, loss, stats))

    def backward(args):
      g_layers, dx_M = args
      x = jnp.where((d == 0) & (bc == 0), x_MbTD[bm], stash_x[bs])
      _, vjp = jax.vjp(stage_value, chunk(layer_params, bc), x)
      dp, dx = vjp((stash_g[bg], _varying(jnp.ones((), f32))))
      g_layers = jax.tree.map(lambda g, a: g.at[bc].add(a.astype(f32)), g_layers, dp)
      dx = dx.astype(x_MbTD.dtype)
      dx_M = dx_M.at[bm].set(jnp.where((d == 0) & (bc == 0), dx, dx_M[bm]))
      return dx, g_layers, dx_M

    def no_backward(args):
      g_layers, dx_M = args
      return _varying(jnp.zeros_like(x_MbTD[0])), g_layers, dx_M

    send_g, g_layers, dx_M = jax.lax.cond(row[ps.B_CHUNK] >= 0, backward, no_backward, (g_layers, dx_M))

    if s > 1:  # a transfer runs on every stage or on none: only on ticks where some stage has data to send
      recv_x = jax.lax.cond(move[0], lambda a: jax.lax.ppermute(a, AXIS, fwd_pairs), _varying, send_x)
      recv_g = jax.lax.cond(move[1], lambda a: jax.lax.ppermute(a, AXIS, bwd_pairs), _varying, send_g)
    else:  # one device: chunk c hands over to chunk c+1 on itself
      recv_x, recv_g = send_x, send_g
    rxc, rgc = jnp.maximum(rx, 0), jnp.maximum(rg, 0)
    stash_x = stash_x.at[rxc].set(jnp.where(rx >= 0, recv_x, stash_x[rxc]))
    stash_g = stash_g.at[rgc].set(jnp.where(rg >= 0, recv_g, stash_g[rgc]))
    return (stash_x, stash_g, g_layers, g_head, dx_M, loss, stats), None

  zeros = lambda tree, dtype=None: _varying(jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree))
  carry = (
      zeros(jax.ShapeDtypeStruct((sched.x_slots, *x_MbTD.shape[1:]), x_MbTD.dtype)),
      zeros(jax.ShapeDtypeStruct((sched.g_slots, *x_MbTD.shape[1:]), x_MbTD.dtype)),
      zeros(layer_params, f32),
      zeros(head_params, f32),
      zeros(x_MbTD),
      zeros(jax.ShapeDtypeStruct((), f32)),
      zeros(stats_shape, f32),
  )
  carry, _ = jax.lax.scan(tick, carry, (table, moves))
  _, _, g_layers, g_head, dx_M, loss, stats = carry
  # The objective is the mean over batch shards of each shard's loss. A gradient is summed over the
  # batch shards that share its parameter (not over `expert` for a local expert's weights: the
  # all-to-all's transpose already brought every shard's share to it) and divided by the shard count.
  bax = batch_axes()
  shards = 1
  for a in bax:
    shards *= jax.lax.axis_size(a)
  scale = 1.0 / m

  def reduce_grad(g, p, spec):
    over = tuple(a for a in bax if a not in _spec_axes(spec))
    g = jax.lax.psum(g, over) if over else g
    return (g * (scale / shards)).astype(p.dtype)

  stage_sum = lambda t: jax.tree.map(lambda a: jax.lax.psum(a, AXIS), t)
  g_layers = jax.tree.map(reduce_grad, g_layers, layer_params, lp_specs)
  g_head = jax.tree.map(lambda g, p: reduce_grad(g, p, jax.P()), stage_sum(g_head), head_params)
  stats = jax.tree.map(lambda a: jax.lax.pmean(a, bax), stage_sum(stats))
  # Only stage 0's is non-zero, so the sum is exact in any dtype. On CPU it is summed in float32: XLA:CPU's
  # all-reduce promotion crashes on a bfloat16 psum written inside shard_map under a mesh context ("Invalid
  # binary instruction opcode copy"); elsewhere in the compute dtype (half the bytes of the step's largest
  # stage collective in bfloat16).
  wide = f32 if jax.default_backend() == "cpu" else dx_M.dtype
  dx_M = (stage_sum(dx_M.astype(wide)).astype(f32) * (scale / shards)).astype(dx_M.dtype)  # split over batch shards
  return jax.lax.pmean(stage_sum(loss), bax) * scale, stats, g_layers, g_head, dx_M


def pipeline_loss(stage_fn: StageFn, head_fn: HeadFn, sched: Schedule, layer_params: Any, head_params: Any,
                  x_MbTD: jax.Array, targets_M: Any, layer_specs: Any = None
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean over microbatches of head loss + stage aux losses, and the stats; differentiable in
  `layer_params` (leaves `[V, L/V, ...]`, dim 1 over `stage`), `head_params` and `x_MbTD` (the
  microbatched stage-0 input, `[M, B/M, ...]`; `targets_M` leaves are microbatched too).

  `layer_specs` (PartitionSpecs of the leaves as laid out, default `P(None, "stage")`) says which weight
  dims stay split inside: only `stage` and `expert` are kept. Stats are per-microbatch totals over the
  batch (the same on every batch shard), summed over microbatches and stages. Runs under the mesh set
  with `jax.set_mesh` and, when the layers pin shardings, flax's logical-axis rules.
  """
  from flax.core import spmd  # pylint: disable=g-import-not-at-top

  if (stages := par.axis_size(AXIS)) != sched.stages:
    raise ps.ScheduleError(f"the schedule is for {sched.stages} stages but the mesh's `stage` axis has {stages}")
  for leaf in jax.tree.leaves(layer_params):
    if leaf.shape[0] != sched.virtual:
      raise ps.ScheduleError(f"layer parameters lead with {leaf.shape[0]} chunks; the schedule runs"
                             f" {sched.virtual} per stage (stack them with stack_chunks)")
    check_layers(leaf.shape[0] * leaf.shape[1], sched.stages, sched.virtual)
  manual = _manual()
  bax = batch_axes()
  rules = spmd.get_logical_axis_rules()
  inner_rules = tuple((name, par.filter_axes(axes, drop=manual)) for name, axes in rules)
  if layer_specs is None:
    layer_specs = jax.tree.map(lambda _: jax.P(None, AXIS), layer_params)
  lp_specs = jax.tree.map(
      lambda spec: jax.P(*(par.filter_axes(e, keep=LOCAL_WEIGHT_AXES) for e in spec)),
      layer_specs, is_leaf=lambda x: isinstance(x, jax.P))
  rep = lambda t: jax.tree.map(lambda _: jax.P(), t)
  micro = lambda t: jax.tree.map(lambda _: jax.P(None, bax), t)
  stats = jax.eval_shape(lambda: stage_fn(jax.tree.map(lambda a: a[0], layer_params), x_MbTD[0])[2])

  def body(lp, hp, x, t):
    with spmd.logical_axis_rules(inner_rules):
      return _run(stage_fn, head_fn, sched, lp_specs, lp, hp, x, t)

  run = jax.shard_map(body, in_specs=(lp_specs, rep(head_params), micro(x_MbTD), micro(targets_M)),
                      out_specs=(jax.P(), rep(stats), lp_specs, rep(head_params), micro(x_MbTD)),
                      axis_names=set(manual))

  @jax.custom_vjp
  def loss_fn(lp, hp, x, t):
    loss, stats, *_ = run(lp, hp, x, t)
    return loss, stats

  def fwd(lp, hp, x, t):
    loss, stats, gl, gh, dx = run(lp, hp, x, t)
    return (loss, stats), (gl, gh, dx)

  def bwd(res, cts):
    gl, gh, dx = res
    ct = cts[0]
    scale = lambda tree: jax.tree.map(lambda g: (g * ct).astype(g.dtype), tree)
    return scale(gl), scale(gh), scale(dx), None

  loss_fn.defvjp(fwd, bwd)
  return loss_fn(layer_params, head_params, x_MbTD, targets_M)


def check_layers(num_layers: int, stages: int, virtual: int = 1) -> None:
  """Refuses a layer count the stages can't split evenly, with one line."""
  if num_layers % (stages * virtual):
    what = f"pp:{stages}" + (f" x {virtual} virtual stages" if virtual > 1 else "")
    raise ps.ScheduleError(f"{what} does not divide the model's {num_layers} layers; choose --layers a multiple"
                           f" of {stages * virtual} (uneven splits are refused: every stage must take the same"
                           " time, or the slowest sets the pace)")



# ---------------------------------------------------------------------------------------------------------
# A model's block stack through the pipeline


def stages() -> int:
  """The `stage` axis of the active mesh (1 outside a mesh): a model pipelines when it is > 1."""
  return par.axis_size(AXIS)


def values(state: nnx.State) -> nnx.State:
  """A module's state as plain arrays (what crosses the pipeline's shard_map; `nnx.merge` takes it back)."""
  return jax.tree.map(lambda v: v[...], state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@functools.cache
def schedule(kind: str, stages_: int, microbatches: int, virtual: int, bubble: bool = True) -> Schedule:
  """The simulated schedule (cached: simulated once per shape); `bubble=False`: its no-bubble twin."""
  sched = ps.make_schedule(kind, stages_, microbatches, virtual)
  return sched if bubble else ps.no_bubble(sched)


def stack_loss(stack: BlockStack, x_BTD: jax.Array, targets: Any, head_fn: HeadFn, head_params: Any
               ) -> tuple[jax.Array, Stats]:
  """A model's objective with its `BlockStack` split over `stage`: the stage-0 input `x_BTD` (embedded
  outside) and `targets` are cut into the execution's microbatches, each chunk of layers runs with the
  stack's own remat policy, `head_fn(head_params, y, targets)` gives each microbatch's loss on the last
  stage. Layer parameters lead with `[V, L/V]` when the stack was built for V virtual stages."""
  from flax.core import spmd  # pylint: disable=g-import-not-at-top

  ex = stack.execution
  m, v = ex.microbatches, ex.virtual_stages
  sched = schedule(ex.schedule, stages(), m, v, ex.without != "bubble")
  graphdef, state = nnx.split(stack.layers)
  rules = spmd.get_logical_axis_rules() or par.RULES
  specs = jax.tree.map(lambda var: par.spec_for(var.get_metadata()["out_sharding"], rules), state,
                       is_leaf=lambda x: isinstance(x, nnx.Variable))
  layer_params = values(state)
  if v == 1:  # [L, ...] -> [1, L, ...]: the leading chunk dim the executor indexes
    layer_params = stack_chunks(layer_params, 1)
    specs = jax.tree.map(lambda spec: jax.P(None, *spec), specs, is_leaf=lambda x: isinstance(x, jax.P))

  def stage_fn(p, x):
    return run_layers(graphdef, p, x, ex)

  micro = lambda t: jax.tree.map(lambda a: to_microbatches(a, m), t)
  return pipeline_loss(stage_fn, head_fn, sched, layer_params, head_params, micro(x_BTD), micro(targets),
                       layer_specs=specs)
