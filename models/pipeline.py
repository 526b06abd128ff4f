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

import dataclasses
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
  s, v = sched.stages, sched.virtual
  d = jax.lax.axis_index(AXIS)
  # Every input typed as differing per stage and data shard before anything is differentiated: the
  # transpose of a use of a replicated value is a psum, and a collective inside a branch that only some
  # stages take deadlocks (and one per microbatch is the cost this function exists to avoid).
  layer_params, head_params, x_MbTD, targets_M = _varying((layer_params, head_params, x_MbTD, targets_M))
  table = jnp.asarray(sched.table)
  moves = jnp.asarray(ps.sends(sched))  # [ticks, 2]: the same on every device
  ticks = _Ticks(stage_fn, head_fn, sched, d, layer_params, head_params, x_MbTD, targets_M,
                 transfer_pairs(s, v, +1), transfer_pairs(s, v, -1))
  stats_shape = jax.eval_shape(
      lambda: stage_fn(jax.tree.map(lambda a: a[0], layer_params), _varying(x_MbTD[0]))[2])
  carry = _zero_carry(sched, layer_params, head_params, x_MbTD, stats_shape)
  carry, _ = jax.lax.scan(ticks.tick, carry, (table, moves))
  _, _, g_layers, g_head, dx_M, loss, stats = carry
  return _reduce(sched.microbatches, lp_specs, layer_params, head_params, (g_layers, g_head, dx_M), loss, stats)


