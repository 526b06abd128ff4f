"""Deliberately wrong collectives: the proof that the check catches what it claims to, over the whole matrix.

Each mutant is one of the registered collectives with one fault, written as a user would write a collective
("Adding a collective": a subclass overriding `step` or `carry`), and right as one operation, so the check
program passes it: the fault is only in the timed repetitions, where only the timed check (the twins'
digests, the final carry, the replays) can see it. `make(kind, base, mesh_axes)` builds one for any base
collective (its class and state kept: operators, roots, in place, ragged distributions); `kinds_for` says which
kinds apply to a case. microbench.bench.matrix runs them over drawn cases; tests and scripts/check_matrix.py
require every one caught.

Faults change one element (the last of the op's output, set to a value it does not hold) through a one-element
in-place update of the op's own result, so no mutant adds a message-sized write (which the HLO check would catch
before the digests could): what catches them is the comparison of the repetitions' outputs. A fault in the op
while a timed program is traced is also an op that is right alone and wrong inside a loop: a chained sum's
repetitions are compared with the check program's own chain, not with the op they run.
"""

from __future__ import annotations

import contextvars
import copy

import jax
import jax.numpy as jnp
from jax import lax

from microbench.bench import collectives, program
from microbench.bench.collectives import Collective

KTH = 7  # every_kth: the period of its fault, longer than a 6-operation long arm


def corrupt(y: jax.Array, when: jax.Array | bool = True) -> jax.Array:
  """y with its last element changed (to 2 where it holds 1, else to 1) where `when` holds: one element written
  in place."""
  last = y[-1:]
  one, two = jnp.ones_like(last), jnp.full_like(last, 2)
  wrong = jnp.where(last == one, two, one)
  return lax.dynamic_update_slice(y, jnp.where(jnp.asarray(when), wrong, last).astype(y.dtype), (y.shape[0] - 1,))


def _timed() -> bool:
  return program.tracing() is not None


_ARMED: contextvars.ContextVar = contextvars.ContextVar("armed", default=None)  # per compile thread


class _Fault(Collective):
  """A mutant: while a timed program's step is traced and `applies()`, the op's output is corrupted where
  `when(axes, n)` holds (a traced condition). The fault sits in the op, so the output is wrong before anything
  reads it (the step's feedback and the next repetition see the wrong value, as a faulty collective's would)
  and the op's own buffer takes the one-element write."""
  kind = ""

  def applies(self) -> bool:
    return _timed()

  def when(self, axes: tuple[str, ...], n: int):
    return True

  def op(self, x, axes, n, platform):
    y = super().op(x, axes, n, platform)
    armed = _ARMED.get()
    ragged = isinstance(self, collectives.RaggedAllToAll)  # its step and op both go through `exchange`
    return y if armed is None or ragged else corrupt(y, armed)

  def exchange(self, x, buf, axes, n, platform):
    y = super().exchange(x, buf, axes, n, platform)
    armed = _ARMED.get()
    return y if armed is None else corrupt(y, armed)

  def step(self, carry, axes, n, platform):
    if not self.applies():
      return super().step(carry, axes, n, platform)
    token = _ARMED.set(self.when(axes, n))
    try:
      return super().step(carry, axes, n, platform)
    finally:
      _ARMED.reset(token)


class EveryRepetition(_Fault):
  """Wrong on every timed repetition (an in-place sum's chain included)."""
  kind = "every_repetition"


class ShortArmOnly(_Fault):
  """Wrong only in the short arm's programs (2 operations), right in the long arm's."""
  kind = "short_arm_only"

  def applies(self):
    return _timed() and program.tracing()[0] == program.SHORT_REPS


class UndigestedOnly(_Fault):
  """Wrong only in the programs that are timed, right in their checked twins: only the final carry the timed
  calls leave (or a replay) can show it."""
  kind = "undigested_only"

  def applies(self):
    return _timed() and not program.tracing()[1]


class LastRankOnly(_Fault):
  """Wrong only on the last rank of each group."""
  kind = "last_rank_only"

  def when(self, axes, n):
    return lax.axis_index(axes) == n - 1


class OneGroupOnly(_Fault):
  """Wrong only in the first of several groups (the device's index over the mesh axes outside the scope is 0)."""
  kind = "one_group_only"
  others: tuple[str, ...] = ()

  def when(self, axes, n):
    return lax.axis_index(self.others) == 0


