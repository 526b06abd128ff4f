"""Context (sequence) parallelism for attention: the sequence split over the `context` mesh axis.

Everything in a transformer except attention is per token, so splitting the sequence over `context`
(the rules map `act_seq` to it) needs work only here. Two forms:

- `ring` (ring attention): each device keeps its query block and passes its key/value block round the
  ring with `ppermute`, C steps, combining blocks with an online softmax (running max and sum). Causal
  masking by block: a key block after the query block is skipped, the diagonal block is masked inside,
  earlier blocks are used whole. The backward is a second ring pass (flash-attention style) in which
  each key/value block travels with its gradient accumulators and arrives home after C steps; only
  q, k, v, the output and the log-sum-exp are kept between forward and backward, so activation memory
  per device is O(T/C). Devices late in the sequence do more blocks than early ones under a causal mask
  (striped/zigzag layouts would even it out; see BUILD_NOTES).
- `all_to_all` (DeepSpeed-Ulysses): an all-to-all re-splits q, k, v from sequence to heads, attention
  runs on whole sequences for H/C heads, and a second all-to-all splits the output back by sequence.
  Heads are re-split inside each tensor-parallel shard's heads, so it needs the heads (and KV heads)
  divisible by C x the tensor-parallel degree. (Written first as two sharding constraints, XLA's
  partitioner added an all-gather of whole heads in the backward; explicit all-to-alls move the least.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from microbench.meshes import parallelism as par


AXIS = "context"
IMPLS = ("ring", "all_to_all")


class ContextError(ValueError):
  """A context-parallel configuration that can't run; one line saying what is allowed."""


def context_size() -> int:
  """The `context` axis of the active mesh (1 outside a mesh): attention goes context-parallel when > 1."""
  return par.axis_size(AXIS)


def check(impl: str, context: int, seq_len: int, heads: int, kv_heads: int, tensor: int = 1) -> None:
  """Refuses what a context-parallel form can't split, with one line."""
  if impl not in IMPLS:
    raise ContextError(f"unknown --context_impl={impl!r}; choose one of {', '.join(IMPLS)}")
  if seq_len % context:
    raise ContextError(f"cp:{context} does not divide the sequence length {seq_len}; choose --seq_len a multiple"
                       f" of {context}")
  if impl == "all_to_all":
    for what, n in (("attention heads", heads), ("kv heads", kv_heads)):
      if n % (context * tensor):
        raise ContextError(f"--context_impl=all_to_all splits heads over cp x tp = {context * tensor}, which does"
                           f" not divide the {n} {what}; use --context_impl=ring or smaller degrees")


# ---------------------------------------------------------------------------------------------------------
# Ring attention (inside shard_map, manual over `context`)


def ring_pairs(c: int) -> list[tuple[int, int]]:
  """K/V move one device on per step: device i then holds the block of device i - step."""
  return [(i, (i + 1) % c) for i in range(c)]


def block_mask(q_block: jax.Array, k_block: jax.Array, tq: int, tk: int) -> jax.Array:
  """Causal mask [tq, tk] between query block `q_block` and key block `k_block` (equal block sizes)."""
  qi = q_block * tq + jnp.arange(tq)[:, None]
  ki = k_block * tk + jnp.arange(tk)[None, :]
  return qi >= ki


def _scores(q, k, scale):
  """q [B, Tq, K, R, H], k [B, Tk, K, H] -> [B, K, R, Tq, Tk] in float32."""
  return jnp.einsum("bqkrh,btkh->bkrqt", q, k, preferred_element_type=jnp.float32) * scale


def _ring_geometry(q):
  """(ring size, this device's block, block length, softmax scale, the ring's permutation) inside the map."""
  c = jax.lax.axis_size(AXIS)
  return c, jax.lax.axis_index(AXIS), q.shape[1], q.shape[-1] ** -0.5, ring_pairs(c)


