"""`--command_buffer` (nccl-tests' -G): XLA:GPU's command buffers for a point's programs, confirmed in what
XLA:GPU compiled.

XLA:GPU forms command buffers on the thunk sequence, after the HLO, so the compiled HLO text is the same with
and without them: these tests read XLA's own thunk-sequence dump. The GPU-target tests compile for
compile-only H100s (the `gpu-compile` extra) and are skipped, saying why, without it; the rest run on CPU.
"""

from __future__ import annotations

import glob
import json
import os
import re

import jax
import pytest

from support import run_cli
from microbench.meshes.mesh import build_mesh, ordered_devices
from microbench.meshes.scopes import SCOPES, plan_scopes
from microbench.meshes.topology import AXES, Topology
from microbench.bench import collectives, command_buffer, hlo_check, program, sweep
from microbench.hlo import parse, thunks
from microbench.output import table
from microbench.aot import gpu_compile

needs_plugin = pytest.mark.skipif(not gpu_compile.plugin_available(),
                                  reason="JAX's CUDA PJRT plugin is not installed: pip install -e '.[gpu-compile]'")

# XLA:GPU's thunk sequences of the timed all-reduce loop (H100, jaxlib 0.10.2), as dumped.
# With --command_buffer=yes: one command buffer holds the loop, both all-reduces (sync and async) inside it.
ALL_INSIDE = """\
000: kCommandBuffer [source | sink]
    001: kCopy  [source       | next=002 (1)] kCopy
    002: kWhile [prev=001 (1) | sink        ]
condition:
        003: kCustomKernel [source | sink] loop_compare_fusion
      body:
        004: kAllReduce    [source       | next=006 (1)] kAllReduce
        006: kAsyncStart   [prev=004 (1) | sink        ] stream=communication_stream[0], async_id=6
            005: kAllReduce [source | sink] kAllReduce
        007: kCustomKernel [source       | sink        ] loop_add_fusion
        008: kAsyncDone    [source       | sink        ] async_id=6
"""
# The same options on a device description without CUDA versions (a deviceless one, or a driver older than
# 12.3): XLA drops COLLECTIVES and WHILE, and only the kernels between the collectives go into command buffers.
FUSIONS_ONLY = """\
000: kCommandBuffer [source       | next=002 (1)]
    001: kCopy [source | sink] kCopy
002: kWhile         [prev=000 (1) | sink        ]
condition:
    003: kCustomKernel [source | sink] loop_compare_fusion
  body:
    000: kCommandBuffer [source       | next=005 (1)]
        004: kCopy [source | sink] kCopy
    005: kAllReduce     [prev=000 (1) | next=000 (1)] kAllReduce
    009: kAsyncStart    [prev=000 (1) | next=000 (3)] stream=communication_stream[0], async_id=9
        008: kAllReduce [source | sink] kAllReduce
    000: kCommandBuffer [source       | sink        ]
        010: kCustomKernel [source | sink] loop_add_fusion
    011: kAsyncDone     [source       | sink        ] async_id=9
"""


def _verified() -> hlo_check.Verified:
  return hlo_check.Verified(parse.HloCollective("all-reduce", ((0, 1),), "all-reduce-start"), "float32", 10, (5,))


# ---------------------------------------------------------------------------------- the reader and the check

def test_the_thunk_reader_places_collectives_and_loops_by_nesting():
  inside = thunks.placement(ALL_INSIDE)
  assert inside.facts() == {"command_buffers": 1, "collectives": 2, "collectives_inside": 2, "loops": 1,
                            "loops_inside": 1}
  outside = thunks.placement(FUSIONS_ONLY)
  assert outside.facts() == {"command_buffers": 3, "collectives": 2, "collectives_inside": 0, "loops": 1,
                             "loops_inside": 0}
  assert outside.outside[0].startswith("005: kAllReduce")


def test_the_check_fails_when_command_buffers_were_asked_and_the_collective_is_outside():
  ok = hlo_check.verify_command_buffer(_verified(), ALL_INSIDE, on=True, loop=True)
  assert ok.command_buffer["collectives_inside"] == 2 and ok.facts()["command_buffer"]["asked"] == "yes"
  with pytest.raises(hlo_check.HloMismatch, match="launches 2 of 2 collective thunks and 1 of 1 loops outside"):
    hlo_check.verify_command_buffer(_verified(), FUSIONS_ONLY, on=True, loop=True)
  with pytest.raises(hlo_check.HloMismatch, match="--command_buffer=no, but XLA:GPU formed 1 command buffer"):
    hlo_check.verify_command_buffer(_verified(), ALL_INSIDE, on=False, loop=True)
  with pytest.raises(hlo_check.HloMismatch, match="dumped no thunk sequence"):
    hlo_check.verify_command_buffer(_verified(), None, on=True, loop=True)
  no_loop = ALL_INSIDE.replace("kWhile", "kSequential")  # a timed program whose loop did not survive
  with pytest.raises(hlo_check.HloMismatch, match="no while loop"):
    hlo_check.verify_command_buffer(_verified(), no_loop, on=True, loop=True)


