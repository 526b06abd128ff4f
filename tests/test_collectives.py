"""Every collective over every scope, checked against NumPy and against its compiled HLO (8 CPU devices)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microbench.meshes.mesh import build_mesh, ordered_devices
from microbench.meshes.scopes import SCOPES, plan_scopes
from microbench.meshes.topology import AXES, Topology
from microbench.bench import collectives, hlo_check, program, sweep
from microbench.bench.sizes import round_count
from microbench.output import table

TOPOLOGY = Topology(racks=2, nodes=2, gpus=2)  # every scope distinct: groups of 2, 4, 4 and 8


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() == 8, "tests/conftest.py sets JAX_NUM_CPU_DEVICES=8"
  return build_mesh(TOPOLOGY, ordered_devices())


PLANS = {p.name: p for p in plan_scopes(TOPOLOGY, SCOPES)}


def _count(name, scope, dtype, nbytes=96 * 4):
  itemsize = np.dtype(program.DTYPES[dtype]).itemsize
  return round_count(nbytes, itemsize, collectives.get(name).count_multiple(PLANS[scope].group_size))


def _point(mesh, name, scope, dtype, nbytes=96 * 4):
  return program.build_check(collectives.get(name), mesh, PLANS[scope], _count(name, scope, dtype, nbytes), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", collectives.NAMES)
def test_collective_matches_numpy_and_hlo(mesh, name, scope, dtype):
  point = _point(mesh, name, scope, dtype)
  assert point.check_prog.verified.match.op == collectives.get(name).hlo_expect("cpu")
  assert point.check_prog.verified.executions == 1
  assert program.check(point) == 0
  # XLA on CPU runs 16-bit collectives in float32: the record says so instead of passing it silently.
  assert point.wire_dtype == "float32"


@pytest.mark.parametrize("name", collectives.NAMES)
def test_timed_programs_loop_on_the_device_without_copies(mesh, name):
  """Both arms compile; the long one is a while loop with XLA's known trip count, every repetition inside
  it, no copy of the message's size anywhere; the carry flows through alternating timed calls."""
  plan, count = PLANS["rack_scale"], _count(name, "rack_scale", "float32")
  coll = collectives.get(name)
  point = program.build_check(coll, mesh, plan, count, "float32")
  short = program.build_timed(coll, mesh, plan, count, "float32", program.SHORT_REPS)
  long = program.build_timed(coll, mesh, plan, count, "float32", 10)
  assert short.verified.executions == 2 and long.verified.executions == 10
  assert set(long.verified.trip_counts) == {5}
  assert '"known_trip_count":{"n":"5"}' in long.hlo_text
  t_short, t_long, _ = program.time_pairs(short, long, program.initial_carry(point), 1, 3, lambda: None)
  assert t_short.shape == t_long.shape == (3,) and (t_short > 0).all() and (t_long > 0).all()


def test_a_resolved_point_stops_after_the_minimum_pairs(mesh):
  """time_pairs asks `resolved` after program.MIN_SAMPLES pairs and after each one past it: yes stops there, no
  runs them all (never asked after the last); the carry holds exactly the repetitions run either way (the
  timed check counts on it)."""
  plan, count, coll = PLANS["scale_up"], 64, collectives.get("ppermute")
  point = program.build_check(coll, mesh, plan, count, "int32")
  short = program.build_timed(coll, mesh, plan, count, "int32", program.SHORT_REPS)
  long = program.build_timed(coll, mesh, plan, count, "int32", 6)
  asked = []
  for answer, pairs in ((True, program.MIN_SAMPLES), (False, 8), ("at 7", 7)):
    point.x = None
    assert program.check(point) == 0  # the known outputs the timed check compares with
    t_short, t_long, carry = program.time_pairs(short, long, program.initial_carry(point), 1, 8, lambda: None,
                                                resolved=lambda s, l, a=answer: asked.append(len(s)) or (
                                                    len(s) == 7 if a == "at 7" else a))
    assert len(t_short) == len(t_long) == pairs
    assert program.check_timed(point, carry, *program.chain_reps(1, pairs, 2, 6))[0] == 0
  assert asked == [program.MIN_SAMPLES, 5, 6, 7, 5, 6, 7]


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter", "all_to_all", "all_gather"])
@pytest.mark.parametrize("dtype", ["int32", "float16"])
def test_other_dtypes(mesh, name, dtype):
  point = _point(mesh, name, "rack_scale", dtype)
  assert program.check(point) == 0
  assert point.wire_dtype == dtype