def _ring_fwd_local(q, k, v, causal: bool):
  """Local blocks: q [B, Tc, K, R, H], k/v [B, Tc, K, H] -> (out like q, lse [B, K, R, Tc])."""
  c, me, tc, scale, shift = _ring_geometry(q)
  f32 = jnp.float32

  def step(carry, i):
    o, m, l, k, v = carry
    src = (me - i) % c

    def attend(args):
      o, m, l = args
      s = _scores(q, k, scale)
      if causal:
        s = jnp.where(block_mask(me, src, tc, tc), s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])
      corr = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
      l = l * corr + p.sum(-1)
      o = o * jnp.moveaxis(corr, -1, 1)[..., None] + jnp.einsum("bkrqt,btkh->bqkrh", p.astype(v.dtype), v,
                                                                preferred_element_type=f32)
      return o, m_new, l

    if causal:
      o, m, l = jax.lax.cond(src <= me, attend, lambda a: a, (o, m, l))
    else:
      o, m, l = attend((o, m, l))
    k, v = jax.lax.ppermute((k, v), AXIS, shift)  # the last rotation brings every block home
    return (o, m, l, k, v), None

  b, _, kh, r, h = q.shape
  o = jnp.zeros(q.shape, f32)
  m = jnp.full((b, kh, r, tc), -jnp.inf, f32)
  l = jnp.zeros((b, kh, r, tc), f32)
  (o, m, l, _, _), _ = jax.lax.scan(step, (o, m, l, k, v), jnp.arange(c))
  out = o / jnp.moveaxis(l, -1, 1)[..., None]
  return out.astype(q.dtype), m + jnp.log(l)


def _ring_bwd_local(q, k, v, out, lse, do, causal: bool):
  """Second ring pass: (dq, dk, dv) for the local blocks."""
  c, me, tc, scale, shift = _ring_geometry(q)
  f32 = jnp.float32
  delta = jnp.einsum("bqkrh,bqkrh->bkrq", do.astype(f32), out.astype(f32))

  def step(carry, i):
    dq, k, v, dk, dv = carry
    src = (me - i) % c

    def grads(args):
      dq, dk, dv = args
      s = _scores(q, k, scale)
      p = jnp.exp(s - lse[..., None])
      if causal:
        p = jnp.where(block_mask(me, src, tc, tc), p, 0.0)
      dv = dv + jnp.einsum("bkrqt,bqkrh->btkh", p, do.astype(f32))
      dp = jnp.einsum("bqkrh,btkh->bkrqt", do.astype(f32), v.astype(f32))
      ds = p * (dp - delta[..., None]) * scale
      dq = dq + jnp.einsum("bkrqt,btkh->bqkrh", ds, k.astype(f32))
      dk = dk + jnp.einsum("bkrqt,bqkrh->btkh", ds, q.astype(f32))
      return dq, dk, dv

    if causal:
      dq, dk, dv = jax.lax.cond(src <= me, grads, lambda a: a, (dq, dk, dv))
    else:
      dq, dk, dv = grads((dq, dk, dv))
    k, v, dk, dv = jax.lax.ppermute((k, v, dk, dv), AXIS, shift)
    return (dq, k, v, dk, dv), None

  zeros = lambda a: jnp.zeros(a.shape, f32)
  (dq, _, _, dk, dv), _ = jax.lax.scan(step, (zeros(q), k, v, zeros(k), zeros(v)), jnp.arange(c))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _varying(grads):
  """Gradients typed as varying over the enclosing manual mesh axes, as their primals are (inside a pipeline
  stage, whose stage and batch axes are manual, activations vary over all of them); the inner shard_map's
  check_vma=False loses that typing, and a custom VJP must return its primals' types."""
  return tuple(par.vary(tuple(grads)))