def test_both_arms_are_pinned_and_only_gpus_take_them():
  yes, no = command_buffer.Arm(on=True).options(), command_buffer.Arm(on=False).options()
  assert {"COLLECTIVES", "WHILE", "CONDITIONAL", "FUSION"} <= set(yes["xla_gpu_enable_command_buffer"].split(","))
  assert yes["xla_gpu_graph_min_graph_size"] == 1 and no == {"xla_gpu_enable_command_buffer": ""}
  assert command_buffer.main_arm("yes", "cpu") is None and command_buffer.main_arm("no", "gpu").check is False
  assert command_buffer.main_arm("both", "gpu") == command_buffer.Arm(on=False, check=True)
  assert command_buffer.refusal("no", "cpu") is None and command_buffer.refusal("yes", "gpu") is None
  assert "--target" in command_buffer.refusal("both", "cpu")


def test_the_console_column_appears_only_with_both():
  rec = {"status": "ok", "bytes": 1024, "count": 256, "dtype": "float32", "scope": "scale_up", "group_size": 8,
         "num_groups": 1, "time_us": 20.0, "algbw_gbps": 0.05, "busbw_gbps": 0.09, "wrong": 0}
  plain, header = table.format_row(rec), table.header()
  assert "cmdbuf" not in " ".join(header) and header == [table.HEADER, table.UNITS]
  row = table.format_row({**rec, "time_us_command_buffer": 8.5})
  names, _ = table.header(command_buffer=True)
  assert row.index("8.50") + len("8.50") == names.index("cmdbuf(us)") + len("cmdbuf(us)")  # right-aligned under it
  assert len(row) == len(plain) + 11
  assert "WRONG WITH COMMAND BUFFERS" in table.format_row({**rec, "time_us_command_buffer": 8.5,
                                                           "timed_wrong_command_buffer": 1})


# -------------------------------------------------------------------------- --command_buffer=both on the sweep

TOPOLOGY = Topology(racks=2, nodes=2, gpus=2)
PLANS = {p.name: p for p in plan_scopes(TOPOLOGY, SCOPES)}


def _cpu_arms(monkeypatch):
  """The sweep's both-arms path on CPU devices: XLA:CPU takes the GPU options and ignores them (it has no command
  buffers, so there is no thunk sequence to read): what is tested is the second arm's compile, check and time."""
  monkeypatch.setattr(command_buffer, "main_arm", lambda setting, platform: command_buffer.Arm(on=False, check=False))
  monkeypatch.setattr(command_buffer, "SECOND_ARM", command_buffer.Arm(on=True, check=False))


def _cfg(**kw) -> sweep.SweepConfig:
  base = dict(collectives=("all_reduce",), scopes=("scale_up",), dtypes=("float32",), min_bytes=1, max_bytes=1,
              step_factor=2.0, iters=10, warmup=1, samples=3, check=True, command_buffer="both")
  return sweep.SweepConfig(**{**base, **kw})


# ppermute over 8 repeats its output every 8 repetitions, and the second arm's 2 untimed calls of 2 + 8 shift
# its chain by 20: a miscounted chain would be caught.
@pytest.mark.parametrize("name,scope,iters", [("all_reduce", "scale_up", 10), ("ppermute", "global", 8),
                                              ("all_reduce", "scale_up", 1)])
def test_both_times_and_checks_a_second_arm(monkeypatch, name, scope, iters):
  _cpu_arms(monkeypatch)
  mesh = build_mesh(TOPOLOGY, ordered_devices())
  rec = sweep.run_point(_cfg(iters=iters), mesh, PLANS[scope], collectives.get(name), "float32", 4096,
                        lambda: None, expected_op_s=1e-4)
  assert rec["status"] == "ok", rec.get("reason")
  assert rec["time_us_command_buffer"] > 0 and rec["time_us"] > 0 and rec["wrong"] == 0
  assert rec["busbw_gbps_command_buffer"] > 0 and rec["command_buffer"] == "both"
  if iters == 1:
    assert rec["wrong_command_buffer"] == 0
  else:
    assert rec["timed_wrong_command_buffer"] == 0 and rec["timed_wrong"] == 0
    assert "repetitions" in rec["timed_check_command_buffer"]
  assert f"{rec['time_us_command_buffer']:.2f}" in table.format_row(rec)