def test_group_size_not_power_of_two():
  mesh3 = build_mesh(Topology(1, 2, 3), ordered_devices()[:6])
  plan = plan_scopes(Topology(1, 2, 3), ["scale_up"])[0]
  coll = collectives.get("reduce_scatter")
  count = round_count(1000, 4, coll.count_multiple(3))
  assert count % 3 == 0
  assert program.check(program.build_check(coll, mesh3, plan, count, "float32")) == 0


class _WrongReduce(collectives.AllReduce):
  """A deliberately wrong expectation (every fifth element expects its neighbour's total, which differs by
  design), on the host and on the devices: the checks must count the mismatches."""

  def expected(self, inputs, rank, in_count, start, stop):
    i = np.arange(start, stop)
    return inputs.reduced(start + 1, stop + 1) * (i % 5 == 0) + inputs.reduced(start, stop) * (i % 5 != 0)

  def reduced_at(self, rank, e, n, in_count):
    return e + (e % 5 == 0)


def test_check_counts_wrong_elements_and_names_the_first(mesh):
  point = program.build_check(_WrongReduce(), mesh, PLANS["scale_up"], 100, "float32")
  # 20 of every 100 elements differ, on all 8 devices; the first is element 0.
  assert program.check(point) == 8 * 20
  assert len(point.wrong_at) == 8 and {(w["wrong"], w["first"]) for w in point.wrong_at} == {(20, 0)}
  assert sorted((w["group"], w["rank"]) for w in point.wrong_at) == [(g, r) for g in range(4) for r in range(2)]
  assert program.compare_output_host(point, point.check_prog.fn(program.known_input_array(point))) == 8 * 20


def test_the_host_check_streams_through_buffers_longer_than_its_chunk(mesh, monkeypatch):
  monkeypatch.setattr(program, "CHECK_CHUNK", 7)
  for name in ("all_gather", "all_to_all", "reduce_scatter"):
    point = program.build_check(collectives.get(name), mesh, PLANS["rack_scale"], 4 * 25, "float32")
    assert program.compare_output_host(point, point.check_prog.fn(program.known_input_array(point))) == 0, name
  point = program.build_check(_WrongReduce(), mesh, PLANS["scale_up"], 100, "float32")
  assert program.compare_output_host(point, point.check_prog.fn(program.known_input_array(point))) == 8 * 20


def test_hlo_check_catches_a_collective_over_the_wrong_groups(mesh):
  class Misrouted(collectives.AllReduce):
    def op(self, x, axes, n, platform):
      return jax.lax.psum(x, "gpu")  # always scale-up, whatever the scope asks

  with pytest.raises(hlo_check.HloMismatch, match="expected all-reduce over groups"):
    program.build_check(Misrouted(), mesh, PLANS["scale_out"], 64, "float32")


def test_hlo_check_catches_all_gather_in_the_wrong_rank_order(mesh):
  """Same groups as sets, members in another order: the gathered chunks would be in the wrong places."""
  class Reordered(collectives.AllGather):
    def op(self, x, axes, n, platform):
      return jax.lax.all_gather(x, tuple(reversed(axes)), tiled=True)

  plan = PLANS["rack_scale"]  # axes (node, gpu): reversed, the group {0,1,2,3} is ordered 0,2,1,3
  with pytest.raises(hlo_check.HloMismatch, match="in this order"):
    program.build_check(Reordered(), mesh, plan, 64, "float32")
  program.build_check(collectives.get("all_gather"), mesh, plan, 64, "float32")  # the real one passes


