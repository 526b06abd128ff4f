"""The ragged all-to-all (`jax.lax.ragged_all_to_all`) with MoE-like send sizes: the sizes, the exact check
(the unused output included), the busbw convention, the HLO forms (XLA:CPU's padded all-to-all, XLA:GPU's
ragged-all-to-all-start/done), and deliberately wrong ones written through the "Adding a collective" API:
wrong offsets, wrong sizes, swapped destinations, an unzeroed buffer, a repetition wrong only in the timed loop.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import run_cli
from microbench.meshes.mesh import build_mesh, ordered_devices
from microbench.meshes.scopes import SCOPES, plan_scopes
from microbench.meshes.topology import Topology
from microbench.bench import collectives, hlo_check, program, ragged_sizes
from microbench.bench.known_inputs import FILL, GroupInputs
from microbench.fabric import conventions
from microbench.aot import gpu_compile
from microbench.train import dispatch

TOPOLOGY = Topology(racks=2, nodes=2, gpus=2)  # scale_up: groups of 2, rack_scale: 4, global: 8
PLANS = {p.name: p for p in plan_scopes(TOPOLOGY, SCOPES)}
COUNT = 101  # prime: runs of every length, no distribution splits it evenly

needs_plugin = pytest.mark.skipif(not gpu_compile.plugin_available(),
                                  reason="JAX's CUDA PJRT plugin is not installed: pip install -e '.[gpu-compile]'")


@pytest.fixture(scope="module")
def mesh():
  return build_mesh(TOPOLOGY, ordered_devices())


# ------------------------------------------------------------------------------------------------ the sizes

@pytest.mark.parametrize("dist", ragged_sizes.DISTRIBUTIONS)
def test_every_rank_sends_its_whole_buffer_and_the_output_holds_the_largest_receive(dist):
  for n in range(1, 10):
    for count in (1, 7, 101, 4096):
      lay = ragged_sizes.layout(dist, n, count)
      assert (lay.sizes >= 0).all() and (lay.sizes.sum(axis=1) == count).all(), (n, count)
      assert lay.out_count >= lay.received.max() and lay.out_count == n * lay.sizes.max(initial=1)
      # runs tile each input in destination order and each output in source order, from 0, without gaps
      assert (lay.input_offsets == np.cumsum(lay.sizes, 1) - lay.sizes).all()
      assert (lay.output_offsets == np.cumsum(lay.sizes, 0) - lay.sizes).all()
      assert (ragged_sizes.layout(dist, n, count).sizes == lay.sizes).all()  # a function of (dist, n, count)


def test_the_distributions_are_what_their_names_say():
  n, count = 8, 1 << 16
  uni, skew, hot, empty = (ragged_sizes.layout(d, n, count).sizes for d in ragged_sizes.DISTRIBUTIONS)
  assert (uni == count // n).all()
  popularity = skew.sum(axis=0)
  assert (np.diff(popularity) < 0).all() and popularity[0] > 5 * popularity[-1]  # Zipf over destinations
  assert len({tuple(row) for row in skew}) == n  # no two sources split alike
  assert (np.abs(hot[:, n // 2] - 3 * count / 4) <= 1).all()  # 3/4 of every rank's elements to one rank
  assert (empty == 0).sum() >= n * (n // 3) and (empty.sum(axis=1) == count).all()
  assert ragged_sizes.layout("empty_sends", 2, 8).sizes.tolist() == [[1, 7], [0, 8]]
  with pytest.raises(ValueError, match="unknown send-size distribution 'zipf'"):
    ragged_sizes.weights("zipf", 4)


def test_busbw_counts_the_bytes_actually_sent_at_the_busiest_rank():
  """Uniform sizes give all-to-all's (n-1)/n; a hot receiver sets the factor; one rank's self-send is free."""
  for n in (2, 3, 8):
    assert collectives.get("ragged_all_to_all").busbw_factor(n, 64 * n) == pytest.approx(
        conventions.busbw_factor("all_to_all", n))
  assert conventions.ragged_busbw_factor([[1, 3], [2, 2]]) == 3 / 4  # rank 1 receives 3 from rank 0
  assert conventions.ragged_busbw_factor([[4, 0], [0, 4]]) == 0.0  # everything stays home
  assert conventions.ragged_busbw_factor([[0, 4, 0], [0, 0, 4], [0, 4, 0]]) == 2.0  # rank 1 receives 2 S
  hot = collectives.get("ragged_all_to_all_hot_expert")
  assert hot.busbw_factor(8) == pytest.approx(7 * 3 / 4)  # 7 others' 3/4 each into the hot rank
  assert hot.busbw_factor(8, 1 << 20) == pytest.approx(hot.busbw_factor(8), rel=1e-5)  # the count's sizes


# ------------------------------------------------------------------------------------------------ the check

@pytest.mark.parametrize("name", collectives.RAGGED)
def test_streamed_expectation_equals_the_reference(name):
  coll = collectives.get(name)
  for n in (1, 2, 3, 5):
    inputs = GroupInputs("data", "float32", n, group_index=2)
    for count in (1, 7, 101):
      ref = coll.reference(np.stack([inputs.rank(r, 0, count) for r in range(n)]), fill=FILL["float32"])
      lay = coll.layout(count, n)
      assert ref.shape == (n, lay.out_count)
      for r in range(n):
        assert (ref[r, lay.received[r]:] == FILL["float32"]).all()  # the unused tail: the buffer's fill
        for a, b in [(0, ref.shape[1]), (3, ref.shape[1] - 2), (17, 18), (5, 5)]:
          if b > ref.shape[1] or a > b:
            continue
          np.testing.assert_array_equal(coll.expected(inputs, r, count, a, b), ref[r][a:b])


def test_reference_on_a_small_example():
  """Rank r's runs land in source order in each receiver, the rest zeros (sizes [[1, 7], [0, 8]])."""
  xs = np.arange(1, 17, dtype=np.float64).reshape(2, 8)
  out = collectives.get("ragged_all_to_all_empty_sends").reference(xs)
  np.testing.assert_array_equal(out[0], [1] + [0] * 15)
  np.testing.assert_array_equal(out[1], list(range(2, 9)) + list(range(9, 17)) + [0])