def test_a_wrong_second_arm_fails_the_point(monkeypatch):
  """Mutation: the second arm's timed programs leave a wrong carry; its timed check must count it, and the
  record's timed_wrong (what fails the run) must include it."""
  _cpu_arms(monkeypatch)
  real = program.check_timed
  calls = []

  def second_wrong(point, carry, reps, digested=None):
    calls.append(reps)
    if len(calls) == 2:  # the second arm's chain: corrupt its final carry's data slot
      carry = (carry[0] + 1, *carry[1:])
    return real(point, carry, reps, digested)
  monkeypatch.setattr(program, "check_timed", second_wrong)
  mesh = build_mesh(TOPOLOGY, ordered_devices())
  rec = sweep.run_point(_cfg(), mesh, PLANS["scale_up"], collectives.get("all_reduce"), "float32", 4096,
                        lambda: None, expected_op_s=1e-4)
  assert len(calls) == 2 and rec["timed_wrong_command_buffer"] > 0 and rec["timed_wrong"] > 0


# ------------------------------------------------------------------------------------------------- the CLI

def test_a_bad_value_is_one_line():
  r = run_cli(["--command_buffer=maybe"], timeout=120)
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      "microbench: error: flag --command_buffer=maybe: value should be one of <no|yes|both>"]


def test_a_cpu_run_refuses_command_buffers_in_one_line(tmp_path):
  r = run_cli(["--command_buffer=both", "--collectives=all_reduce", "--scopes=scale_up", "--max_bytes=1K",
               f"--outdir={tmp_path / 'run'}"], timeout=120)
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip().splitlines() == [
      "microbench: error: --command_buffer=both: command buffers (CUDA graphs) are XLA:GPU's, and this run's"
      " devices are cpu; drop the flag, or add --target=KIND to compile for a GPU kind and check them"]
  assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------- compiled for H100s, read from XLA's dump

@pytest.fixture(scope="module")
def h100():
  if not gpu_compile.plugin_available():
    pytest.skip("JAX's CUDA PJRT plugin is not installed: pip install -e '.[gpu-compile]'")
  topology = Topology(1, 2, 8)
  target = gpu_compile.make_target("h100", 2, 8)
  return topology, build_mesh(topology, list(target.devices)), {p.name: p for p in plan_scopes(topology, SCOPES)}


def _dumped(mesh, plan, arm: command_buffer.Arm, folder: str) -> str:
  """The timed all-reduce loop (10 operations) compiled with the arm's options and XLA's own dump into `folder`
  (XLA_FLAGS' --xla_dump_to, per compile); its final thunk sequence as XLA wrote it."""
  coll = collectives.get("all_reduce")
  counts = program.carry_counts(coll, 4096, 4096, "bfloat16", "gpu")
  specs = [program._spec(mesh, c, program.DTYPES["bfloat16"]) for c in counts]  # pylint: disable=protected-access
  specs.append(program._spec(mesh, 1, jax.numpy.uint32))  # pylint: disable=protected-access

  def per_device(*carry):
    return program.repeat(lambda c: (*coll.step(c[:-1], plan.axes, plan.group_size, "gpu")[0], c[-1]), 10, carry)
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(jax.P(AXES) for _ in specs),
                     out_specs=tuple(jax.P(AXES) for _ in specs), check_vma=False)
  jax.jit(fn, donate_argnums=tuple(range(len(specs)))).lower(*specs).compile(
      compiler_options={**arm.options(), "xla_dump_to": folder})
  after = glob.glob(os.path.join(folder, "*.thunk_sequence_after_thunk_passes.txt"))
  return open((after or glob.glob(os.path.join(folder, "*.thunk_sequence.txt")))[0], encoding="utf-8").read()


