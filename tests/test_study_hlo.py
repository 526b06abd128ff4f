"""Proxies derived from the compiled HLO of microbench-train's step: the event walk (loops by trip count,
async pairs, every replica-group form, permutes), agreement with the training step's own communication
fingerprint, and a clear refusal for strategies the trainer can't run yet."""

from __future__ import annotations

import re

import pytest

from microbench.hlo import parse as hlo
from microbench.study import step_collectives as hs
from microbench.study import rank_programs as sch
from microbench.train import comm_fingerprint

SYNTHETIC = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%body2 (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %y = f32[4]{0} all-to-all(%x), channel_id=7, replica_groups=[2,2]<=[4], dimensions={0}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}

ENTRY %main (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %ag-start = (f32[2]{0}, f32[8]{0}) all-gather-start(%p0), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  %ag-done = f32[8]{0} all-gather-done(%ag-start)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[2]{0} reduce-scatter(%x), channel_id=3, replica_groups=mesh['axis_0'=4] {'axis_0'}, dimensions={0}, to_apply=%add
  %cp = f32[8]{0} collective-permute(%x), channel_id=4, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %w2 = (s32[], f32[8]{0}) while(%t1), condition=%cond, body=%body2
  ROOT %r = f32[8]{0} copy(%cp)
}
"""


def test_events_walk_loops_async_pairs_and_group_forms():
  evts, notes = hs.events(SYNTHETIC, 4)
  kinds = [(e.kind, e.op) for e in evts]
  assert kinds == [("start", "all_gather"), ("done", "")] + [("blocking", "all_reduce")] * 3 + [
      ("blocking", "reduce_scatter"), ("blocking", "permute"), ("blocking", "all_to_all")]
  ag, ar, rs, cp, a2a = evts[0], evts[2], evts[5], evts[6], evts[7]
  assert ag.nbytes == 32 and ag.groups == ((0, 1, 2, 3),) and evts[1].name == ag.name == "ag-start"
  assert ar.nbytes == 32 and ar.groups == ((0, 1), (2, 3))
  assert rs.nbytes == 2 * 4 * 4 and rs.groups == ((0, 1, 2, 3),)  # reduce-scatter: input = output x group
  assert cp.pairs == ((0, 1), (1, 0), (2, 3), (3, 2)) and sorted(cp.groups) == [(0, 1), (2, 3)]
  assert a2a.groups == ((0, 1), (2, 3))
  assert notes["unknown_trip_counts"] == 1 and notes["loops"][0]["trip_count"] == 3


def test_ignoring_the_trip_count_would_undercount():
  """Mutation: the same module with the trip count dropped counts the loop's all-reduce once, not 3 times."""
  evts, _ = hs.events(SYNTHETIC.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""), 4)
  assert sum(1 for e in evts if e.op == "all_reduce") == 1


def test_schedule_from_events_maps_groups_to_ranks():
  evts, _ = hs.events(SYNTHETIC, 4)
  job = hs.schedule_from_events(evts, [3, 2, 1, 0], 1.0, "t", 4, (2, 2), ("data", "tensor"))
  sch.check_consistent(job)
  r3 = list(job.comms(3))  # device position 0 is rank 3
  assert r3[0].op == "all_gather" and r3[0].group.ranks == (3, 2, 1, 0)
  assert r3[1].group.ranks == (3, 2) and r3[1].group.kind == "tensor"
  perm = next(c for c in r3 if c.op == "permute")
  assert perm.pairs == ((0, 1), (1, 0)) and perm.group.ranks == (3, 2)
  assert sch.compute_seconds(job, 0) == pytest.approx(1.0)
  assert any(isinstance(s, sch.Start) for s in job.ranks[0]) and any(isinstance(s, sch.Wait) for s in job.ranks[0])


def test_mesh_replica_groups_parse():
  assert hlo.parse_mesh_groups("mesh['a'=2,'b'=3] {'b'}") == ((0, 1, 2), (3, 4, 5))
  assert hlo.parse_mesh_groups("mesh['a'=2,'b'=3] {'a'}") == ((0, 3), (1, 4), (2, 5))
  assert hlo.parse_mesh_groups("mesh['a'=2,'b'=2] {'a','b'}") == ((0, 1, 2, 3),)
  with pytest.raises(ValueError):
    hlo.parse_mesh_groups("mesh['a'=2] {'z'}")


FAST = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def steps():
  import jax
  return {pf: hs.compile_step(pf, 4, devices=jax.devices()[:4], compiler_options=FAST)
          for pf in ("gpt2-tiny,dp", "gpt2-tiny,fsdp")}


@pytest.mark.slow
@pytest.mark.parametrize("proxy_from", ["gpt2-tiny,dp", "gpt2-tiny,fsdp"])
def test_derived_bytes_equal_the_training_steps_fingerprint(steps, proxy_from):
  step = steps[proxy_from]
  job = hs.from_step(step)
  sch.check_consistent(job)
  fp = comm_fingerprint.comm_fingerprint(step.text, 4)
  derived: dict[str, int] = {}
  for c in job.comms(0):
    derived[c.op] = derived.get(c.op, 0) + sch.sent_bytes(c, 0)
  want = {k.replace("-", "_"): v["bytes"] for k, v in fp.items()}
  assert derived == pytest.approx(want, rel=1e-6, abs=8)
  assert job.meta["strategy"] == proxy_from.split(",")[1] and job.gpus == 4