class _Mutant(collectives.RaggedAllToAll):
  """A ragged all-to-all told wrong tables (the check's expectation reads the layout itself)."""

  def __init__(self, dist: str):
    super().__init__(dist)
    self.name = f"{type(self).__name__} {dist}"

  def tables(self, count, n):
    sizes, ins, outs = (np.array(t) for t in super().tables(count, n))
    return self.mutate(sizes, ins, outs)


class OutputOffsetsOffByOneRun(_Mutant):
  """Every run lands where the next source's run belongs (the output offsets one run late)."""

  def mutate(self, sizes, ins, outs):
    return sizes, ins, outs + sizes


class OneSizeShort(_Mutant):
  """The largest run sent one element short (its last element left as the buffer had it)."""

  def mutate(self, sizes, ins, outs):
    r, d = np.unravel_index(np.argmax(sizes), sizes.shape)
    sizes[r, d] -= 1
    return sizes, ins, outs


class SwappedDestinations(_Mutant):
  """Each rank sends the run meant for destination 0 to destination 1 and the other way round."""

  def mutate(self, sizes, ins, outs):
    ins[:, [0, 1]] = ins[:, [1, 0]]
    return sizes, ins, outs


class UnzeroedBuffer(_Mutant):
  """The output buffer is not zeroed, so the unused tail holds whatever was there (ones)."""

  def mutate(self, sizes, ins, outs):
    return sizes, ins, outs

  def op(self, x, axes, n, platform):
    return self.exchange(x, jnp.ones((self.out_count(x.shape[0], n),), x.dtype), axes, n, platform)


MUTANTS = (OutputOffsetsOffByOneRun, OneSizeShort, SwappedDestinations, UnzeroedBuffer)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("dist,scope", [*((d, "global") for d in ragged_sizes.DISTRIBUTIONS),
                                        ("empty_sends", "scale_up")])  # n = 2: one rank sends only to itself
def test_wrong_offsets_sizes_destinations_and_buffers_are_caught(mesh, mutant, dist, scope):
  """Each is wrong somewhere at every scope and distribution (an unzeroed buffer too: some rank has an unused
  tail in all of these); the right ones pass (test_the_device_check_agrees_with_the_host)."""
  point = program.build_check(mutant(dist), mesh, PLANS[scope], COUNT, "float32")
  assert program.check(point) > 0 and point.wrong_at


