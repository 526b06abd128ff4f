"""Size parsing and rounding, metric factors, and reading collectives from HLO text."""

import numpy as np
import pytest

from microbench.bench import collectives, hlo_check, known_inputs, program
from microbench.bench.known_inputs import GroupInputs
from microbench.hlo import parse
from microbench.bench.sizes import format_size, parse_size, round_count, sweep


def test_parse_size():
  assert parse_size("8") == 8
  assert parse_size("64K") == 65536
  assert parse_size("32M") == 32 << 20
  assert parse_size("1G") == 1 << 30
  assert parse_size("4KiB") == 4096
  for bad in ["", "1.5M", "-4", "12X"]:
    with pytest.raises(ValueError):
      parse_size(bad)
  assert format_size(65536) == "64K" and format_size(1000) == "1000"


def test_sweep_includes_both_ends():
  assert sweep(1024, 16 << 20, 2)[0] == 1024
  assert sweep(1024, 16 << 20, 2)[-1] == 16 << 20
  assert len(sweep(1024, 16 << 20, 2)) == 15
  assert sweep(1000, 5000, 2) == [1000, 2000, 4000, 5000]
  assert sweep(64, 64, 2) == [64]


def test_round_count_for_groups_that_are_not_powers_of_two():
  assert round_count(1024, 4, 3) == 255  # 256 elements -> multiple of 3 below
  assert round_count(8, 4, 6) == 6       # never below one element per rank
  assert round_count(1 << 20, 2, 1) == 1 << 19


@pytest.mark.parametrize("name,n,factor", [
    ("all_reduce", 8, 2 * 7 / 8), ("all_gather", 8, 7 / 8), ("reduce_scatter", 4, 3 / 4),
    ("all_to_all", 2, 1 / 2), ("broadcast", 8, 1.0), ("ppermute", 8, 1.0)])
def test_busbw_factors_are_nccl_tests(name, n, factor):
  assert collectives.get(name).busbw_factor(n) == pytest.approx(factor)


def test_references_on_a_group_of_three():
  xs = np.arange(3 * 6, dtype=np.float64).reshape(3, 6)
  np.testing.assert_array_equal(collectives.get("all_reduce").reference(xs)[2], xs.sum(0))
  np.testing.assert_array_equal(collectives.get("reduce_scatter").reference(xs)[1], xs.sum(0)[2:4])
  np.testing.assert_array_equal(collectives.get("all_gather").reference(xs)[0], xs.ravel())
  a2a = collectives.get("all_to_all").reference(xs)
  np.testing.assert_array_equal(a2a[1], np.concatenate([xs[0, 2:4], xs[1, 2:4], xs[2, 2:4]]))
  np.testing.assert_array_equal(collectives.get("ppermute").reference(xs)[0], xs[2])
  np.testing.assert_array_equal(collectives.get("broadcast").reference(xs)[2], xs[0])


@pytest.mark.parametrize("name", collectives.NAMES)
def test_streamed_expectation_equals_the_reference(name):
  """`expected` (any range of one rank's output, on the known inputs) agrees with the NumPy spec."""
  coll = collectives.get(name)
  for n in (1, 2, 3, 5):
    for dtype in ("float32", "bfloat16"):
      inputs = GroupInputs(coll.inputs, dtype, n, group_index=2)
      in_count = 6 * n * 7
      ref = coll.reference(np.stack([inputs.rank(r, 0, in_count) for r in range(n)]))
      for r in range(n):
        for a, b in [(0, ref.shape[1]), (3, ref.shape[1] - 2), (17, 18), (5, 5)]:
          np.testing.assert_array_equal(coll.expected(inputs, r, in_count, a, b), ref[r][a:b])


def test_known_inputs_any_range_and_across_the_period():
  inputs = GroupInputs("data", "float32", 4)
  whole = inputs.rank(3, 0, known_inputs.PERIOD + 100)
  for start, stop in [(0, 40), (5, 100), (3, 3), (known_inputs.PERIOD - 7, known_inputs.PERIOD + 9)]:
    np.testing.assert_array_equal(inputs.rank(3, start, stop), whole[start:stop])
  np.testing.assert_array_equal(whole[known_inputs.PERIOD:], whole[:100])  # the documented period