def test_hlo_check_catches_the_wrong_element_count_and_type(mesh):
  class HalfBuffer(collectives.AllReduce):
    def op(self, x, axes, n, platform):
      return jnp.concatenate([jax.lax.psum(x[: x.shape[0] // 2], axes), x[x.shape[0] // 2:]])

  class Narrowed(collectives.AllReduce):
    def op(self, x, axes, n, platform):
      return jax.lax.psum(x.astype(jnp.float16), axes).astype(x.dtype)

  with pytest.raises(hlo_check.HloMismatch, match="moves 32 elements per device, expected 64"):
    program.build_check(HalfBuffer(), mesh, PLANS["scale_up"], 64, "float32")
  with pytest.raises(hlo_check.HloMismatch, match="runs on f16 data, the benchmark asked for float32"):
    program.build_check(Narrowed(), mesh, PLANS["scale_up"], 64, "float32")


def _old_program_hlo(mesh, coll, plan, count, dtype):
  """The design this project used before: the trip count a runtime argument, the carry (x, y) with the
  output fed back, so the loop body copies the whole buffer."""
  n, jdtype, axes = plan.group_size, program.DTYPES[dtype], plan.axes

  def per_device(x, k):
    def body(_, carry):
      x, _y = carry
      y = coll.op(x, axes, n, "cpu")
      return y, y
    return jax.lax.fori_loop(0, k, body, (x, jnp.zeros((count,), jdtype)))

  fn = jax.shard_map(per_device, mesh=mesh, in_specs=(jax.P(AXES), jax.P()), out_specs=(jax.P(AXES), jax.P(AXES)),
                     check_vma=False)
  x_spec = jax.ShapeDtypeStruct((mesh.size * count,), jdtype, sharding=jax.NamedSharding(mesh, jax.P(AXES)))
  k_spec = jax.ShapeDtypeStruct((), jnp.int32, sharding=jax.NamedSharding(mesh, jax.P()))
  return jax.jit(fn, donate_argnums=0).lower(x_spec, k_spec).compile().as_text()


@pytest.mark.parametrize("name", ["all_reduce", "ppermute", "all_to_all", "broadcast"])
def test_hlo_check_fails_the_old_program(mesh, name):
  """Fed the old design's HLO, the timed-program check fails on the runtime trip count; with the trip count
  made static it still fails, on a write of the message's size besides the collective (its zeros, or the
  copy in the loop body)."""
  coll, plan = collectives.get(name), PLANS["scale_up"]
  text = _old_program_hlo(mesh, coll, plan, 64, "float32")
  exp = program.expectation(coll, plan, 64, "float32", "cpu", 10, timed=True)
  with pytest.raises(hlo_check.HloMismatch, match="no known trip count"):
    hlo_check.verify(text, exp)
  static = "\n".join(line + ', backend_config={"known_trip_count":{"n":"10"}}' if " while(" in line else line
                     for line in text.splitlines())
  with pytest.raises(hlo_check.HloMismatch, match="writes 64 elements besides the collective"):
    hlo_check.verify(static, exp)


def test_hlo_check_counts_repetitions(mesh):
  coll, plan = collectives.get("all_reduce"), PLANS["scale_up"]
  long = program.build_timed(coll, mesh, plan, 64, "float32", 8)
  exp = program.expectation(coll, plan, 64, "float32", "cpu", 10, timed=True)
  with pytest.raises(hlo_check.HloMismatch, match="runs 8 times per call, expected 10"):
    hlo_check.verify(long.hlo_text, exp)


def test_run_point_records_a_runtime_failure_as_failed(mesh, monkeypatch):
  cfg = sweep.SweepConfig(("all_reduce",), ("scale_up",), ("float32",), 1024, 1024, 2, 4, 0, 2, True)

  def boom(*a, **k):
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while trying to allocate")

  monkeypatch.setattr(program, "time_pairs", boom)
  rec = sweep.run_point(cfg, mesh, PLANS["scale_up"], collectives.get("all_reduce"), "float32", 1024, lambda: None)
  assert rec["status"] == "failed" and "RESOURCE_EXHAUSTED" in rec["reason"]


def test_run_point_record(mesh):
  cfg = sweep.SweepConfig(("all_gather",), ("scale_out",), ("float32",), 1000, 1000, 2, 6, 1, 3, True)
  rec = sweep.run_point(cfg, mesh, PLANS["scale_out"], collectives.get("all_gather"), "float32", 1000, lambda: None)
  assert rec["status"] == "ok" and rec["wrong"] == 0
  assert rec["count"] % 4 == 0 and rec["bytes"] == rec["count"] * 4 <= 1000
  assert rec["short_iters"] == 2 and rec["iters"] == 6 and rec["trip_count"] == 3
  assert len(rec["samples_us"]) == 3
  if rec["time_method"] == "difference":
    assert rec["time_us"] == pytest.approx(float(np.median(rec["samples_us"])))
  assert rec["time_us_min"] <= rec["time_us"] <= rec["time_us_max"]
  assert "time_us_p99" not in rec  # not a per-operation tail outside latency mode
  assert rec["algbw_gbps"] == pytest.approx(rec["bytes"] / (rec["time_us"] * 1e-6) / 1e9)
  assert rec["busbw_gbps"] == pytest.approx(rec["algbw_gbps"] * 3 / 4)


def test_latency_mode_times_single_operations(mesh):
  cfg = dataclasses.replace(sweep.SweepConfig(("all_reduce",), ("scale_up",), ("float32",), 1024, 1024, 2, 1, 1, 25,
                                              True))
  assert cfg.latency_mode
  rec = sweep.run_point(cfg, mesh, PLANS["scale_up"], collectives.get("all_reduce"), "float32", 1024, lambda: None)
  assert rec["status"] == "ok" and rec["time_method"].startswith("latency") and rec["iters"] == 1
  assert len(rec["samples_us"]) == 25
  assert rec["time_us_p50"] <= rec["time_us_p90"] <= rec["time_us_p99"] <= rec["time_us_max"]
  assert rec["time_us_p99"] == pytest.approx(float(np.percentile(rec["samples_us"], 99)))


def test_difference_cancels_per_call_costs():
  """A constant per-call cost in both arms disappears; the per-operation time is what remains."""
  per_op, per_call = 7e-6, 90e-6
  rng = np.random.default_rng(0)
  t_short = per_call + 2 * per_op + rng.normal(0, 1e-7, (1, 9))
  t_long = per_call + 20 * per_op + rng.normal(0, 1e-7, (1, 9))
  stats = sweep.difference_stats(t_short, t_long, 2, 20)
  assert stats["time_method"] == "difference"
  assert stats["time_us"] == pytest.approx(7.0, rel=0.01)
  assert stats["call_overhead_us"] == pytest.approx(90.0, rel=0.01)
  # Noise larger than the operation: not resolved, and said so, with the long arm's average instead.
  noisy = sweep.difference_stats(t_long, t_short, 2, 20)
  assert noisy["time_method"].startswith("long-arm average") and noisy["time_us"] > 0


def test_sizes_that_round_to_one_count_are_measured_once():
  coll = collectives.get("all_gather")
  counts = sweep.distinct_counts(coll, "float32", 3, [4, 8, 12, 16, 32])
  assert counts == {3: [4, 8, 12, 16], 6: [32]}  # 16 B = 4 elements, rounded down to 3


def test_a_difference_the_samples_do_not_resolve_is_flagged_noisy():
  """4 operations of difference under per-call jitter as large as them, too little to resolve. The median is
  positive but its interval is wide and some samples are negative: NOISY, with its resolution, in the table."""
  rng = np.random.default_rng(1)
  per_op, per_call = 1e-3, 20e-3
  t_short = per_call + 2 * per_op + rng.normal(0, 3e-3, (1, 10))
  t_long = per_call + 6 * per_op + rng.normal(0, 3e-3, (1, 10))
  stats = sweep.difference_stats(t_short, t_long, 2, 6)
  assert stats["time_method"] == "difference" and stats["noisy"] and stats["resolution"] > sweep.NOISE_LIMIT
  steady = sweep.difference_stats(per_call + 2 * per_op + rng.normal(0, 1e-7, (1, 10)),
                                  per_call + 6 * per_op + rng.normal(0, 1e-7, (1, 10)), 2, 6)
  assert not steady["noisy"] and steady["resolution"] < 0.01
  row = table.format_row({"status": "ok", "bytes": 16 << 20, "count": 4 << 20, "dtype": "float32",
                          "scope": "global", "group_size": 8, "num_groups": 1, "algbw_gbps": 1.0,
                          "busbw_gbps": 1.0, "wrong": 0, **stats})
  assert "NOISY (median +-" in row


def test_a_noisy_point_capped_by_sample_ms_is_retried_longer_once():
  noisy = {"noisy": True, "time_method": "difference", "resolution": 0.4}
  assert sweep.longer_reps(6, noisy, 20) == 20  # capped at --iters
  assert sweep.longer_reps(20, noisy, 20) is None  # already at --iters: flagged, not retried
  assert sweep.longer_reps(6, {**noisy, "resolution": 0.15}, 40) == 14
  assert sweep.longer_reps(6, {**noisy, "resolution": 0.08}, 20) is None  # NOISY, but not worth a retry


class _ReversingFeedback(collectives.AllReduce):
  """A timed step whose output is reversed before the next repetition: a message-sized fusion, not a copy."""
  name = "all_reduce with a reversing feedback"

  def step(self, carry, axes, n, platform):
    y = jnp.flip(self.op(carry[0], axes, n, platform))
    return (collectives.hold(carry[0], y), y), y


class _ConvertingFeedback(collectives.AllReduce):
  """A timed step that converts the message to float32 and back between repetitions."""
  name = "all_reduce with a converting feedback"

  def step(self, carry, axes, n, platform):
    y = (self.op(carry[0], axes, n, platform).astype(jnp.float32) + 1).astype(carry[0].dtype)
    return (collectives.hold(carry[0], y), y), y


@pytest.mark.parametrize("mutant", [_ReversingFeedback(), _ConvertingFeedback()], ids=lambda m: m.name)
def test_a_message_sized_write_in_the_loop_body_fails_whatever_its_opcode(mesh, mutant):
  with pytest.raises(hlo_check.HloMismatch, match="writes 64 elements besides the collective"):
    program.build_timed(mutant, mesh, PLANS["scale_up"], 64, "float32", 10)
  real = program.build_timed(collectives.get("all_reduce"), mesh, PLANS["scale_up"], 64, "float32", 10)
  # The timed program writes a few scalars besides the collective; its checked twin also the two digests'
  # hashes per trip (XLA:CPU writes them out; GPUs fuse them).
  assert real.verified.body_writes is not None and real.verified.body_writes < 16
  assert 2 * 64 <= real.checked.verified.body_writes < 2 * 64 + 16


def test_send_and_recv_are_other_collectives():
  text = """HloModule m, num_partitions=2

ENTRY %main (a: f32[8]) -> f32[8] {
  %ar = f32[8]{0} all-reduce(%a), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %s = (f32[8]{0}, u32[], token[]) send(%ar, %tok), channel_id=2
  ROOT %sd = token[] send-done(%s), channel_id=2
}
"""
  with pytest.raises(hlo_check.HloMismatch, match="point-to-point send"):
    hlo_check.verify_groups(text, "all-reduce", np.array([[0, 1]]))


@pytest.mark.slow
def test_the_timed_check_compares_what_was_timed_and_says_so(mesh):
  """Every collective and operator, float32 and int32: 36 repetitions (both programs' twins first, then two
  pairs of the 2- and 10-repetition programs) all compared on CPU."""
  plan = PLANS["scale_up"]
  for name in collectives.REGISTRY:
    for dtype in ("float32", "int32"):
      coll = collectives.get(name)
      if coll.refuses(dtype):
        continue
      count = 4 * plan.group_size
      point = program.build_check(coll, mesh, plan, count, dtype)
      assert program.check(point) == 0
      assert _timed_and_checked(mesh, coll, point, count, dtype) == (0, (
          "every output of the 12 checked repetitions (the untimed twins of both arms, at least one period of the"
          " chain) and the final output of the timed calls after all 36 compared (digests)")), (name, dtype)


def _timed_and_checked(mesh, coll, point, count, dtype, long_reps=10, plan=None):
  """One warm-up (the long program's twin) and two timed pairs of the 2- and `long_reps`-repetition programs, then
  the timed check."""
  plan = plan or PLANS["scale_up"]
  short, long = (program.build_timed(coll, mesh, plan, count, dtype, k) for k in (2, long_reps))
  period = coll.period(plan.group_size)
  _, _, carry = program.time_pairs(short, long, program.initial_carry(point), 1, 2, lambda: None, period=period)
  return program.check_timed(point, carry, *program.chain_reps(1, 2, 2, long_reps, period=period))


def test_on_gpus_an_all_reduce_chains_and_is_compared_with_the_check_programs_chain():
  """XLA:GPU runs an all-reduce in place: held inputs would cost a copy per repetition (tests/test_gpu_compile.py
  reads the HLO). Chained, max and min stay exact; a sum does not: its twin compares each repetition with one
  operation on its input."""
  for op in ("sum", "prod", "avg"):
    coll = collectives.with_op("all_reduce", op)
    assert coll.feedback_on("gpu") == "chain" and coll.compared_to_op(4, "gpu") and not coll.compared_to_op(4, "cpu")
    assert coll.rep_output(0, 5, 4, "gpu") is None and coll.rep_output(0, 5, 4, "cpu") == ("out", 0)
  for op in ("max", "min"):
    assert collectives.with_op("all_reduce", op).final_carry(1, 36, 4, "gpu") == (("out", 1),)
  assert collectives.get("all_gather").feedback_on("gpu") == "hold"


def test_the_expected_accumulator_is_the_fold_of_every_repetition():
  rng = np.random.default_rng(0)
  for period in (1, 2, 3, 8):
    seq = [int(v) for v in rng.integers(0, 1 << 32, period)]
    for reps in (0, 1, 2, 7, 36, 1000):
      acc = 0
      for k in range(reps):
        acc = (acc * program.DIGEST_MUL + seq[k % period]) % (1 << 32)
      assert program.expected_acc(seq, reps) == acc