def _seq_spec(ndim: int) -> jax.P:
  return jax.P(None, AXIS, *([None] * (ndim - 2)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring(q, k, v, causal):
  return _ring_fwd(q, k, v, causal)[0]


def _ring_fwd(q, k, v, causal):
  lse_spec = jax.P(None, None, None, AXIS)
  out, lse = jax.shard_map(functools.partial(_ring_fwd_local, causal=causal),
                           in_specs=(_seq_spec(5), _seq_spec(4), _seq_spec(4)),
                           out_specs=(_seq_spec(5), lse_spec), axis_names={AXIS}, check_vma=False)(q, k, v)
  return out, (q, k, v, out, lse)


def _ring_bwd(causal, res, do):
  q, k, v, out, lse = res
  lse_spec = jax.P(None, None, None, AXIS)
  return _varying(jax.shard_map(functools.partial(_ring_bwd_local, causal=causal),
                       in_specs=(_seq_spec(5), _seq_spec(4), _seq_spec(4), _seq_spec(5), lse_spec, _seq_spec(5)),
                       out_specs=(_seq_spec(5), _seq_spec(4), _seq_spec(4)), axis_names={AXIS},
                       check_vma=False)(q, k, v, out, lse, do))


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, causal: bool = True) -> jax.Array:
  """Attention with the sequence split over `context`, K/V passed round the ring."""
  b, t, n, h = q_BTNH.shape
  kh = k_BTKH.shape[2]
  q = q_BTNH.reshape(b, t, kh, n // kh, h)
  return _ring(q, k_BTKH, v_BTKH, causal).reshape(b, t, n, h)


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed-Ulysses (inside shard_map, manual over `context` and `tensor`: heads are re-split within each
# tensor-parallel shard's own heads, so the two splits never mix)


def _ulysses_axes() -> tuple[str, ...]:
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(a for a in (AXIS, "tensor") if a in mesh.axis_names)


def _heads_spec() -> jax.P:
  """Whole sequence, heads split by tensor (outer) then context (inner)."""
  axes = tuple(reversed(_ulysses_axes()))
  return jax.P(None, None, axes, None)


def _seq_heads_spec() -> jax.P:
  """Sequence split by context, heads by tensor (the layout outside)."""
  return jax.P(None, AXIS, "tensor" if "tensor" in _ulysses_axes() else None, None)


def to_heads(x: jax.Array) -> jax.Array:
  """[B, T/C, N, H] -> [B, T, N/C, H]: heads split, sequence gathered (one all-to-all)."""
  return jax.lax.all_to_all(x, AXIS, 2, 1, tiled=True)


def to_sequence(x: jax.Array) -> jax.Array:
  """[B, T, N/C, H] -> [B, T/C, N, H] (the inverse all-to-all)."""
  return jax.lax.all_to_all(x, AXIS, 1, 2, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ulysses(q, k, v, causal):
  return _ulysses_fwd(q, k, v, causal)[0]


def _ulysses_fwd(q, k, v, causal):
  def local(q, k, v):
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    return to_sequence(jax.nn.dot_product_attention(qh, kh, vh, is_causal=causal)), qh, kh, vh
  seq, heads = _seq_heads_spec(), _heads_spec()
  out, qh, kh, vh = jax.shard_map(local, in_specs=(seq, seq, seq), out_specs=(seq, heads, heads, heads),
                                  axis_names=set(_ulysses_axes()), check_vma=False)(q, k, v)
  return out, (qh, kh, vh)


def _ulysses_bwd(causal, res, do):
  def local(qh, kh, vh, do):
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    _, vjp = jax.vjp(attend, qh, kh, vh)
    return tuple(to_sequence(g) for g in vjp(to_heads(do)))
  seq, heads = _seq_heads_spec(), _heads_spec()
  return _varying(jax.shard_map(local, in_specs=(heads, heads, heads, seq), out_specs=(seq, seq, seq),
                                axis_names=set(_ulysses_axes()), check_vma=False)(*res, do))


_ulysses.defvjp(_ulysses_fwd, _ulysses_bwd)


def ulysses_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, causal: bool = True
                      ) -> jax.Array:
  """All-to-all to whole sequences of N/C heads, local attention, all-to-all back; the backward keeps
  the head-split q, k, v and runs the same exchanges on the gradients."""
  return _ulysses(q_BTNH, k_BTKH, v_BTKH, causal)


def attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, causal: bool, impl: str = "ring",
              implementation: str | None = None) -> jax.Array:
  """Attention that uses the context-parallel form `impl` when the mesh splits the sequence, and
  `jax.nn.dot_product_attention` (with its `implementation`: XLA's, cuDNN's) otherwise."""
  if context_size() == 1:
    return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=causal, implementation=implementation)
  if impl == "ring":
    return ring_attention(q_BTNH, k_BTKH, v_BTKH, causal)
  if impl == "all_to_all":
    return ulysses_attention(q_BTNH, k_BTKH, v_BTKH, causal)
  raise ContextError(f"unknown --context_impl={impl!r}; choose one of {', '.join(IMPLS)}")
