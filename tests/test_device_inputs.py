"""The known inputs and the check built on the devices equal the host's specification (known_inputs), element
by element, and the device comparison counts exactly what the host comparison counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microbench.meshes.mesh import build_mesh, ordered_devices
from microbench.meshes.scopes import SCOPES, plan_scopes
from microbench.meshes.topology import Topology
from microbench.bench import collectives, device_inputs, known_inputs, program

TOPOLOGY = Topology(racks=2, nodes=2, gpus=2)
PLANS = {p.name: p for p in plan_scopes(TOPOLOGY, SCOPES)}


@pytest.fixture(scope="module")
def mesh():
  return build_mesh(TOPOLOGY, ordered_devices())


def _device_values(family, g, ranks, i):
  tabs = {k: jnp.asarray(v) for k, v in family.host_tables.items()}
  fn = jax.jit(lambda g, q, i: family.value(tabs, g, q, i))
  return np.asarray(fn(jnp.int32(g), jnp.asarray(ranks, jnp.int32)[:, None], jnp.asarray(i, jnp.int32)[None, :]))


CASES = [("data", "float32", 8, 96), ("data", "bfloat16", 1000, 64), ("data", "bfloat16", 262144, 16),
         ("data", "float8_e4m3fn", 70, 40), ("data", "float16", 5000, 33), ("data", "int32", 3, 7),
         ("sum", "float32", 8, 96), ("sum", "bfloat16", 4096, 16), ("sum", "float16", 6, 1 << 20),
         ("sum", "int32", 262144, 8), ("sum", "float32", 5, 7), ("prod", "float32", 6, 24),
         ("prod", "int32", 7, 49), ("max", "bfloat16", 9, 18), ("min", "float16", 12, 5)]


@pytest.mark.parametrize("kind,dtype,n,count", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("run", [0, 1])
def test_the_device_formulas_are_the_host_specification(kind, dtype, n, count, run):
  """Ranks and elements sampled across the group and the message (first, last, around chunk and period
  boundaries), groups 0 and 5, every family and dtype, both check runs."""
  family = device_inputs.Family(kind, dtype, n, count, run)
  ranks = sorted({0, 1, n // 2, n - 2, n - 1, min(n - 1, 511), min(n - 1, 512)} - {-1})
  i = sorted({0, 1, count // 2, count - 1, *range(min(count, 40)),
              *(x for x in (known_inputs.PERIOD - 1, known_inputs.PERIOD, known_inputs.PERIOD + 1) if x < count)})
  for g in (0, 5):
    host = known_inputs.GroupInputs(kind, dtype, n, g, count, run)
    want = np.stack([np.asarray([host.rank(r, j, j + 1)[0] for j in i]) for r in ranks])
    got = _device_values(family, g, ranks, i)
    np.testing.assert_array_equal(got, want.astype(np.int64), err_msg=f"{kind} {dtype} n={n} g={g}")
    if kind != "data":
      reduced = np.asarray(jax.jit(lambda g, i: family.reduced(
          {k: jnp.asarray(v) for k, v in family.host_tables.items()}, g, i))(jnp.int32(g), jnp.asarray(i, jnp.int32)))
      np.testing.assert_array_equal(reduced, [host.reduced(j, j + 1)[0] for j in i])


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                                  "ppermute", "all_reduce_max", "all_reduce_prod", "reduce_scatter_avg"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_device_inputs_and_comparison_match_the_host(mesh, name, dtype):
  """Whole buffers on the 8 devices: the inputs equal the host's, the right output compares clean on both, and
  outputs broken in one element, in one rank's chunk and by a shift count the same wrong elements on both."""
  coll = collectives.get(name)
  if coll.refuses(dtype):
    pytest.skip(coll.refuses(dtype))
  for scope in ("scale_up", "global"):
    plan = PLANS[scope]
    count = 12 * plan.group_size
    point = program.build_check(coll, mesh, plan, count, dtype)
    np.testing.assert_array_equal(np.asarray(program.known_input_array(point)),
                                  np.asarray(program.known_input_array_host(point)))
    y = point.check_prog.fn(program.known_input_array(point))
    assert program.compare_output(point, y) == program.compare_output_host(point, y) == 0
    out = np.asarray(y)
    for broken in (out.copy(), np.roll(out, 1)):
      broken[3] = broken[3] + 1 if broken is not None else 0
      arr = jax.device_put(known_inputs.as_dtype(broken, dtype), y.sharding)
      point.wrong_at = []
      device = program.compare_output(point, arr)
      assert device == program.compare_output_host(point, arr) > 0
      assert point.wrong_at and point.wrong_at[0]["first"] >= 0


def test_a_collective_without_a_device_source_says_so(mesh):
  class NoSource(collectives.Collective):
    name, hlo_op = "no source", "all-gather"

    def op(self, x, axes, n, platform):
      return x

    def reference(self, xs):
      return xs

    def expected(self, inputs, rank, in_count, start, stop):
      return inputs.rank(rank, start, stop)

  with pytest.raises(NotImplementedError, match="no `source`"):
    NoSource().source(0, jnp.arange(3), 2, 3)