@pytest.mark.parametrize("name", [*collectives.RAGGED, "wrong"])
def test_the_device_check_agrees_with_the_host(mesh, name):
  """The device comparison (expected output from `source`, -1 for the zeroed tail) and the host's (`expected`)
  count the same wrong elements: none on every distribution's right output, some on a wrong one."""
  coll = SwappedDestinations("skewed") if name == "wrong" else collectives.get(name)
  point = program.build_check(coll, mesh, PLANS["rack_scale"], COUNT, "bfloat16")
  y = point.check_prog.fn(program.known_input_array(point))
  wrong = program.compare_output(point, y)
  assert wrong == program.compare_output_host(point, y) and (wrong > 0) == (name == "wrong")


class WrongEverySecond(collectives.RaggedAllToAll):
  """Right as one operation; in the timed loop every second repetition's last element is one off (an unused
  element on most ranks: the check covers the unused tail of every repetition)."""
  name = "ragged_all_to_all one element wrong every second repetition"

  def step(self, carry, axes, n, platform):
    self._calls = getattr(self, "_calls", 0) + 1
    slots, y = super().step(carry, axes, n, platform)
    if self._calls % 2 == 0:
      y = y.at[-1].add(1)
    return (*slots[:-1], y), y


class SkipsEverySecond(collectives.RaggedAllToAll):
  """Leaves the buffer as it was (the previous, right output) on every second repetition."""
  name = "ragged_all_to_all skipping every second repetition"

  def step(self, carry, axes, n, platform):
    self._calls = getattr(self, "_calls", 0) + 1
    if self._calls % 2 == 0:
      return carry, carry[-1]
    return super().step(carry, axes, n, platform)


def _timed(mesh, coll, plan, dtype="float32", long_reps=6):
  point = program.build_check(coll, mesh, plan, COUNT, dtype)
  wrong_check = program.check(point)
  short, long = (program.build_timed(coll, mesh, plan, COUNT, dtype, k) for k in (2, long_reps))
  _, _, carry = program.time_pairs(short, long, program.initial_carry(point), 1, 2, lambda: None, period=2)
  wrong, _ = program.check_timed(point, carry, *program.chain_reps(1, 2, 2, long_reps, period=2))
  return wrong_check, wrong


@pytest.mark.parametrize("scope", ["scale_up", "global"])
@pytest.mark.parametrize("wrong", [True, False])
def test_a_repetition_wrong_only_in_the_timed_loop_is_caught(mesh, scope, wrong):
  """The mutant passes the check program and fails the timed check on every rank; the real one passes both."""
  coll = WrongEverySecond("hot_expert") if wrong else collectives.get("ragged_all_to_all_hot_expert")
  assert _timed(mesh, coll, PLANS[scope]) == (0, jax.device_count() if wrong else 0)


def test_a_skipped_repetition_fails_the_hlo_check(mesh):
  with pytest.raises(hlo_check.HloMismatch, match="runs [0-9]+ times per call"):
    program.build_timed(SkipsEverySecond("skewed"), mesh, PLANS["global"], COUNT, "float32", 6)


# ------------------------------------------------------------------------------------------------ the HLO

def test_on_cpu_it_is_the_padded_all_to_all_and_says_so(mesh):
  """XLA:CPU has no ragged-all-to-all (its thunk emitter refuses it): the op there is a dense all-to-all of
  n x the largest run, which is the output's length, over the scope's groups in order."""
  coll = collectives.get("ragged_all_to_all_skewed")
  point = program.build_check(coll, mesh, PLANS["rack_scale"], COUNT, "float32")
  v = point.check_prog.verified
  assert v.match.op == "all-to-all" and v.match.elements == coll.out_count(COUNT, 4) and v.executions == 1
  assert "XLA:CPU has no ragged-all-to-all" in coll.impl("cpu") and coll.impl("gpu").startswith("ragged")
  with pytest.raises(Exception, match="ragged-all-to-all"):  # the reason for the emulation, if XLA:CPU changes
    f = jax.jit(jax.shard_map(
        lambda x: jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), jnp.zeros(8, jnp.int32),
                                            jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.int32),
                                            jnp.zeros(8, jnp.int32), axis_name=("rack", "node", "gpu")),
        mesh=mesh, in_specs=jax.P(("rack", "node", "gpu")), out_specs=jax.P(("rack", "node", "gpu"))))
    f(jax.device_put(jnp.zeros(64, jnp.float32), jax.NamedSharding(mesh, jax.P(("rack", "node", "gpu")))))