class InPlaceOnly(_Fault):
  """Wrong only when run in place."""
  kind = "in_place_only"

  def applies(self):
    return _timed() and self.inplace


class RootRankOnly(_Fault):
  """A broadcast wrong only on its root's own output."""
  kind = "root_rank_only"

  def when(self, axes, n):
    return lax.axis_index(axes) == self.root


class EveryKth(_Fault):
  """Wrong on every KTH repetition of the whole chain of calls, counted in a carry slot of its own: a fault no
  single call's position explains, as a flaky link's."""
  kind = "every_kth"

  def carry(self, x, out_count, platform):
    return (*super().carry(x, out_count, platform), jnp.zeros((1,), x.dtype))

  def slot_sources(self, platform):
    return (*super().slot_sources(platform), "zero")

  def final_carry(self, rank, reps, n, platform):
    return (*super().final_carry(rank, reps, n, platform), None)

  def step(self, carry, axes, n, platform):
    *slots, count = carry
    count = count + jnp.ones_like(count)
    if not _timed():
      nxt, y = super(_Fault, self).step(tuple(slots), axes, n, platform)
      return (*nxt, count), y
    token = _ARMED.set((count[0].astype(jnp.int32) % KTH) == 0)
    try:
      nxt, y = super(_Fault, self).step(tuple(slots), axes, n, platform)
    finally:
      _ARMED.reset(token)
    return (*nxt, count), y


class RaggedShortSend(_Fault):
  """A ragged all-to-all whose largest run is sent one element short in the timed repetitions (the element keeps
  what the buffer held)."""
  kind = "ragged_short_send"

  def tables(self, count, n):
    sizes, ins, outs = (t.copy() for t in super().tables(count, n))
    if _timed():
      r, d = divmod(int(sizes.argmax()), n)
      sizes[r, d] -= 1
    return sizes, ins, outs

  def step(self, carry, axes, n, platform):  # the fault is in the tables the op reads
    return super(_Fault, self).step(carry, axes, n, platform)


class RaggedSkipsPeer(RaggedShortSend):
  """A ragged all-to-all that, in the timed repetitions, never writes one peer's run (its size sent as 0)."""
  kind = "ragged_skips_peer"

  def tables(self, count, n):
    sizes, ins, outs = (t.copy() for t in super(RaggedShortSend, self).tables(count, n))
    if _timed():
      r, d = divmod(int(sizes.argmax()), n)
      sizes[r, d] = 0
    return sizes, ins, outs


KINDS = {c.kind: c for c in (EveryRepetition, ShortArmOnly, UndigestedOnly, LastRankOnly, OneGroupOnly, InPlaceOnly,
                             RootRankOnly, EveryKth, RaggedShortSend, RaggedSkipsPeer)}
_COUNTS_EXACTLY = ("float32", "int32", "float16")  # a counter slot stays exact over a long chain in these


def kinds_for(base: Collective, dtype: str, iters: int, groups: int) -> list[str]:
  """The mutant kinds that apply to a case: timed programs only (not in latency mode, --iters=1), in place for
  the in-place kind, a broadcast for the root's, the ragged all-to-all for the ragged faults, several groups for
  the one-group fault, a dtype whose counter stays exact for every_kth."""
  if iters == 1:
    return []
  ragged = isinstance(base, collectives.RaggedAllToAll)
  out = ["every_repetition", "short_arm_only", "undigested_only", "last_rank_only"]
  out += ["one_group_only"] * (groups > 1) + ["in_place_only"] * base.inplace
  out += ["root_rank_only"] * (base.root is not None) + ["every_kth"] * (dtype in _COUNTS_EXACTLY)
  out += ["ragged_short_send", "ragged_skips_peer"] * ragged
  return out


def make(kind: str, base: Collective, mesh_axes: tuple[str, ...] = (), scope_axes: tuple[str, ...] = ()
         ) -> Collective:
  """A copy of `base` (its state kept) whose class puts the fault `kind` before base's own class."""
  mixin = KINDS[kind]
  cls = type(f"{mixin.__name__}_{type(base).__name__}", (mixin, type(base)), {"__module__": __name__})
  out = copy.copy(base)
  out.__class__ = cls
  out.name = f"{base.name} ({kind})"
  if kind == "one_group_only":
    out.others = tuple(a for a in mesh_axes if a not in scope_axes)
  return out
