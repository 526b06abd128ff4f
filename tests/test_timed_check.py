"""The timed programs are checked in full: every repetition's whole output matters to the check after the loop.

Each mutant below is a collective written through the "Adding a collective" API (a subclass overriding `step`,
the one repetition the timed loop runs) that is right as one operation, so the check program passes it, and
wrong in some timed repetitions only, by one element or by skipping the data movement but for one element:
small enough to pass the HLO check (which fails a message-sized write or a missing collective), so only the
digests of the outputs can catch them. The loop body traces `step` twice, so a mutant toggling on each call is
wrong on the first or the second repetition of every pair. Variants cover group sizes 2, 4 and 8 and total
repetition counts that are multiples of the group size (the point-to-point shift's old blind spot).
"""

from __future__ import annotations

import jax
import pytest

from microbench.meshes.mesh import build_mesh, ordered_devices
from microbench.meshes.scopes import SCOPES, plan_scopes
from microbench.meshes.topology import Topology
from microbench.bench import collectives, hlo_check, program

TOPOLOGY = Topology(racks=2, nodes=2, gpus=2)  # scale_up: groups of 2, rack_scale: 4, global: 8
PLANS = {p.name: p for p in plan_scopes(TOPOLOGY, SCOPES)}


@pytest.fixture(scope="module")
def mesh():
  return build_mesh(TOPOLOGY, ordered_devices())


class _Toggle:
  """Which repetition of the pair a trace of `step` is (first, second, first, ...)."""

  def second(self) -> bool:
    self._calls = getattr(self, "_calls", 0) + 1
    return self._calls % 2 == 0


class AddsOneEverySecond(_Toggle, collectives.AllReduce):
  """A float all-reduce whose timed step adds 1 on every second repetition."""
  name = "all_reduce adding 1 every second repetition"

  def step(self, carry, axes, n, platform):
    x = carry[0]
    y = self.op(x, axes, n, platform)
    if self.second():
      y = y.at[-1].add(1)
    return (collectives.hold(x, y), y), y


class AllToAllIdleEverySecond(_Toggle, collectives.AllToAll):
  """An all-to-all that does nothing on every second repetition (twice the real one is the identity, so the
  final carry after an even count of real repetitions looks right)."""
  name = "all_to_all idle every second repetition"

  def step(self, carry, axes, n, platform):
    (x,) = carry
    y = x if self.second() else self.op(x, axes, n, platform)
    return (y,), y


class PPermuteMovesNothing(collectives.PPermute):
  """A point-to-point shift that moves nothing (its final carry is right after any multiple of the group size
  of repetitions)."""
  name = "ppermute moving nothing"

  def step(self, carry, axes, n, platform):
    (x,) = carry
    return (x,), x


class AllToAllOneWrongEverySecond(_Toggle, collectives.AllToAll):
  """An all-to-all with one element wrong on every second repetition: the idle mutant's subtle cousin."""
  name = "all_to_all one element wrong every second repetition"

  def step(self, carry, axes, n, platform):
    (x,) = carry
    y = self.op(x, axes, n, platform)
    if self.second():
      y = y.at[-1].add(1)
    return (y,), y


class PPermuteOneWrong(collectives.PPermute):
  """A point-to-point shift that gets one element wrong every repetition."""
  name = "ppermute one element wrong"

  def step(self, carry, axes, n, platform):
    (x,) = carry
    y = self.op(x, axes, n, platform).at[-1].add(1)
    return (y,), y


class _CorruptFirst(_Toggle):
  """A held collective whose first repetition of each pair has its last element wrong (only element 0 used to
  be fed forward; XLA dropped the rest of the first output as dead code)."""

  def step(self, carry, axes, n, platform):
    x = carry[0]
    y = self.op(x, axes, n, platform)
    if not self.second():
      y = y.at[-1].add(1)
    return (collectives.hold(x, y), y), y


class GatherCorruptFirst(_CorruptFirst, collectives.AllGather):
  name = "all_gather corrupt on the first of each pair"


class ReduceScatterCorruptFirst(_CorruptFirst, collectives.ReduceScatter):
  name = "reduce_scatter corrupt on the first of each pair"


MUTANTS = [(AddsOneEverySecond, "float32"), (AddsOneEverySecond, "bfloat16"), (AllToAllOneWrongEverySecond, "float32"),
           (PPermuteOneWrong, "float32"), (PPermuteOneWrong, "int32"), (GatherCorruptFirst, "float32"),
           (ReduceScatterCorruptFirst, "float32")]


def _timed(mesh, coll, plan, dtype, long_reps):
  """The sweep's sequence through the public API: build, check, a warm-up (the long arm's twin) and two timed
  pairs, the timed check over the long_reps + 2 x (2 + long_reps) repetitions run."""
  count = 8 * plan.group_size
  point = program.build_check(coll, mesh, plan, count, dtype)
  wrong_check = program.check(point)
  short, long = (program.build_timed(coll, mesh, plan, count, dtype, k) for k in (2, long_reps))
  period = coll.period(plan.group_size)
  _, _, carry = program.time_pairs(short, long, program.initial_carry(point), 1, 2, lambda: None, period=period)
  wrong, note = program.check_timed(point, carry, *program.chain_reps(1, 2, 2, long_reps, period=period))
  return wrong_check, wrong, note