class HalfBits(collectives.RaggedAllToAll):
  """The emulation, then its output's bits moved again in halves (twice the elements, half the width each)."""
  name = "ragged_all_to_all in half-width pieces"

  def exchange(self, x, buf, axes, n, platform):
    half = {4: jnp.uint16, 2: jnp.uint8}[x.dtype.itemsize]
    y = super().exchange(x, buf, axes, n, platform)
    pieces = jax.lax.all_to_all(jax.lax.bitcast_convert_type(y, half).reshape(-1), axes, 0, 0, tiled=True)
    return jax.lax.bitcast_convert_type(pieces.reshape(-1, 2), x.dtype)


class AllToAllInBits(collectives.AllToAll):
  """A plain all-to-all of the dtype's bits: the same bytes, but not the emulation the allowance is for."""
  name = "all_to_all of bits"

  def op(self, x, axes, n, platform):
    bits = collectives.BITS[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(jax.lax.all_to_all(jax.lax.bitcast_convert_type(x, bits), axes, 0, 0,
                                                           tiled=True), x.dtype)


@pytest.mark.parametrize("dtype,bits", [("float8_e5m2", "u8"), ("bfloat16", "u16"), ("float32", "u32")])
def test_on_cpu_the_emulation_moves_the_dtypes_bits_and_reports_the_dtype(mesh, dtype, bits):
  """No float work in an emulation that only moves data: XLA:CPU widened an fp8 all-to-all's every piece to
  float16 and back (2,300 converts on 48 devices). The all-to-all runs on unsigned integers of the width, and
  the record's wire dtype is the asked one (the same bytes move); the output is still checked exactly."""
  coll = collectives.get("ragged_all_to_all_hot_expert")
  point = program.build_check(coll, mesh, PLANS["global"], COUNT, dtype)
  assert set(point.check_prog.verified.match.element_types) == {bits} and point.wire_dtype == dtype
  assert not re.search(r"\bf16\[", point.check_prog.hlo_text)  # no widened piece
  assert program.check(point) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bits_of_another_width_or_outside_the_emulation_fail_the_hlo_check(mesh, dtype):
  with pytest.raises(hlo_check.HloMismatch, match="runs on u(8|16) data"):
    program.build_check(HalfBits("skewed"), mesh, PLANS["global"], COUNT, dtype)
  with pytest.raises(hlo_check.HloMismatch, match="runs on u(16|32) data"):
    program.build_check(AllToAllInBits(), mesh, PLANS["global"], 64, dtype)


_GPU_START = """HloModule m, num_partitions=4
ENTRY %main (p: f32[1536]) -> f32[1792] {
  %p = f32[1536]{0} parameter(0)
  %b = f32[1792]{0} fusion(), kind=kLoop, calls=%fused_broadcast
  %o = s64[4]{0} fusion(%p), kind=kLoop, calls=%c
  %ragged-all-to-all-start = ((f32[1536]{0}, f32[1792]{0}, s64[4]{0}, s64[4]{0}, s64[4]{0}, /*index=5*/s64[4]{0}), \
f32[1792]{0}) ragged-all-to-all-start(%p, %b, %o, %o, %o, /*index=5*/%o), channel_id=1, replica_groups={{0,1,2,3}}, \
backend_config={"collective_backend_config":{"is_sync":true}}
  ROOT %ragged-all-to-all-done = f32[1792]{0} ragged-all-to-all-done(%ragged-all-to-all-start)
}
"""


def test_the_gpu_start_form_is_read_as_its_output():
  """XLA:GPU's async form (copied from an H100 compile): the start's operands (with the s64 offset and size
  vectors) are not what moves; its output is, in the dtype, over the group in order."""
  exp = hlo_check.Expectation(op="ragged-all-to-all", groups=np.array([[0, 1, 2, 3]]), ordered=True,
                              dtype="float32", elements=1792, executions=1, widen_ok=False)
  v = hlo_check.verify(_GPU_START, exp)
  assert v.match.emitted == "ragged-all-to-all-start" and v.wire_dtype == "float32" and v.sync_starts == 1
  with pytest.raises(hlo_check.HloMismatch, match="moves 1792 elements per device, expected 1536"):
    hlo_check.verify(_GPU_START, exp.__class__(**{**exp.__dict__, "elements": 1536}))
  with pytest.raises(hlo_check.HloMismatch, match="expected ragged-all-to-all over groups"):
    hlo_check.verify(_GPU_START.replace("{{0,1,2,3}}", "{{0,2,1,3}}"), exp)
  with pytest.raises(hlo_check.HloMismatch, match="expected all-to-all"):  # the CPU form is not accepted here
    hlo_check.verify(_GPU_START, exp.__class__(**{**exp.__dict__, "op": "all-to-all"}))


class PaddedOnGpu(collectives.RaggedAllToAll):
  """The CPU emulation compiled for a GPU: a dense all-to-all where the ragged one must run."""
  name = "ragged_all_to_all padded on a GPU"

  @staticmethod
  def native(platform):
    return False

  def hlo_expect(self, platform):
    return "ragged-all-to-all" if platform == "gpu" else "all-to-all"


class IndependentRepetitions(collectives.RaggedAllToAll):
  """Each repetition on a fresh zeroed buffer, independent of the previous one: XLA merges the two of a trip."""
  name = "ragged_all_to_all with independent repetitions"

  def step(self, carry, axes, n, platform):
    x, other, _ = carry
    y = self.op(x, axes, n, platform)
    return (other, x, y), y


class FreshBufferOnGpu(collectives.RaggedAllToAll):
  """Zeroes a fresh output buffer for every repetition (after the previous one, so none is merged): a
  message-sized write besides the collective."""
  name = "ragged_all_to_all zeroing a buffer every repetition"

  def step(self, carry, axes, n, platform):
    x, other, prev = carry
    buf = jnp.zeros_like(prev) + (prev[:1] == jnp.finfo(prev.dtype).min).astype(prev.dtype)
    y = self.exchange(x, buf, axes, n, platform)
    return (other, x, y), y


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_compiled_for_h100_it_is_the_async_ragged_all_to_all_in_the_loop():
  """Deviceless XLA:GPU: every distribution's timed programs run ragged-all-to-all-start/done inside the loop
  with nothing of the message's size written besides; the padded emulation, a zeroed buffer per repetition and
  repetitions independent of each other (XLA merges them) fail the check there."""
  target = gpu_compile.make_target("h100", 2, 4)
  gpu_mesh = build_mesh(Topology(racks=1, nodes=2, gpus=4), list(target.devices))
  plan = {p.name: p for p in plan_scopes(Topology(racks=1, nodes=2, gpus=4), SCOPES)}["global"]
  for name in collectives.RAGGED:
    coll = collectives.get(name)
    point = program.build_check(coll, gpu_mesh, plan, 4096, "bfloat16")
    assert point.check_prog.verified.match.emitted == "ragged-all-to-all-start"
    long = program.build_timed(coll, gpu_mesh, plan, 4096, "bfloat16", 10)
    assert long.verified.executions == 10 and long.verified.in_loop >= 8 and long.verified.wire_dtype == "bfloat16"
    assert "ragged-all-to-all-done" in long.hlo_text and " all-to-all(" not in long.hlo_text
  with pytest.raises(hlo_check.HloMismatch, match="expected ragged-all-to-all"):
    program.build_check(PaddedOnGpu("skewed"), gpu_mesh, plan, 4096, "float32")
  with pytest.raises(hlo_check.HloMismatch, match="writes [0-9]+ elements besides the collective"):
    program.build_timed(FreshBufferOnGpu("skewed"), gpu_mesh, plan, 4096, "float32", 6)
  with pytest.raises(hlo_check.HloMismatch, match="runs 3 times per call, expected 6"):
    program.build_timed(IndependentRepetitions("skewed"), gpu_mesh, plan, 4096, "float32", 6)


# ------------------------------------------------------------------------------------------------ the sweep

def test_all_stays_the_six_and_the_ragged_ones_are_listed_by_name():
  from microbench.bench import settings  # pylint: disable=import-outside-toplevel
  from microbench.cli import bench as bench_cli  # pylint: disable=import-outside-toplevel
  assert not set(collectives.RAGGED) & set(collectives.NAMES)
  assert settings.choose(["all"], collectives.NAMES, "collective", collectives.RAGGED) == collectives.NAMES
  assert settings.choose(["ragged_all_to_all_skewed"], collectives.NAMES, "collective",
                         collectives.RAGGED) == ("ragged_all_to_all_skewed",)
  help_text = bench_cli.FLAGS["collectives"].help
  assert all(name in help_text for name in collectives.RAGGED)


@pytest.fixture(scope="module")
def sweep_records(tmp_path_factory):
  out = tmp_path_factory.mktemp("ragged") / "run"
  r = run_cli([f"--collectives={','.join(collectives.RAGGED)}", "--scopes=scale_up,global", "--min_bytes=1K",
               "--max_bytes=1K", "--samples=3", f"--outdir={out}"], timeout=400)
  assert r.returncode == 0, r.stderr[-2000:]
  return [json.loads(line) for line in open(out / "results.jsonl")], r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", collectives.RAGGED)
def test_the_sweep_records_every_distribution_ok_and_checked(sweep_records, name):
  """On 8 CPU devices: every point ok, its check and every timed repetition exact, busbw by the convention.
  One size: a second (16K) was 43 of the fixture's 77 CPU-s, compiles for what the same-records sweep
  (ragged_all_to_all, 1K to 64K) and the layout tests over counts already cover."""
  recs, stdout = sweep_records
  mine = [x for x in recs if x["collective"] == name]
  assert len(mine) == 2, [x["collective"] for x in recs]  # 2 scopes x 1 size
  for x in mine:
    assert x["status"] == "ok" and x["wrong"] == 0 and x["timed_wrong"] == 0, x
    assert "padded all-to-all" in x["impl"]
    n = x["group_size"] if "group_size" in x else x["n"]
    coll = collectives.get(name)  # the bytes the point's own sizes send, not the distribution's limit
    want = conventions.ragged_busbw_factor(coll.layout(x["count"], n).sizes.tolist())
    assert x["busbw_gbps"] == pytest.approx(x["algbw_gbps"] * want)
  assert f"{name} over global" in stdout


def test_weight_shares_are_exact_fractions():
  shares = ragged_sizes.weight_shares("hot_expert", 4)
  assert all(sum(row) == 1 for row in shares) and all(row[2] == Fraction(3, 4) for row in shares)


# ------------------------------------------------------------------------------------------------ the MoE dispatch

def test_router_counts_become_each_devices_send_sizes():
  """One step's per-expert assignments (summed over the batch, 2 dispatches, 8 batch shards) -> the rows each
  device sends each of 4 expert-parallel ranks (experts 2 per rank, in blocks), summing to its assignments."""
  counts = np.array([100, 60, 0, 0, 20, 20, 40, 0], np.float32)  # 240 = 2 dispatches x 8 shards x 15 rows
  sizes = dispatch.sizes_from_counts(counts, ep=4, dispatches=2, batch_shards=8)
  assert sizes.rows.tolist() == [[10, 0, 2, 3]] * 4  # 160 : 0 : 40 : 40 of 15 rows, rounded cumulatively
  assert sizes.sent == 15 and sizes.received.tolist() == [40, 0, 8, 12]
  assert dispatch.busbw_factor(sizes) == pytest.approx(3 * 10 / 15)  # rank 0 receives 3 others' 10 rows
  with pytest.raises(ValueError, match="ep:3 does not divide the 8 experts"):
    dispatch.sizes_from_counts(counts, ep=3, dispatches=2, batch_shards=8)


@pytest.fixture(scope="module")
def ep_mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))