DTYPES = ("float32", "bfloat16", "float16", "int32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_data_inputs_tell_every_pair_of_ranks_apart_up_to_4096(dtype):
  """Every pair of ranks differs at every element while the group fits the dtype's alphabet, and in any
  three consecutive elements up to 4096 ranks (and beyond); no rank is a shifted copy of another."""
  n, count = 4096, 64
  xs = np.stack([GroupInputs("data", dtype, n).rank(r, 0, count) for r in range(n)])
  exact = program.as_dtype(xs, dtype).astype(np.int64)
  np.testing.assert_array_equal(exact, xs)  # every value exact in the dtype
  per_element = min(n, known_inputs.ALPHABET[dtype])
  for i in range(count):
    assert len(np.unique(xs[:per_element, i])) == per_element, (dtype, i)
  for i in range(count - 2):
    assert len(np.unique(xs[:, i:i + 3], axis=0)) == n, (dtype, i)
  # Windows of 5 elements, at every offset of every rank, are all different: no offset error reproduces
  # another rank's (or the same rank's) data.
  windows = np.lib.stride_tricks.sliding_window_view(xs, 5, axis=1).reshape(-1, 5)
  assert len(np.unique(windows, axis=0)) == len(windows)
  # Different groups hold different data (a collective over the wrong groups shows).
  assert (GroupInputs("data", dtype, 8, 0).rank(3, 0, count) != GroupInputs("data", dtype, 8, 1).rank(3, 0, count)).mean() > 0.9


HLO = """
  %all-reduce.1 = f32[256]{0} all-reduce(f32[256]{0} %p), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %ag = f32[64]{0} all-gather-start(%x), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}
  %cp = f32[8]{0} collective-permute(%y), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %a2a = (f32[2]{0}, f32[2]{0}) all-to-all(%s0, %s1), channel_id=4, replica_groups=[4,2]<=[2,4]T(1,0)
"""


def test_find_collectives_explicit_iota_and_pairs():
  found = {c.op: c for c in parse.find_collectives(HLO)}
  assert found["all-reduce"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert found["all-gather"].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert found["collective-permute"].groups == ((0, 1), (1, 0))
  assert found["all-to-all"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_verify_rejects_wrong_groups_and_missing_ops():
  text = HLO.splitlines()[1]
  assert hlo_check.verify_groups(text, "all-reduce", np.array([[0, 4], [1, 5], [2, 6], [3, 7]]))[0].op == "all-reduce"
  with pytest.raises(hlo_check.HloMismatch, match="expected all-reduce"):
    hlo_check.verify_groups(text, "all-reduce", np.array([[0, 1, 2, 3], [4, 5, 6, 7]]))
  with pytest.raises(hlo_check.HloMismatch, match="no collective"):
    hlo_check.verify_groups("%x = f32[] add(%a, %b)", "all-gather", np.array([[0, 1]]))
  with pytest.raises(hlo_check.HloMismatch, match="unexpected"):
    hlo_check.verify_groups(HLO, "all-reduce", np.array([[0, 4], [1, 5], [2, 6], [3, 7]]))


def test_result_types_of_plain_and_async_forms():
  assert parse.result_arrays("f32[256]{0}") == (["f32"], 256)
  assert parse.result_arrays("(bf16[2]{0}, bf16[2]{0})") == (["bf16", "bf16"], 4)
  # all-gather-start returns (operand, output); collective-permute-start adds two u32 contexts.
  assert parse.result_arrays("(f32[64]{0}, f32[256]{0})", "all-gather") == (["f32"], 256)
  assert parse.result_arrays("(f32[64]{0}, f32[64]{0}, u32[], u32[])", "collective-permute") == (["f32"], 64)


NESTED = """
%inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%outer_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %w = (s32[], f32[8]{0}) while(%p), condition=%c1, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %cp = f32[8]{0} copy(%y)
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %cp)
}

%runtime_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar2 = f32[8]{0} all-reduce(%x), channel_id=2, replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w0 = (s32[], f32[8]{0}) while(%t0), condition=%c0, body=%outer_body, backend_config={"known_trip_count":{"n":"5"}}
  %w1 = (s32[], f32[8]{0}) while(%t1), condition=%c2, body=%runtime_body
  ROOT %ar3 = f32[8]{0} all-reduce(%a), channel_id=3, replica_groups={{0,1}}, to_apply=%add
}
"""


def test_execution_counts_follow_nested_loops_and_refuse_unknown_trip_counts():
  counts = parse.execution_counts(NESTED)
  assert counts["main"] == 1 and counts["outer_body"] == 5 and counts["inner_body"] == 15
  assert counts["runtime_body"] is None
  assert {w.body: w.trip_count for w in parse.while_loops(NESTED)} == {
      "inner_body": 3, "outer_body": 5, "runtime_body": None}
  assert parse.reachable(NESTED, "outer_body") == {"outer_body", "inner_body"}
  found = {c.text.removeprefix("ROOT ").split()[0]: c for c in parse.find_collectives(NESTED)}
  assert found["%ar"].computation == "inner_body" and found["%ar3"].computation == "main"


def test_async_starts_count_what_they_deliver():
  """GPU's async forms: collective-permute-start returns (operand, output, u32 contexts) and counts its output
  once; a combined all-reduce-start returns outputs only and is not halved; the mesh form with device_ids
  gives its group size."""
  text = "\n".join([
      "  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}",
      "  %ars = (f32[8]{0}, f32[16]{0}) all-reduce-start(%a, %b), replica_groups={{0,1}}, to_apply=%add",
      "  %rs = f32[32]{0} reduce-scatter(%q), replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([8]) "
      "{'axis_1'}, dimensions={0}, to_apply=%add",
  ])
  by_op = {ins.op: ins for ins in parse.instructions(text)}
  assert parse.moved_parts(by_op["collective-permute"]) == [("f32", 256)]
  assert parse.moved_parts(by_op["all-reduce"]) == [("f32", 32), ("f32", 64)]
  assert {c.op: c.elements for c in parse.find_collectives(text)} == {"collective-permute": 64, "all-reduce": 24,
                                                                      "reduce-scatter": 32}
  assert parse.group_size(by_op["reduce-scatter"].rest, 8) == 4
  assert parse.replica_groups(by_op["reduce-scatter"].rest) == ((0, 1, 2, 3), (4, 5, 6, 7))


CALLED = """
%inner (p: f32[8]) -> f32[8] {
  ROOT %ar = f32[8]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, to_apply=%add
}

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  ROOT %c = f32[8]{0} call(%a), to_apply=%inner
}
"""


def test_a_called_computation_runs_and_a_reduction_does_not():
  """`call`'s to_apply is its callee (its collectives run); an all-reduce's to_apply is a reduction."""
  assert parse.execution_counts(CALLED) == {"main": 1, "inner": 1}
