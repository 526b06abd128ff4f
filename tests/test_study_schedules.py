"""The study's proxies as data: the roofline reproduces the methodology's forward times, and every strategy's
bytes per iteration and rank equal the methodology's formulas (computed from the schedule, not executed).
Each equivalence is shown to catch a planted bug."""

from __future__ import annotations

import dataclasses

import pytest

from microbench.study import rank_programs as sch
from microbench.study import workloads as wl

# Methodology section 1: forward time (s) at B=16 for A100 / GH200 / MI250X / GB300.
TABLE = {
    "vit-h": (.017, .0054, .014, .0022),
    "llama3-8b": (6.77, 2.13, 5.51, 0.88),
    "minerva-7b": (2.93, 0.92, 2.39, 0.38),
    "llama3-70b": (58.6, 18.5, 47.8, 7.6),
    "mixtral-8x7b": (61.3, 19.3, 50.0, 8.0),
}


@pytest.mark.parametrize("model", TABLE)
def test_roofline_reproduces_the_studys_forward_times(model):
  for gpu, want in zip(("A100", "GH200", "MI250X", "GB300"), TABLE[model]):
    got = wl.forward_seconds(wl.MODELS[model], wl.GPUS[gpu])
    # The table has 2-3 significant digits.
    assert got == pytest.approx(want, rel=0.025), (model, gpu, got)


def test_roofline_is_memory_bound_where_intensity_is_low():
  """A few tokens make the weights' reads dominate: time follows bandwidth, not peak."""
  m = dataclasses.replace(wl.MODELS["llama3-70b"], seq=8)
  fast_memory = dataclasses.replace(wl.GPUS["A100"], bandwidth=2 * wl.GPUS["A100"].bandwidth)
  assert wl.forward_seconds(m, fast_memory, batch=1) < 0.6 * wl.forward_seconds(m, wl.GPUS["A100"], batch=1)
  m = wl.MODELS["llama3-70b"]
  assert wl.forward_seconds(m, fast_memory) == pytest.approx(wl.forward_seconds(m, wl.GPUS["A100"]), rel=1e-3)


def test_message_sizes_match_the_methodologys_numbers():
  p = wl.MODELS
  assert p["vit-h"].params / 50 == pytest.approx(12.65e6, rel=1e-3)  # DP bucket
  assert p["llama3-8b"].params / 16 == pytest.approx(501.9e6, rel=1e-3)  # FSDP unit
  assert p["minerva-7b"].seq * p["minerva-7b"].d_model == pytest.approx(16.8e6, rel=2e-3)  # PP message
  assert p["llama3-70b"].seq * p["llama3-70b"].d_model / 4 == pytest.approx(16.8e6, rel=2e-3)  # TP all-reduce
  assert p["llama3-70b"].params / 32 == pytest.approx(2.2e9, rel=2e-2)  # DP all-reduce with TP
  ep = p["mixtral-8x7b"]
  assert ep.seq * 2 * ep.d_model / 8 == pytest.approx(33.6e6, rel=2e-3)  # EP per-peer all-to-all
  assert 1.5e9 < ep.non_expert_params < 1.8e9  # the study's txt files: 1.7e9


def test_degrees_follow_the_launch_commands_and_shrink_for_small_jobs():
  assert wl.degrees("fsdp", 16) == wl.Degrees(2, 1, 8) and wl.degrees("fsdp", 4) == wl.Degrees(1, 1, 4)
  assert wl.degrees("dp+pp", 8).stages == 2 and wl.degrees("dp+pp", 16) == wl.Degrees(2, 8, 1)
  assert wl.degrees("dp+pp+tp", 224) == wl.Degrees(7, 8, 4)
  assert wl.degrees("dp+pp+ep", 512) == wl.Degrees(8, 8, 8)
  assert wl.degrees("dp+pp+tp", 8) == wl.Degrees(1, 2, 4)
  for s in wl.STRATEGIES:
    for g in (1, 2, 3, 6, 12, 28, 64):
      assert wl.degrees(s, g).gpus == g
  with pytest.raises(wl.WorkloadError, match="choose one of"):
    wl.strategy("zero3")


