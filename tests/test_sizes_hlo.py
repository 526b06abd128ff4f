"""Size parsing and rounding, metric factors, and reading collectives from HLO text."""

import numpy as np
import pytest

from microbench.bench import collectives, hlo_check
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
  from microbench.bench.known_inputs import block
  coll = collectives.get(name)
  rng = np.random.default_rng(0)
  for n in (1, 2, 3, 5):
    group = rng.permutation(40)[:n]
    in_count = 6 * n * 7
    ref = coll.reference(block(group, in_count))
    for r in range(n):
      for a, b in [(0, ref.shape[1]), (3, ref.shape[1] - 2), (17, 18), (5, 5)]:
        np.testing.assert_array_equal(coll.expected(group, r, in_count, a, b), ref[r][a:b])


def test_known_inputs_any_range():
  from microbench.bench.known_inputs import values
  for start, stop in [(0, 40), (5, 100), (3, 3), (16, 17), (100, 1000)]:
    i = np.arange(start, stop)
    np.testing.assert_array_equal(values(3, start, stop), ((7 * i + 131 * 3) % 17 - 8).astype(np.float32))


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
  assert hlo_check.verify(text, "all-reduce", np.array([[0, 4], [1, 5], [2, 6], [3, 7]])).op == "all-reduce"
  with pytest.raises(hlo_check.HloMismatch, match="expected all-reduce"):
    hlo_check.verify(text, "all-reduce", np.array([[0, 1, 2, 3], [4, 5, 6, 7]]))
  with pytest.raises(hlo_check.HloMismatch, match="no collective"):
    hlo_check.verify("%x = f32[] add(%a, %b)", "all-gather", np.array([[0, 1]]))
  with pytest.raises(hlo_check.HloMismatch, match="unexpected"):
    hlo_check.verify(HLO, "all-reduce", np.array([[0, 4], [1, 5], [2, 6], [3, 7]]))
