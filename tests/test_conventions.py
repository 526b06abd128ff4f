"""Collective facts (bus-bandwidth factor, ring volume, latency steps) are defined once, in
fabric/conventions.py, and every user of them agrees: the sweeps, the fabric model, the fits and the study."""

from __future__ import annotations

import pytest

from microbench.bench import collectives as bench_collectives
from microbench.fabric import collective_model as fc
from microbench.fabric import conventions
from microbench.report import alpha_beta
from microbench.study import machines as mm
from microbench.study import predict

NCCL_TESTS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0, "ppermute": lambda n: 1.0}


@pytest.mark.parametrize("n", [2, 3, 8, 72])
@pytest.mark.parametrize("name", conventions.COLLECTIVES)
def test_every_user_takes_the_one_busbw_factor(name, n):
  want = NCCL_TESTS[name](n)
  assert conventions.busbw_factor(name, n) == pytest.approx(want)
  assert bench_collectives.get(name).busbw_factor(n) == pytest.approx(want)
  fab = mm.fabric_of(mm.parse("leonardo"))
  p = fc.predict(fab, name, 1 << 24, fc.dense_shape(fab, n))
  assert p.busbw_gbps / p.algbw_gbps == pytest.approx(want)


def test_reductions_with_other_operators_share_their_familys_factor():
  for name, coll in bench_collectives.REGISTRY.items():
    family = type(coll).name
    if family == "ragged_all_to_all":  # its factor is its send sizes' (ragged_busbw_factor; tests/test_ragged.py)
      continue
    assert coll.busbw_factor(8) == conventions.busbw_factor(family, 8), name


def test_steps_a_fit_divides_by_are_the_models():
  assert [alpha_beta.ring_steps(c, 4) for c in conventions.COLLECTIVES] == [6, 3, 3, 1, 3, 1]
  assert alpha_beta.ring_steps("no_such", 4) is None
  assert conventions.latency_steps("all_reduce", 8, domains=2) == (12, 2)  # 2 x (2 - 1) steps cross the NIC
  assert conventions.latency_steps("all_to_all", 8, domains=2) == (0, 1)
  assert conventions.latency_steps("all_gather", 1) == (0, 0)
  with pytest.raises(ValueError, match="unknown collective 'gather'"):
    conventions.busbw_factor("gather", 4)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_the_studys_latency_is_the_fabric_models(op):
  """One latency formula: a ring of 8 ranks on two 4-GPU Leonardo nodes pays what the fabric model says."""
  machine = mm.parse("leonardo")
  fab = mm.fabric_of(machine)
  links = predict.Links(machine, fab)
  ring = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
  paths = [links.path(ring[i], ring[(i + 1) % 8]) for i in range(8)]
  model = fc.predict(fab, op, 1e3, fc.Shape(4, 2), "ring").latency_us
  assert links.latency_s(op, 8, paths, nodes=2) * 1e6 == pytest.approx(model)


def test_a_changed_convention_reaches_every_user(monkeypatch):
  """The mutation that proves there is one definition: change it in conventions, and the sweep's factor,
  the fabric model's busbw and the study's ring volume all change with it."""
  monkeypatch.setattr(conventions, "busbw_factor", lambda name, n: 0.5)
  assert bench_collectives.get("all_reduce").busbw_factor(4) == 0.5
  fab = mm.fabric_of(mm.parse("leonardo"))
  p = fc.predict(fab, "all_gather", 1 << 24, fc.dense_shape(fab, 8), "ring")
  assert p.busbw_gbps / p.algbw_gbps == 0.5
  assert conventions.ring_bytes("all_reduce", 4, 1000.0) == 500.0