def expected_bytes(strategy: str, gpus: int, rank: int) -> dict[str, int]:
  """The methodology's formulas, bf16 (2 bytes), nccl-tests' S convention, per rank and iteration."""
  s = 2
  st = wl.STRATEGIES[strategy]
  m = wl.MODELS[st.model]
  d = wl.degrees(strategy, gpus)
  M = wl.MICROBATCHES
  if strategy == "dp":
    return {"bucket": m.params * s}
  if strategy == "fsdp":
    U, F = wl.FSDP_UNITS, d.inner
    shards = [-(-u // F) for u in wl.split(m.params, U)]
    # forward gathers every unit, backward prefetches units U-2..0; one reduce-scatter per unit
    out = {"allgather": (sum(shards) + sum(shards[:-1])) * F * s, "reduce_scatter": sum(shards) * F * s}
    if d.data > 1:
      out["replica"] = sum(shards) * s
    return out
  stage = (rank // d.inner) % d.stages
  msg = m.seq * m.d_model * (wl.LOCAL_BATCH // M)
  sends = (stage < d.stages - 1) + (stage > 0)  # forward to the next stage, backward to the previous one
  out = {"pp": M * msg * s * sends} if d.stages > 1 else {}
  if strategy == "dp+pp":
    dp = m.params // d.stages
  elif strategy == "dp+pp+tp":
    out["tp"] = 2 * 2 * M * (msg // d.inner) * s
    dp = m.params // (d.stages * d.inner)
  else:
    per_peer = (wl.LOCAL_BATCH // M) * m.seq * 2 * m.d_model // d.inner
    out["ep"] = 2 * 2 * (m.layers // d.stages) * M * per_peer * d.inner * s
    out["dp_ep"] = m.non_expert_params // d.stages * s
    dp = m.non_expert_params // d.stages + m.expert_params // (d.stages * d.inner)
  if d.data > 1:
    out["dp"] = dp * s
  return out


CASES = [("dp", 8), ("dp", 16), ("fsdp", 16), ("fsdp", 32), ("fsdp", 8), ("dp+pp", 16), ("dp+pp", 8),
         ("dp+pp+tp", 224), ("dp+pp+ep", 512)]


@pytest.fixture(scope="module")
def built():
  return {(s, g): sch.build(s, g) for s, g in CASES}


@pytest.mark.parametrize("strategy,gpus", CASES)
def test_bytes_per_iteration_equal_the_formulas(built, strategy, gpus):
  job = built[(strategy, gpus)]
  d = wl.degrees(strategy, gpus)
  ranks = {0, gpus - 1, d.inner, d.inner * (d.stages // 2)}  # first, last and middle stages
  for r in sorted(x for x in ranks if x < gpus):
    assert sch.bytes_per_iteration(job, r) == expected_bytes(strategy, gpus, r), (strategy, gpus, r)


@pytest.mark.parametrize("strategy,gpus", CASES)
def test_every_communicator_sees_the_same_calls(built, strategy, gpus):
  sch.check_consistent(built[(strategy, gpus)])


def test_counts_and_compute_follow_the_proxies(built):
  dp = built[("dp", 8)]
  assert sum(1 for c in dp.comms(0)) == 50
  fwd = wl.forward_seconds(wl.MODELS["vit-h"], wl.GPUS["A100"])
  assert sch.compute_seconds(dp, 0) == pytest.approx(3 * fwd)
  fsdp = built[("fsdp", 16)]
  assert sch.compute_seconds(fsdp, 3) == pytest.approx(3 * wl.forward_seconds(wl.MODELS["llama3-8b"], wl.GPUS["A100"]))
  tp = built[("dp+pp+tp", 224)]  # microbatch compute T / (S M TP), 3x for forward + backward, M of them
  t = wl.forward_seconds(wl.MODELS["llama3-70b"], wl.GPUS["A100"])
  assert sch.compute_seconds(tp, 0) == pytest.approx(3 * t / (8 * 4))
  ep = built[("dp+pp+ep", 512)]
  assert sum(1 for c in ep.comms(0) if c.op == "all_to_all") == 2 * 2 * 4 * 16  # 2 x layers/stage per mb and pass
  assert dp.samples_per_iteration == 16 * 8 and tp.samples_per_iteration == 16 * 7


def test_a_dropped_collective_breaks_the_formula_and_the_consistency_check(built):
  """Mutation: remove one reduce-scatter from one FSDP rank; both checks must catch it."""
  job = built[("fsdp", 16)]
  steps = list(job.ranks[5])
  i = next(k for k, s in enumerate(steps) if isinstance(s, sch.Blocking) and s.comm.op == "reduce_scatter")
  del steps[i]
  broken = dataclasses.replace(job, ranks=job.ranks[:5] + (tuple(steps),) + job.ranks[6:])
  assert sch.bytes_per_iteration(broken, 5) != expected_bytes("fsdp", 16, 5)
  with pytest.raises(ValueError, match="issues"):
    sch.check_consistent(broken)


def test_consistency_check_catches_reordering_deadlocks_and_unwaited_starts(built):
  dp = built[("dp", 8)]
  steps = list(dp.ranks[0])
  starts = [k for k, s in enumerate(steps) if isinstance(s, sch.Start)]
  steps[starts[0]], steps[starts[-1]] = steps[starts[-1]], steps[starts[0]]  # buckets of different sizes
  with pytest.raises(ValueError, match="issues"):
    sch.check_consistent(dataclasses.replace(dp, ranks=(tuple(steps),) + dp.ranks[1:]))
  # Stage 1 waiting for its first backward gradient before its forwards: stage 2 sends it only after the
  # forwards stage 1 never sends.
  job = built[("dp+pp", 16)]
  steps = list(job.ranks[1])
  k = next(k for k, s in enumerate(steps) if isinstance(s, sch.Blocking) and s.comm.group.ranks == (2, 1))
  steps.insert(0, steps.pop(k))
  with pytest.raises(ValueError, match="deadlock"):
    sch.check_consistent(dataclasses.replace(job, ranks=job.ranks[:1] + (tuple(steps),) + job.ranks[2:]))
  no_wait = tuple(s for s in dp.ranks[0] if not isinstance(s, sch.Wait))
  with pytest.raises(ValueError, match="never waits"):
    sch.check_consistent(dataclasses.replace(dp, ranks=(no_wait,) + dp.ranks[1:]))


def test_scaling_keeps_group_multiples_and_scales_compute(built):
  job = built[("fsdp", 16)]
  small = job.scaled(bytes_scale=1e-6, compute_scale=0.01)
  for c in small.comms(0):
    if c.op in ("all_gather", "reduce_scatter"):
      assert c.elements % c.group.size == 0 and c.elements >= c.group.size
  assert sch.compute_seconds(small, 0) == pytest.approx(0.01 * sch.compute_seconds(job, 0))
  total = sum(sch.bytes_per_iteration(small, 0).values())
  assert total == pytest.approx(1e-6 * sum(sch.bytes_per_iteration(job, 0).values()), rel=0.01)
  sch.check_consistent(small)


def test_permute_is_charged_to_its_sources_only():
  c = sch.Comm("permute", 10, sch.Group("pair", (3, 7)), "pp", ((0, 1),))
  assert sch.sent_bytes(c, 3) == 20 and sch.sent_bytes(c, 7) == 0
  with pytest.raises(ValueError):
    sch.Comm("permute", 10, sch.Group("pair", (3, 7)), "pp")
  with pytest.raises(ValueError):
    sch.Comm("all_reduce", 10, sch.Group("pair", (3, 7)), "pp", ((0, 2),))