def test_the_dispatch_is_checked_and_timed(ep_mesh):
  sizes = dispatch.Sizes(np.array([[3, 0, 5, 1], [2, 2, 2, 3], [0, 0, 9, 0], [1, 6, 1, 1]]))
  assert dispatch.check(ep_mesh, "expert", sizes, 5, native=False) == 0
  rec = dispatch.measure(ep_mesh, "expert", sizes, 16, jnp.bfloat16, rounds=3)
  assert rec["moe_dispatch_wrong"] == 0 and rec["moe_dispatch_time_s"] is not None
  assert rec["moe_dispatch_bytes"] == 9 * 16 * 2 and "XLA:CPU has no ragged-all-to-all" in rec["moe_dispatch_op"]


class _LateOutput(dispatch.Sizes):
  @property
  def output_offsets(self):
    return super().output_offsets + 1


class _SwappedDestinations(dispatch.Sizes):
  @property
  def input_offsets(self):
    return super().input_offsets[:, [1, 0, 2, 3]]


@pytest.mark.parametrize("planted", ["output offsets one row late", "one size a row short", "swapped destinations"])
def test_a_wrong_dispatch_fails_its_check(ep_mesh, monkeypatch, planted):
  """The mutations the check exists for, planted in the exchange the timed programs run (the expectation
  keeps the right sizes)."""
  real = dispatch._exchange

  def wrong(x, buf, sizes, axis, native):
    rows = sizes.rows.copy()
    if planted == "one size a row short":
      rows[1, 2] -= 1
      return real(x, buf, dispatch.Sizes(rows), axis, native)
    return real(x, buf, (_LateOutput if planted.startswith("output") else _SwappedDestinations)(rows), axis, native)
  monkeypatch.setattr(dispatch, "_exchange", wrong)
  sizes = dispatch.Sizes(np.array([[3, 1, 5, 1], [2, 2, 2, 3], [1, 0, 9, 0], [1, 6, 1, 1]]))
  assert dispatch.check(ep_mesh, "expert", sizes, 5, native=False) > 0
  assert dispatch.measure(ep_mesh, "expert", sizes, 5, jnp.float32, rounds=3)["moe_dispatch_time_s"] is None