@dataclasses.dataclass(frozen=True, eq=False)  # identity hash: the fields are traced arrays
class _Ticks:
  """One tick of the schedule on this device (`tick`, the scan's body), in named steps: the forward, the
  backward, the transfers. The steps trace their ops in the order `tick` calls them, which is the order the
  compiled program keeps. `layer_params` ... `targets_M` are the inputs already typed as varying."""
  stage_fn: StageFn
  head_fn: HeadFn
  sched: Schedule
  d: jax.Array  # this device's stage
  layer_params: Any
  head_params: Any
  x_MbTD: jax.Array
  targets_M: Any
  fwd_pairs: list[tuple[int, int]]
  bwd_pairs: list[tuple[int, int]]

  def tick(self, carry, xs):
    rows, move = xs
    stash_x, stash_g, g_layers, g_head, dx_M, loss, stats = carry
    row = rows[self.d]
    f = tuple(jnp.maximum(row[i], 0) for i in (ps.F_CHUNK, ps.F_MB, ps.F_SLOT, ps.F_GSLOT))
    b = tuple(jnp.maximum(row[i], 0) for i in (ps.B_CHUNK, ps.B_MB, ps.B_SLOT, ps.B_GSLOT))
    rx, rg = row[ps.RECV_X], row[ps.RECV_G]
    send_x, stash_g, g_head, loss, stats = self.forward(row, f, stash_x, (stash_g, g_head, loss, stats))
    # The backward reads the gradient stash as the forward left it (the head may have just filled a slot).
    send_g, g_layers, dx_M = self.backward(row, b, stash_x, stash_g, (g_layers, dx_M))
    recv_x, recv_g = self.transfer(move, send_x, send_g)
    rxc, rgc = jnp.maximum(rx, 0), jnp.maximum(rg, 0)
    stash_x = stash_x.at[rxc].set(jnp.where(rx >= 0, recv_x, stash_x[rxc]))
    stash_g = stash_g.at[rgc].set(jnp.where(rg >= 0, recv_g, stash_g[rgc]))
    return (stash_x, stash_g, g_layers, g_head, dx_M, loss, stats), None

  def chunk(self, c):
    return jax.tree.map(lambda a: a[c], self.layer_params)

  def stage_value(self, params, x):
    y, aux, _ = self.stage_fn(params, x)
    return _varying((y, aux.astype(jnp.float32)))

  def forward(self, row, f, stash_x, args):
    """The tick's forward on this device, if it has one (a `lax.cond`): (activation to send, gradient stash,
    head grads, loss, stats); the last chunk's last stage also runs the head and stashes its gradient."""
    fc, fm, fs, fg = f
    d, s, v, f32 = self.d, self.sched.stages, self.sched.virtual, jnp.float32

    def forward(args):
      stash_g, g_head, loss, stats = args
      x = jnp.where((d == 0) & (fc == 0), self.x_MbTD[fm], stash_x[fs])
      y, aux, st = self.stage_fn(self.chunk(fc), x)
      stats = jax.tree.map(lambda a, b: a + b.astype(f32), stats, st)

      def head(args):
        stash_g, g_head, loss = args
        loss_m, (gh, dy) = jax.value_and_grad(self.head_fn, argnums=(0, 1))(self.head_params, y, self.targets_M[fm])
        g_head = jax.tree.map(jnp.add, g_head, gh)
        return stash_g.at[fg].set(dy.astype(stash_g.dtype)), g_head, loss + loss_m.astype(f32)

      stash_g, g_head, loss = jax.lax.cond((d == s - 1) & (fc == v - 1), head, _varying,
                                           (stash_g, g_head, loss))
      return y.astype(self.x_MbTD.dtype), stash_g, g_head, loss + aux.astype(f32), stats

    def no_forward(args):
      stash_g, g_head, loss, stats = args
      return _varying(jnp.zeros_like(self.x_MbTD[0])), stash_g, g_head, loss, stats

    return jax.lax.cond(row[ps.F_CHUNK] >= 0, forward, no_forward, args)

  def backward(self, row, b, stash_x, stash_g, args):
    """The tick's backward on this device, if it has one: recomputes the chunk's forward from the stashed
    input (`jax.vjp`); (input gradient to send, layer grads, stage-0 input grads)."""
    bc, bm, bs, bg = b
    d, x_MbTD = self.d, self.x_MbTD

    def backward(args):
      g_layers, dx_M = args
      x = jnp.where((d == 0) & (bc == 0), x_MbTD[bm], stash_x[bs])
      _, vjp = jax.vjp(self.stage_value, self.chunk(bc), x)
      dp, dx = vjp((stash_g[bg], _varying(jnp.ones((), jnp.float32))))
      g_layers = jax.tree.map(lambda g, a: g.at[bc].add(a.astype(jnp.float32)), g_layers, dp)
      dx = dx.astype(x_MbTD.dtype)
      dx_M = dx_M.at[bm].set(jnp.where((d == 0) & (bc == 0), dx, dx_M[bm]))
      return dx, g_layers, dx_M

    def no_backward(args):
      g_layers, dx_M = args
      return _varying(jnp.zeros_like(x_MbTD[0])), g_layers, dx_M

    return jax.lax.cond(row[ps.B_CHUNK] >= 0, backward, no_backward, args)

  def transfer(self, move, send_x, send_g):
    """Activations one stage on, gradients one stage back: (received activation, received gradient)."""
    if self.sched.stages > 1:  # a transfer runs on every stage or on none: only on ticks where some stage sends
      recv_x = jax.lax.cond(move[0], lambda a: jax.lax.ppermute(a, AXIS, self.fwd_pairs), _varying, send_x)
      recv_g = jax.lax.cond(move[1], lambda a: jax.lax.ppermute(a, AXIS, self.bwd_pairs), _varying, send_g)
      return recv_x, recv_g
    return send_x, send_g  # one device: chunk c hands over to chunk c+1 on itself


def _zero_carry(sched: Schedule, layer_params, head_params, x_MbTD: jax.Array, stats_shape) -> tuple:
  """The tick loop's carry at the start: stashes, float32 gradient accumulators, input grads, loss, stats."""
  f32 = jnp.float32
  zeros = lambda tree, dtype=None: _varying(jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree))
  return (
      zeros(jax.ShapeDtypeStruct((sched.x_slots, *x_MbTD.shape[1:]), x_MbTD.dtype)),
      zeros(jax.ShapeDtypeStruct((sched.g_slots, *x_MbTD.shape[1:]), x_MbTD.dtype)),
      zeros(layer_params, f32),
      zeros(head_params, f32),
      zeros(x_MbTD),
      zeros(jax.ShapeDtypeStruct((), f32)),
      zeros(stats_shape, f32),
  )


def _reduce(m: int, lp_specs, layer_params, head_params, grads: tuple, loss: jax.Array, stats):
  """The accumulated figures reduced once, after the last microbatch, over stages and batch shards, and
  scaled to means: (loss, stats, layer grads, head grads, input grads)."""
  g_layers, g_head, dx_M = grads
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
  wide = jnp.float32 if jax.default_backend() == "cpu" else dx_M.dtype
  dx_M = (stage_sum(dx_M.astype(wide)).astype(jnp.float32) * (scale / shards)).astype(dx_M.dtype)  # over batch shards
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