def test_derived_dp_reduces_every_gradient(steps):
  job = hs.from_step(steps["gpt2-tiny,dp"])
  total = sum(sch.bytes_per_iteration(job, 0).values())
  params = job.meta["params"]
  # float32 gradients of every parameter, plus the loss; the tied embedding (vocab 256 x 64 = 16384) may be
  # reduced once for each of its two uses
  assert 4 * params <= total <= 4 * (params + 16384) + 64
  hand = sch.build("dp", 4)
  cmp = hs.compare(hand, job)
  assert cmp["derived"]["total_rank0"] == total and cmp["difference_bytes"] == total - cmp["hand"]["total_rank0"]


def test_every_strategy_derives_and_bad_input_is_one_line():
  assert hs.training_parallelism("dp+pp", 16) == "pp:8,dp:2"
  assert hs.training_parallelism("dp+pp+tp", 32) == "pp:8,dp:1,tp:4"
  assert hs.training_parallelism("dp+pp+ep", 64) == "pp:8,dp:1,ep:8"
  with pytest.raises(ValueError, match="MODEL,STRATEGY"):
    hs.parse_proxy_from("llama3-8b")
  assert hs.parse_proxy_from("llama3-8b,FSDP") == ("llama3", "8b", "fsdp")
  assert hs.training_parallelism("fsdp", 16) == "dp:2,fsdp:8"


@pytest.fixture(scope="module")
def pipelined():
  """llama3-small under the study's DP+PP+TP on 8 devices: pp:2, tp:4, 16 microbatches, GPipe."""
  import jax
  return hs.compile_step("llama3-small,dp+pp+tp", 8, devices=jax.devices()[:8], seq_len=32, compiler_options=FAST)


def _branch_counts(step) -> tuple[int, int, int]:
  """All-reduces in the tick's forward branch (head excluded), backward branch, and the head's branch."""
  comps, _ = hs.computations(step.text)
  body = next(b for b in (re.search(r"body=%?([\w.\-]+)", ln).group(1) for c in comps.values() for ln in c
                          if re.search(r"\swhile\(", ln) and f'"n":"{step.pipeline.ticks}"' in ln))

  def count(comp: str) -> tuple[int, int]:  # (own, inside nested conditionals)
    own = nested = 0
    for ln in comps[comp]:
      if " all-reduce(" in ln:
        own += 1
      for callee in re.findall(r"(?:body|calls|to_apply)=%?([\w.\-]+)", ln):
        if callee in comps and " while(" in ln:
          trips = int(re.search(r'"n":"(\d+)"', ln).group(1))
          o, n = count(callee)
          own, nested = own + trips * o, nested + trips * n
      found = re.search(r"branch_computations=\{([^}]*)\}", ln)
      if found:
        o, n = count(found.group(1).split(",")[-1].strip().lstrip("%"))
        nested += o + n
    return own, nested

  conds = [re.search(r"branch_computations=\{([^}]*)\}", ln).group(1).split(",")[-1].strip().lstrip("%")
           for ln in comps[body] if " conditional(" in ln]
  compute = [c for c in conds if count(c) != (0, 0)]
  (f_own, head), (b_own, _) = count(compute[0]), count(compute[1])
  return f_own, b_own, head


def test_derived_pipeline_counts_what_each_stage_runs_at_each_tick(pipelined):
  """Tensor-parallel all-reduces inside the pipeline's branches run M times per stage (its microbatches), the
  head's only on the last stage, and the transfers only on the ticks that move data; counting a branch on every
  tick (the fingerprint's convention) would give `ticks` per stage."""
  job = hs.from_step(pipelined)
  sch.check_consistent(job)
  f, b, head = _branch_counts(pipelined)
  assert f > 0 and b > 0 and head > 0
  m, sends = 16, hs.np.asarray(pipelined.pipeline.sends)
  by_stage = {}
  for rank in range(8):
    comms = list(job.comms(rank))
    tp = sum(1 for c in comms if c.op == "all_reduce" and c.label == "tensor")
    fwd = sum(1 for c in comms if c.op == "permute" and c.pairs[0][1] > c.pairs[0][0])
    stage = pipelined.pipeline.stage_of[[d.id for d in pipelined.mesh.devices.flat].index(
        pipelined.devices[rank].id)]
    by_stage.setdefault(stage, set()).add((tp, fwd))
  (tp0, fwd0), = by_stage[0]
  (tp1, fwd1), = by_stage[1]
  assert fwd0 == fwd1 == int(sends[:, 0].sum()) < pipelined.pipeline.ticks  # transfers only when data moves
  # the same few tensor all-reduces outside the pipeline on every stage (the embedding's, gradient sums)
  outside = tp0 - m * (f + b)
  assert 0 <= outside < f and tp1 - m * (f + b + head) == outside
  assert pipelined.pipeline.ticks > m  # so once per tick would differ