@pytest.mark.slow
def test_an_expert_parallel_run_reports_its_dispatch():
  """microbench-train with ep:4: the summary holds one checked, timed dispatch with the router's sizes (every
  device's 2 x 16 assignments per dispatch), and the table says what ran."""
  from microbench import train  # pylint: disable=import-outside-toplevel
  cfg = train.TrainConfig(model="mixtral", size="tiny", parallelism="dp:2,ep:4", batch=8, seq_len=16, steps=2,
                          warmup_steps=1, write=False, verbose=False,
                          compiler_options={"xla_backend_optimization_level": 0})
  s = train.run(cfg, train.plan(cfg, jax.devices()[:8])).summary
  rows = np.array(s["moe_dispatch_rows"])
  assert rows.shape == (4, 4) and (rows.sum(axis=1) == 2 * 16).all() and s["moe_dispatch_wrong"] == 0
  assert s["moe_dispatch_time_s"] is not None and s["moe_dispatch_bytes"] == 32 * 64 * 4
  assert "dispatch" in train.format_table(s)


def test_a_dispatch_program_whose_exchanges_merge_is_not_timed(ep_mesh, monkeypatch):
  """Exchanges that ignore the previous one's buffer are loop-invariant: XLA hoists or merges them, the compiled
  count of exchanges per call is not the repetitions, and the dispatch is not timed (the check still passes:
  one exchange is right)."""
  real = dispatch._exchange
  monkeypatch.setattr(dispatch, "_exchange",
                      lambda x, buf, sizes, axis, native: real(x, jnp.zeros_like(buf), sizes, axis, native))
  sizes = dispatch.Sizes(np.array([[3, 1, 5, 1], [2, 2, 2, 3], [1, 0, 9, 0], [1, 6, 1, 1]]))
  rec = dispatch.measure(ep_mesh, "expert", sizes, 5, jnp.float32, rounds=3)
  assert rec["moe_dispatch_wrong"] == 0 and rec["moe_dispatch_time_s"] is None
  assert "exchanges per call as compiled: not timed" in rec["moe_dispatch_note"]


def test_there_is_no_in_place_ragged_all_to_all():
  assert "no in-place form" in collectives.with_inplace("ragged_all_to_all_skewed").refuses("float32")