@pytest.mark.parametrize("mutant,dtype", MUTANTS, ids=lambda m: getattr(m, "name", m))
@pytest.mark.parametrize("scope,long_reps", [("scale_up", 6), ("rack_scale", 12), ("global", 12), ("rack_scale", 10)])
def test_a_collective_wrong_only_in_some_timed_repetitions_is_caught(mesh, mutant, dtype, scope, long_reps):
  """22 repetitions in all (a multiple of the group of 2), 40 (of 2, 4 and 8: the groups of 4 and 8) or 34 (of
  2, not of the group of 4): every mutant caught on every rank."""
  plan = PLANS[scope]
  wrong_check, wrong, note = _timed(mesh, mutant(), plan, dtype, long_reps)
  assert wrong_check == 0  # right as one operation: the check program can't see it
  assert wrong == jax.device_count(), (wrong, note)  # every rank's sequence of outputs differs
  real = collectives.get(next(c for c in mutant.__mro__ if c.__module__ == collectives.__name__).name)
  reps, (_, digested) = program.chain_reps(1, 2, 2, long_reps, period=real.period(plan.group_size))
  assert _timed(mesh, real, plan, dtype, long_reps)[1:] == (0, (
      f"every output of the {digested} checked repetitions (the untimed twins of both arms, at least one period of"
      f" the chain) and the final output of the timed calls after all {reps} compared (digests)"))


@pytest.mark.parametrize("mutant", [AllToAllIdleEverySecond, PPermuteMovesNothing], ids=lambda m: m.name)
def test_a_collective_skipped_in_the_loop_fails_the_hlo_check(mesh, mutant):
  """Doing nothing on a repetition drops the collective from it: the HLO check counts executions per call."""
  with pytest.raises(hlo_check.HloMismatch, match="runs [0-9]+ times per call|no collective at all"):
    program.build_timed(mutant(), mesh, PLANS["global"], 64, "float32", 6)


def test_a_digest_that_ignored_the_repetitions_would_miss_them(mesh, monkeypatch):
  """The check's own mutation: with the fold keeping the accumulator as it was (only the final carry compared),
  the all-gather wrong on the first repetition of each pair passes: its final carry is right."""
  monkeypatch.setattr(program, "fold", lambda acc, y, reference=None: acc)
  monkeypatch.setattr(program, "expected_acc", lambda sequence, reps: 0)
  assert _timed(mesh, GatherCorruptFirst(), PLANS["global"], "float32", 6)[1] == 0


def test_the_digest_sees_one_wrong_element_a_swap_and_a_shift():
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  y = jnp.arange(1000, dtype=jnp.float32) * 3 - 7
  base = int(program.digest(y)[0])
  assert int(program.digest(y.at[500].add(1))[0]) != base
  assert int(program.digest(y.at[1].set(y[2]).at[2].set(y[1]))[0]) != base
  assert int(program.digest(jnp.roll(y, 1))[0]) != base
  for dtype in ("bfloat16", "float16", "int32", "float8_e4m3fn"):
    z = y.astype(dtype)
    assert int(program.digest(z)[0]) != int(program.digest(z.at[3].set(z[4]))[0]) or z[3] == z[4]


def test_graph_warm_up_calls_are_counted_in_the_chain(mesh):
  """Untimed calls of the timed programs before the samples (--command_buffer: the CUDA graph is built on the
  second call) move the chain on: counted, the check passes; left uncounted (the bug), a point-to-point shift
  ends 20 ranks on, 4 modulo the group of 8, and every rank's final output is wrong."""
  coll, plan, count = collectives.get("ppermute"), PLANS["global"], 64
  point = program.build_check(coll, mesh, plan, count, "int32")
  assert program.check(point) == 0
  short, long = (program.build_timed(coll, mesh, plan, count, "int32", k) for k in (2, 8))
  _, t_long, carry = program.time_pairs(short, long, program.initial_carry(point), 1, 2, lambda: None,
                                        graph_warmup=2)
  assert len(t_long) == 2
  assert program.check_timed(point, carry, *program.chain_reps(1, 2, 2, 8, graph_warmup=2))[0] == 0
  assert program.check_timed(point, carry, *program.chain_reps(1, 2, 2, 8))[0] == jax.device_count()


def _compiles_in(fn) -> list[float]:
  """XLA compiles (their seconds) while `fn` runs."""
  from jax._src import dispatch, monitoring  # pylint: disable=import-outside-toplevel
  seen = []

  def listen(event, secs, **_):
    if event == dispatch.BACKEND_COMPILE_EVENT:
      seen.append(secs)
  monitoring.register_event_duration_secs_listener(listen)
  try:
    fn()
  finally:
    monitoring.unregister_event_duration_listener(listen)
  return seen


@pytest.mark.parametrize("name,dtype", [("all_gather", "float32"), ("reduce_scatter", "bfloat16"), ("all_to_all", "int32")])
def test_the_helpers_compiled_beside_a_point_leave_its_check_nothing_to_compile(mesh, name, dtype):
  """The sweep compiles a point's helper programs (inputs, digests, comparison, zeros) beside its own: the check,
  the timed calls and the timed check then compile nothing. Without them (the bug: a shape that does not
  match the call's), the same steps compile."""
  coll, plan = collectives.get(name), PLANS["global"]

  def steps(count, precompile):
    point = program.build_check(coll, mesh, plan, count, dtype)
    short, long = (program.build_timed(coll, mesh, plan, count, dtype, k) for k in (2, 6))
    if precompile:
      for job in program.helper_compiles(coll, mesh, plan, count, dtype, lambda: point.wire_dtype):
        job()

    def run():
      assert program.check(point) == 0
      _, _, carry = program.time_pairs(short, long, program.initial_carry(point), 1, 2, lambda: None)
      assert program.check_timed(point, carry, *program.chain_reps(1, 2, 2, 6))[0] == 0
    return run
  assert _compiles_in(steps(8 * 24, True)) == []
  assert _compiles_in(steps(8 * 40, False))