def _depth(line: str) -> int:
  return len(line) - len(line.lstrip())


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_with_the_flag_the_collective_and_the_loop_run_inside_a_command_buffer(h100, tmp_path):
  _, mesh, plans = h100
  text = _dumped(mesh, plans["scale_up"], command_buffer.Arm(on=True), str(tmp_path / "yes"))
  lines = [l for l in text.splitlines() if re.match(r"\s*\d+: k", l)]
  assert re.match(r"000: kCommandBuffer", lines[0]) and all(_depth(l) > 0 for l in lines[1:]), text
  assert [l for l in lines if "kAllReduce" in l] and [l for l in lines if "kWhile" in l]
  hlo_check.verify_command_buffer(_verified(), text, on=True, loop=True)
  # The sweep's own programs, through the builder: all three, the timed loop included.
  point = program.build_check(collectives.get("all_reduce"), mesh, plans["scale_out"], 4096, "bfloat16",
                              command_buffer=command_buffer.Arm(on=True))
  long = program.build_timed(collectives.get("all_reduce"), mesh, plans["scale_out"], 4096, "bfloat16", 10,
                             command_buffer=command_buffer.Arm(on=True))
  for facts in (point.check_prog.verified.command_buffer, long.verified.command_buffer):
    assert facts["asked"] == "yes" and facts["collectives"] == facts["collectives_inside"] > 0
  assert long.verified.command_buffer["loops"] == long.verified.command_buffer["loops_inside"] == 1


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_without_the_flag_nothing_is_in_one_and_the_check_fails_when_yes_is_expected(h100, tmp_path):
  _, mesh, plans = h100
  text = _dumped(mesh, plans["scale_up"], command_buffer.Arm(on=False), str(tmp_path / "no"))
  assert "kCommandBuffer" not in text and "kAllReduce" in text and "kWhile" in text
  assert hlo_check.verify_command_buffer(_verified(), text, on=False, loop=True).command_buffer["command_buffers"] == 0
  with pytest.raises(hlo_check.HloMismatch, match="outside any command buffer"):  # the mutation
    hlo_check.verify_command_buffer(_verified(), text, on=True, loop=True)


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_a_description_without_cuda_versions_keeps_collectives_out_and_fails_the_point(monkeypatch):
  """What XLA does on a driver or runtime older than 12.3 (and did on every deviceless compile before the
  target description carried the plugin's CUDA version): the point asked with command buffers is an error."""
  monkeypatch.setattr(gpu_compile, "plugin_cuda_version", lambda: None)
  topology = Topology(1, 1, 8)
  mesh = build_mesh(topology, list(gpu_compile.make_target("h100", 1, 8).devices))
  plan = plan_scopes(topology, ["scale_up"])[0]
  cfg = _cfg(command_buffer="yes", target="h100")
  rec = sweep.run_point(cfg, mesh, plan, collectives.get("all_reduce"), "bfloat16", 4096, lambda: None)
  assert rec["status"] == "error" and "outside any command buffer" in rec["reason"], rec
  assert gpu_compile.with_cuda_versions("gpu_device_info {\n}", None) == "gpu_device_info {\n}"


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_a_target_sweep_with_both_compiles_and_checks_both_arms(tmp_path):
  out = tmp_path / "run"
  r = run_cli(["--target=h100", "--topology=nodes:1,gpus:8", "--collectives=all_reduce,ppermute",
               "--scopes=scale_up", "--min_bytes=1K", "--max_bytes=1K", "--command_buffer=both", f"--outdir={out}"])
  assert r.returncode == 0, r.stderr
  recs = [json.loads(l) for l in open(out / "results.jsonl", encoding="utf-8")]
  assert len(recs) == 2
  for rec in recs:
    assert rec["status"] == "compiled" and rec["command_buffer"] == "both"
    progs = rec["programs"]
    for name in ("check", "short", "long"):
      assert progs[name]["command_buffer"]["asked"] == "no" and progs[name]["command_buffer"]["command_buffers"] == 0
    for name in ("short_command_buffer", "long_command_buffer"):
      cb = progs[name]["command_buffer"]
      assert cb["asked"] == "yes" and cb["collectives"] == cb["collectives_inside"] > 0
    assert progs["long_command_buffer"]["command_buffer"]["loops_inside"] == 1
  assert r.stdout.count("in command buffers: 4/4 collective thunks, 1/1 loops") == 2
  meta = json.loads((out / "meta.json").read_text())
  assert meta["target"]["cuda_version"] == gpu_compile.plugin_cuda_version()
  assert meta["flags"]["command_buffer"] == "both"


@pytest.mark.slow
@pytest.mark.gpu_compile
@needs_plugin
def test_a_users_own_xla_dump_still_gets_the_programs(h100, tmp_path, monkeypatch):
  """The per-compile xla_dump_to outranks XLA_FLAGS: the program's dump is copied where the user asked."""
  _, mesh, plans = h100
  monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to={tmp_path / 'mine'}")
  program.build_check(collectives.get("all_gather"), mesh, plans["scale_up"], 4096, "bfloat16",
                      command_buffer=command_buffer.Arm(on=True))
  assert glob.glob(str(tmp_path / "mine" / "*.thunk_sequence_after_thunk_passes.txt"))
