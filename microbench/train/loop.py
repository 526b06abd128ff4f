"""End-to-end training throughput of a Flax model: the run loop and its reports.

`run` compiles the step ahead of time (compile time, memory and the communication fingerprint come from
the compiled program), runs it, and writes one JSONL file (config, a line per step, summary),
TensorBoard scalars and text, and optionally a profiler trace. Only process 0 writes. `compile_only`
stops after the compile and reports what the program would need.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import time
from typing import Any

import jax
import numpy as np

from microbench.meshes import parallelism as par
from microbench.cluster import environment, machine
from microbench.output import run_folder
from microbench.output.train_log import RESOLVED_FLAGS, TrainLog, markdown_table
from microbench.fabric import gpu_kinds, tpu_kinds
from microbench.aot import gpu_compile
from microbench.hlo import schedule_diff
from microbench.train import comm_fingerprint, dispatch, flops_peaks, overheads, xla_table_effect
from microbench.train.config import DTYPES, Plan, TrainConfig, check_shardable, plan
from microbench.models import moe, pipeline, pipeline_schedule
from microbench.models.optimizer import AdamWConfig, adamw
from microbench.models.train_step import Trainer




def _mib(b: float) -> str:
  return f"{b / 2**20:.1f} MiB"


def _comm_text(comm: dict[str, Any] | None) -> str:
  return ", ".join(f"{op} x{c['count']} {c['bytes'] / 2**20:.2f} MiB"
                   f" ({'/'.join(c.get('dtypes', {}))})" for op, c in (comm or {}).items()) or "none"


def format_table(summary: dict[str, Any]) -> str:
  """The stdout summary: one `name  value` row per figure."""
  s = summary
  rows = _run_rows(s) + _program_rows(s) + _strategy_rows(s) + _comm_rows(s)
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _run_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
  """What ran and how fast: model, layout, shapes; for a run, its step time, throughput and MFU."""
  item = s["item"]
  rows = [
      ("model", f"{s['model']}-{s['size']} ({s['layers']} layers, {s['params'] / 1e6:.2f}M params)"),
      ("parallelism", f"{s['parallelism']}  mesh {s['mesh']}"),
      ("placement", "; ".join(f"{a}={w}" for a, w in s["placement"].items()) or "one device"),
      ("batch / seq / dtype", f"{s['batch']} / {s['seq_len']} / {s['dtype']}"
       + (f", {s['grad_accum']} microbatches" if s.get("grad_accum", 1) > 1 else "")),
      ("layers run as", f"{'scan' if s['scan_layers'] else 'unrolled'}, remat {s['remat']},"
       f" attention {s['attention']} ({s['attention_note']})"),
  ]
  if s["kind"] == "summary":
    rows += [
        ("median step time", f"{s['median_step_time_s'] * 1e3:.2f} ms over {s['timed_steps']} steps"),
        (f"{item}/s", f"{s[f'{item}_per_s']:.1f} global, {s[f'{item}_per_s_per_device']:.1f} per device"),
    ]
  rows.append(("model FLOPs / step", f"{s['flops_per_step']:.4g} [{s['flops_formula']}]"))
  if s["kind"] == "summary":
    mfu = "n/a (no peak for this device)" if s["mfu"] is None else \
        (f"{100 * s['mfu']:.2f} % (causal attention counted half; {100 * s['mfu_full_attention']:.2f} %"
         " counting it in full)")
    peak = "none" if s["peak_tflops_per_device"] is None else f"{s['peak_tflops_per_device']:.4f}"
    rows += [
        ("TFLOP/s per device", f"{s['tflops_per_device']:.4f}"),
        ("peak TFLOP/s / device", f"{peak}  [{s['peak_source']}]"),
        ("MFU", mfu),
    ]
  return rows


def _program_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
  """What the compiled program needs: memory per device and whether it fits, attention as compiled, compile time."""
  rows = []
  m = s["memory"]
  if s.get("compile_refused"):
    rows.append(("memory per device", f"at least {_mib(s['memory_per_device_bytes'])}, as XLA:TPU's refusal says"
                                      f" ({_mib(s['xla_available_bytes'])} available): {s['compile_refused']}"))
  else:
    rows.append(("memory per device", f"{_mib(s['memory_per_device_bytes'])} (args {_mib(m['argument_bytes'])},"
                                      f" temp {_mib(m['temp_bytes'])}, out {_mib(m['output_bytes'])},"
                                      f" aliased {_mib(m['alias_bytes'])})"))
  if s["kind"] != "summary" and s.get("step_time_at_full_mfu_s") is not None:
    rows.append(("step at 100% MFU", f"{s['step_time_at_full_mfu_s'] * 1e3:.3g} ms at {s['peak_tflops_per_device']:g}"
                                     f" TFLOP/s per device [{s['peak_source']}]"))
  if s.get("usable_bytes"):  # a compile target: against what JAX gets of the device
    rows.append(("fits", f"{'yes' if s['fits'] else 'NO'}: {_mib(s['memory_per_device_bytes'])} of"
                         f" {_mib(s['usable_bytes'])} usable ({s['mem_fraction']:.0%} of"
                         f" {_mib(s['device_memory_bytes'])}),"
                         f" margin {_mib(s['margin_bytes'])}"
                         + ("" if s["fits"] or not s["fits_whole_device"] else "; fits the whole device")))
  elif s.get("device_memory_bytes"):
    rows.append(("fits", f"{'yes' if s['fits'] else 'NO'}: {_mib(s['memory_per_device_bytes'])} of"
                         f" {_mib(s['device_memory_bytes'])} per device"))
  if s.get("attention_compiled"):
    rows.append(("attention compiled", ", ".join(f"{k} x{v}" for k, v in s["attention_compiled"].items())))
  rows.append(("compile time", f"{s['compile_time_s']:.2f} s"))
  if s.get("compile_note"):
    rows.append(("  note", s["compile_note"]))
  return rows


def _strategy_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
  """How the pipeline, the experts and context parallelism ran, with their measured overheads."""
  rows = []
  if s.get("pipeline_schedule"):
    text = (f"{s['pipeline_schedule']}, {s['pipeline_stages']} stages x {s['microbatches']} microbatches"
            + (f" x {s['virtual_stages']} virtual stages" if s["virtual_stages"] > 1 else "")
            + f", {s['stash_slots']} stage inputs stashed; bubble theory {s['bubble_theory']:.3f}")
    if s.get("bubble_measured") is not None:
      text += (f", measured {_share_text(s, 'bubble_measured')}; {s['overhead_step_time_s'] * 1e3:.2f} ms"
               f" forward+backward, {s['step_time_no_bubble_s'] * 1e3:.2f} ms without the bubble (medians)")
    rows.append(("pipeline", text))
  if s.get("moe_dispatch"):
    text = f"top-{s['moe_top_k']} of {s['moe_experts']} experts, {s['moe_dispatch']} dispatch"
    if s.get("moe_dropped_fraction") is not None:
      text += f", {100 * s['moe_dropped_fraction']:.2f} % of assignments dropped"
    if s.get("all_to_all_share") is not None:
      text += (f"; all-to-all share {_share_text(s, 'all_to_all_share')};"
               f" {s['step_time_no_all_to_all_s'] * 1e3:.2f} ms without the exchanges (median)")
    rows.append(("experts", text))
    if s.get("moe_dispatch_time_s") is not None:
      rows.append(("  dispatch", f"{s['moe_dispatch_time_s'] * 1e6:.1f} us per ragged all-to-all of"
                                 f" {s['moe_dispatch_bytes'] / 2**20:.3f} MiB per device"
                                 f" ({s['moe_dispatch_busbw_gbps']:.3g} GB/s busbw, factor"
                                 f" {s['moe_dispatch_busbw_factor']:.3g}), the router's sizes; {s['moe_dispatch_op']}"))
    elif s.get("moe_dispatch_note"):
      rows.append(("  dispatch", s["moe_dispatch_note"]))
  if s.get("context_impl"):
    rows.append(("context", f"{s['context_impl']} attention over {s['context_degree']} devices"))
  return rows


def _comm_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
  """The final loss of a run, and what the step communicates: per step, per loop iteration, over DCN, as compiled."""
  rows = []
  if s["kind"] == "summary":
    rows.append(("final loss / grad norm", f"{s['final_loss']:.4f} / {s['final_grad_norm']:.4f}"))
  rows.append(("comm / step / device", _comm_text(s["comm"])))
  for loop in s.get("comm_loops") or ():
    runs = max(loop.get("times", 1), 1)  # a loop nested in another runs once per outer iteration
    if loop["trip_count"] is None:
      trips = "unknown trip count, counted once per run" + (f" (x{runs} runs)" if runs > 1 else "")
    else:
      trips = f"x{loop['trip_count'] * runs}" + (f" ({loop['trip_count']} x {runs} runs, nested)" if runs > 1 else "")
    rows.append(("  in a loop", f"{trips} per step: {_comm_text(loop['ops'])} per iteration"))
  if s.get("comm_dcn"):
    rows.append(("  over DCN", f"{_comm_text(s['comm_dcn'])} (Megascale transfers across slices; the rest is ICI)"))
  for op, forms in (s.get("comm_forms") or {}).items():
    for form, count in forms.items():
      if form != comm_fingerprint.DCN:
        rows.append(("  as compiled", f"{count} of the {op} x{s['comm'][op]['count']} as {form}"))
  if s.get("comm_note"):
    rows.append(("  note", s["comm_note"]))
  return rows


def target_memory(name: str) -> tuple[int, float | None]:
  """A --target's memory per device and the share of it a JAX process gets (None: the GPU default, from the
  environment, see gpu_compile.mem_fraction). JAX on a TPU preallocates no fraction: XLA:TPU's allocator has
  the chip's whole HBM (and the compiler refuses a program above it), so a TPU target's share is all of it."""
  if machine.is_tpu_target(name):
    return tpu_kinds.target(name).memory_bytes, gpu_compile.TPU_MEM_FRACTION
  return gpu_kinds.target(name).memory_bytes, None


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# XLA:TPU refuses to compile a program larger than the chip's HBM, in one of these words (its sizes in GiB, "G").
_HBM_REFUSALS = (
    re.compile(r"memory required for (?P<what>[\w ]+?) \((?P<need>[\d.]+)(?P<nu>[KMGT]?)i?B?\) exceeds available"
               r" HBM \((?P<have>[\d.]+)(?P<hu>[KMGT]?)i?B?\)"),
    re.compile(r"Ran out of memory in memory space hbm\. Used (?P<need>[\d.]+)(?P<nu>[KMGT]?)i?B? of"
               r" (?P<have>[\d.]+)(?P<hu>[KMGT]?)i?B? hbm"),
)


def hbm_refusal(message: str) -> dict[str, Any] | None:
  """XLA:TPU's compile-time out-of-memory verdict, None when `message` is something else: what it needed (at
  least: its figure may count temporaries only) and what the chip had, in bytes, and its own words."""
  if "RESOURCE_EXHAUSTED" not in message:
    return None
  for pattern in _HBM_REFUSALS:
    m = pattern.search(message)
    if m:
      line = next((l for l in message.splitlines() if m.group(0) in l), m.group(0)).strip()
      return {"required_bytes": int(float(m.group("need")) * _UNITS[m.group("nu")]),
              "available_bytes": int(float(m.group("have")) * _UNITS[m.group("hu")]),
              "message": line[line.find("RESOURCE_EXHAUSTED"):] if "RESOURCE_EXHAUSTED" in line else line}
  return None


def _target_peak(cfg: TrainConfig, device: jax.Device, flops: float, n: int) -> dict[str, Any]:
  """A compile target's spec-sheet peak and the step time at 100% MFU it implies (what a run's MFU divides);
  nothing for the devices present, whose peak a run measures or looks up (flops_peaks.device_peak)."""
  peak = flops_peaks.table_peak(device.device_kind, cfg.dtype) if cfg.target else None
  if peak is None:
    return {}
  return {"peak_tflops_per_device": peak.tflops, "peak_source": peak.source,
          "step_time_at_full_mfu_s": flops / (n * peak.tflops * 1e12)}


def default_run_dir(cfg: TrainConfig) -> str:
  name = f"{cfg.model}-{cfg.size or 'default'}_{(cfg.parallelism or 'dp').replace(':', '').replace(',', '-')}"
  return os.path.join("runs", "train", run_folder.default_name(name))


@dataclasses.dataclass
class Result:
  losses: list[float]
  step_times: list[float]
  summary: dict[str, Any]
  run_dir: str | None
  trainer: Trainer
  state: Any


def attention_compiled(hlo_text: str) -> dict[str, int]:
  """cuDNN fused-attention custom calls in the compiled program, by target (`__cudnn$fmhaSoftmax`, its
  backward ...): what ran as attention, as compiled, not what was asked for ({} where XLA's own ops run it)."""
  out: dict[str, int] = {}
  for name in re.findall(r'custom_call_target="(__cudnn\$fmha[\w$]*)"', hlo_text):
    out[name] = out.get(name, 0) + 1
  return dict(sorted(out.items()))


def _hlo_flops(compiled, loops: list[dict[str, Any]]) -> float | None:
  """XLA's FLOP count of the compiled program, or None where it would mislead: XLA's cost analysis counts
  a while-loop body once, so with scanned layers (or microbatches) it undercounts by the trip count."""
  if any((lp["trip_count"] or 1) > 1 for lp in loops):
    return None
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])
  except Exception:  # pylint: disable=broad-except
    return None


def _scalar(x: jax.Array) -> float:
  return float(np.asarray(x.addressable_data(0)))


def _dispatch(spec, device: jax.Device) -> str | None:
  """The MoE token exchange that runs on this platform (None: no experts)."""
  cfg = getattr(spec.config, "moe", None)
  return None if cfg is None else moe.dispatch_for(device.platform, cfg.dispatch)


def _strategy_fields(p: Plan, spec, device: jax.Device) -> dict[str, Any]:
  """What the pipeline, the experts and context parallelism are set to (None where not used)."""
  out: dict[str, Any] = {"pipeline_schedule": None, "moe_dispatch": _dispatch(spec, device),
                         "context_impl": None}
  if p.stages > 1:
    s, m, v = p.stages, p.microbatches, p.cfg.virtual_stages
    sched = pipeline.schedule(p.schedule, s, m, v)
    out.update(pipeline_schedule=p.schedule, pipeline_stages=s, microbatches=m, virtual_stages=v,
               stash_slots=sched.x_slots, bubble_theory=pipeline_schedule.theory_bubble(p.schedule, s, m, v),
               bubble_lockstep=sched.bubble(backward_cost=3.0))
  if out["moe_dispatch"]:
    out.update(moe_experts=spec.config.moe.num_experts, moe_top_k=spec.config.moe.top_k,
               capacity_factor=spec.config.moe.capacity_factor, expert_degree=p.parallelism.degree("ep"))
  if p.parallelism.degree("cp") > 1:
    out.update(context_impl=p.cfg.context_impl, context_degree=p.parallelism.degree("cp"))
  return out


def _measure_overheads(cfg: TrainConfig, p: Plan, trainer: Trainer, state, batch, say) -> dict[str, Any]:
  """pp: the bubble; ep with a mixture of experts: the all-to-all share. Each is the forward+backward
  (no optimizer update, nothing donated) timed alternately with and without the overhead
  (`microbench.train.overheads`). Two more compiles per overhead; after the timed steps, so they are never
  charged to the step time."""
  arms = []
  if p.stages > 1:
    arms.append("bubble")
  if _dispatch(p.spec, p.mesh.devices.flat[0]) and p.parallelism.degree("ep") > 1:
    arms.append("all_to_all")
  if not arms:
    return {}
  params, rest = state

  def runner(without):
    t = trainer if without is None else Trainer(p.spec, p.mesh, trainer.dtype, trainer.tx, cfg.batch, cfg.seed,
                                                execution=p.execution(without), grad_accum=cfg.grad_accum)
    with t.context():
      fn = t.grads_fn().lower(params, rest, batch).compile(cfg.compiler_options)
    return lambda: jax.block_until_ready(fn(params, rest, batch))

  say(f"  timing the step without {' and without '.join(a.replace('_', '-') for a in arms)}")
  rounds = max(overheads.MIN_ROUNDS, cfg.steps - cfg.warmup_steps)
  times = overheads.alternate({name: runner(name) for name in (None, *arms)}, rounds)
  full = times[None]
  out: dict[str, Any] = {"overhead_step_time_s": statistics.median(full), "overhead_rounds": rounds}
  for arm, figure, resolved, without in (("bubble", "bubble_measured", "bubble_resolved", "step_time_no_bubble_s"),
                                         ("all_to_all", "all_to_all_share", "all_to_all_resolved",
                                          "step_time_no_all_to_all_s")):
    if arm in arms:
      fig = overheads.paired_share(full, times[arm])
      out.update({figure: fig.value, f"{figure}_ci": None if fig.low is None else [fig.low, fig.high],
                  resolved: fig.resolved, without: statistics.median(times[arm])})
  return out


def _measure_dispatch(cfg: TrainConfig, p: Plan, expert_counts: np.ndarray, layers: int, say) -> dict[str, Any]:
  """ep with a mixture of experts: one token dispatch alone, a ragged all-to-all over `expert` with the sizes
  the router chose in the last timed step (microbench.train.dispatch), timed and checked."""
  ep = p.parallelism.degree("ep")
  if ep < 2:
    return {}
  dispatches = layers * cfg.grad_accum * p.microbatches  # MoE calls per device per step
  sizes = dispatch.sizes_from_counts(expert_counts, ep, dispatches, p.parallelism.batch_shards)
  say(f"  timing one token dispatch alone: {sizes.sent} rows per device, to ranks {sizes.rows[0].tolist()}")
  rounds = max(overheads.MIN_ROUNDS, cfg.steps - cfg.warmup_steps)
  return dispatch.measure(p.mesh, moe.EXPERT, sizes, p.spec.config.block.d_model, DTYPES[cfg.dtype], rounds)


def _share_text(s: dict[str, Any], figure: str) -> str:
  """A measured share as the summary prints it: the figure with its interval, or "not resolved"."""
  ci = s.get(f"{figure}_ci")
  return overheads.Share(s[figure], *(ci or (None, None)), s["overhead_rounds"]).text()


@dataclasses.dataclass
class _Compiled:
  """The compiled step (None where XLA:TPU refused it) and the figures of the compile (`common`: the fields
  the compile record and the summary share)."""
  step: Any
  common: dict[str, Any]


@dataclasses.dataclass
class _Steps:
  """What the step loop measured, per step, and what it left: the state after the last step and the next
  batch (the overhead timings run on both)."""
  losses: list[float]
  norms: list[float]
  times: list[float]
  dropped: list[float]
  assigned: list[float]
  expert_counts: np.ndarray | None  # the last timed step's assignments per expert (the dispatch's sizes)
  state: tuple
  batch: Any


def run(cfg: TrainConfig, p: Plan | None = None) -> Result:
  """Trains `cfg.steps` steps (+ `cfg.profile_steps` traced ones) and reports; returns the figures.

  With `cfg.compile_only`, compiles the step for the mesh and reports memory per device, model FLOPs and
  the communication fingerprint without creating parameters or running anything (MaxText's
  train_compile): whether a shape fits is known before a cluster is booked.
  """
  p = p or plan(cfg)
  cfg, spec, mesh = p.cfg, p.spec, p.mesh
  writer_on = cfg.write and jax.process_index() == 0
  say = print if (cfg.verbose and jax.process_index() == 0) else (lambda *a, **k: None)

  tx = adamw(AdamWConfig(learning_rate=cfg.learning_rate, clip_norm=cfg.clip_norm))
  trainer = Trainer(spec, mesh, DTYPES[cfg.dtype], tx, cfg.batch, cfg.seed, execution=p.execution(),
                    grad_accum=cfg.grad_accum)
  check_shardable(trainer, p)

  layers = getattr(spec.config, "num_layers", len(getattr(spec.config, "stage_blocks", ())))
  mesh_text = " ".join(f"{a}={mesh.shape[a]}" for a in p.axis_order if mesh.shape[a] > 1) or "1 device"
  config_record = _config_record(p, trainer, layers, mesh_text, writer_on)
  run_dir = (cfg.outdir or default_run_dir(cfg)) if writer_on else None
  out = TrainLog(run_dir)
  out.line(config_record)
  out.hparams(config_record)
  out.text("config", markdown_table({k: v for k, v in config_record.items() if k not in ("kind", "environment")}))
  _say_config(say, p, trainer, mesh_text, config_record["environment"] if writer_on else None, run_dir)

  compiled = _compile(p, trainer, layers, mesh_text)
  if cfg.compile_only or cfg.target:
    summary = {"kind": "compile", **compiled.common}
    out.line(summary)
    out.text("compile", markdown_table({k: v for k, v in summary.items() if k != "kind"}))
    out.close()
    say("compiled (not run):\n" + format_table(summary))
    return Result([], [], summary, run_dir, trainer, None)

  peak = flops_peaks.device_peak(mesh.devices.flat[0], cfg.dtype, len(jax.local_devices()))
  steps = _train_steps(p, trainer, compiled, peak, out, say, run_dir)
  summary = _summary(p, trainer, compiled.common, steps, peak, layers, run_dir, say)
  out.line(summary)
  out.summary(summary)
  # The text table gives a measured share with its interval, or says it is not resolved.
  shares = {k: _share_text(summary, k) for k in RESOLVED_FLAGS if summary.get(k) is not None}
  out.text("summary", markdown_table({k: shares.get(k, v) for k, v in summary.items() if k != "kind"}), cfg.steps)
  out.close()
  say("summary:\n" + format_table(summary))
  return Result(steps.losses[:cfg.steps], steps.times, summary, run_dir, trainer, steps.state)


def _config_record(p: Plan, trainer: Trainer, layers: int, mesh_text: str, writer_on: bool) -> dict[str, Any]:
  """The run's first record: the configuration as resolved (mesh, placement, rules, devices, environment)."""
  cfg, spec, mesh = p.cfg, p.spec, p.mesh
  device = mesh.devices.flat[0]
  hidden = ("write", "verbose", "compiler_options")
  return {
      "kind": "config", **{k: v for k, v in dataclasses.asdict(cfg).items() if k not in hidden},
      "size": spec.size, "layers": layers, "seq_len": spec.seq_len, "params": trainer.num_params,
      "mesh": mesh_text, "mesh_axes": list(p.axis_order), "mesh_shape": [mesh.shape[a] for a in p.axis_order],
      "placement_map": p.placement, "topology": str(p.topology), "topology_note": p.topology_note,
      "rules": {k: v for k, v in par.RULES if v}, "devices": mesh.size, "device_kind": device.device_kind,
      "attention_impl": p.attention, "attention_note": p.attention_note,
      "schedule": p.schedule, "microbatches": p.microbatches if p.stages > 1 else None,
      "virtual_stages": cfg.virtual_stages if p.stages > 1 else None,
      "context_impl": cfg.context_impl if p.parallelism.degree("cp") > 1 else None,
      "moe_dispatch_impl": _dispatch(spec, device),
      "processes": jax.process_count(), "jax_version": jax.__version__,
      "environment": environment.capture() if writer_on else None,
  }


def _say_config(say, p: Plan, trainer: Trainer, mesh_text: str, env: dict[str, Any] | None,
                run_dir: str | None) -> None:
  """The run's header on stdout: model, devices, environment (process 0 writing), mesh and placement."""
  say(f"microbench-train: {p.spec.family}-{p.spec.size}, {trainer.num_params / 1e6:.2f}M params, {p.mesh.size}"
      f" devices, {p.topology_note}")
  for line in environment.header(env) if env is not None else []:
    say(" " + line[1:])
  if p.cfg.preset_note:
    say(f"  preset {p.cfg.preset_note}")
  say(f"  mesh {mesh_text} (axes outer->inner {','.join(p.axis_order)})")
  for axis, where in p.placement.items():
    say(f"  {axis:7s} {where}")
  if run_dir:
    say(f"  run folder {run_dir}")


def _compile(p: Plan, trainer: Trainer, layers: int, mesh_text: str) -> _Compiled:
  """Compiles the step (for a --target: for that machine) and reads what the program needs: memory, whether
  it fits, FLOPs, the communication fingerprint. XLA:TPU refusing a program that does not fit is a figure."""
  cfg, spec, device, n = p.cfg, p.spec, p.mesh.devices.flat[0], p.mesh.size
  t0 = time.perf_counter()
  compile_note, refused = None, None
  options = xla_table_effect.options_with(cfg.compiler_options, cfg.xla_perf_table)
  try:
    if cfg.target:
      compiled, compile_note = gpu_compile.compile_for_target(trainer.compile_step, options)
    else:
      compiled = trainer.compile_step(cfg.compiler_options)
  except Exception as e:  # pylint: disable=broad-except
    refused = hbm_refusal(str(e)) if cfg.target and device.platform == "tpu" else None
    if refused is None:
      raise
    compiled = None
  compile_s = time.perf_counter() - t0
  memory = (gpu_compile.memory(compiled) if compiled is not None else None) or dict.fromkeys(
      ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes", "total_bytes"), 0)
  hlo_text = compiled.as_text() if compiled is not None else ""
  report = comm_fingerprint.comm_report(hlo_text, n)
  windows = schedule_diff.windows_by_op(hlo_text) if cfg.target and device.platform == "gpu" and hlo_text else None
  table = None
  if cfg.xla_perf_table and windows is not None:
    table = xla_table_effect.effect(trainer.compile_step, cfg.compiler_options, cfg.xla_perf_table,
                                    cfg.xla_perf_table_baseline, windows)
  comm, comm_loops = report["ops"], report["loops"]
  comm_note = None
  if device.platform == "cpu" and cfg.dtype == "bfloat16" and comm:
    comm_note = ("on CPU, XLA's float-normalization-bf16 pass widens bfloat16 collectives to float32; the"
                 " partitioned program gathers and reduces in bfloat16 (what a GPU runs)")
  if refused:
    comm_note = "none compiled: XLA:TPU refused the program (it does not fit)"
  per_device, memory_limit, fit = _fit(cfg, device, memory, refused)
  item = spec.item_name
  flops = spec.step_flops(cfg.batch)
  common = {
      "model": spec.family, "size": spec.size, "layers": layers, "params": trainer.num_params,
      "parallelism": str(p.parallelism), "mesh": mesh_text, "placement": p.placement, "topology": str(p.topology),
      "devices": n, "device_kind": device.device_kind, "batch": cfg.batch, "seq_len": spec.seq_len,
      "dtype": cfg.dtype, "grad_accum": cfg.grad_accum, "remat": cfg.remat, "scan_layers": cfg.scan_layers,
      "attention": p.attention, "attention_note": p.attention_note,
      "attention_compiled": attention_compiled(hlo_text), "item": item,
      f"{item}_per_step": spec.items_per_step(cfg.batch), "flops_per_step": flops,
      "flops_per_step_full_attention": spec.step_flops(cfg.batch, causal_half=False),
      "flops_formula": spec.flops_formula,
      "hlo_flops_per_device": _hlo_flops(compiled, comm_loops), "memory": memory,
      "memory_per_device_bytes": per_device, "device_memory_bytes": memory_limit, **fit,
      "target": cfg.target, **_target_peak(cfg, device, flops, n),
      "compile_time_s": compile_s, "compile_note": compile_note, "comm": comm, "comm_loops": comm_loops,
      "comm_note": comm_note, "comm_dcn": report["dcn"], "comm_forms": report["forms"],
      **_strategy_fields(p, spec, device), **({"xla_perf_table": table} if table else {}),
      **({"schedule_windows": windows} if windows is not None else {}),
  }
  return _Compiled(compiled, common)


def _fit(cfg: TrainConfig, device: jax.Device, memory: dict[str, int], refused: dict[str, Any] | None
         ) -> tuple[int, int | None, dict[str, Any]]:
  """Memory per device, the limit it is held against, and whether it fits (with the margin for a target)."""
  per_device = memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"] - memory["alias_bytes"]
  memory_limit, fraction = target_memory(cfg.target) if cfg.target else (machine.device_memory(device), None)
  # A GPU target's fit is against what JAX gets of the device (XLA_PYTHON_CLIENT_MEM_FRACTION, default 75%), a
  # TPU target's against all of it (TPU_MEM_FRACTION); a real device's limit is already the allocator's.
  if refused:  # XLA:TPU's own verdict, with what it says it needed (at least) and had
    per_device = refused["required_bytes"]
    fit = {**gpu_compile.fit(per_device, memory_limit, fraction), "fits": False,
           "xla_available_bytes": refused["available_bytes"], "compile_refused": refused["message"]}
  elif cfg.target:
    fit = gpu_compile.fit(per_device, memory_limit, fraction)
  else:
    fit = {"fits": None if memory_limit is None else per_device <= memory_limit}
  return per_device, memory_limit, fit


def _train_steps(p: Plan, trainer: Trainer, compiled: _Compiled, peak, out: TrainLog, say,
                 run_dir: str | None) -> _Steps:
  """Runs the timed steps, then the profiled ones (traced into the run folder), logging each."""
  cfg = p.cfg
  params, rest, opt_state = trainer.init_state()
  make_batch = trainer.batch_fn()
  batch = make_batch(0)
  jax.block_until_ready(batch)

  steps = _Steps([], [], [], [], [], None, (), None)
  total = cfg.steps + cfg.profile_steps
  for step in range(total):
    profiled = step >= cfg.steps
    if profiled and step == cfg.steps and run_dir:
      jax.profiler.start_trace(run_dir)
    t = time.perf_counter()
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      params, rest, opt_state, metrics = compiled.step(params, rest, opt_state, batch)
      loss_v = _scalar(metrics["loss"])  # waits for the step
    dt = time.perf_counter() - t
    norm_v = _scalar(metrics["grad_norm"])
    # The next batch, generated on the devices and waited for here, outside the timed region (dispatched
    # without the wait, the next step's time would include making it).
    batch = jax.block_until_ready(make_batch(step + 1))
    steps.losses.append(loss_v)
    steps.norms.append(norm_v)
    steps.times.append(dt)
    _log_step(cfg, step, metrics, steps, compiled.common, peak, out, say)
  if cfg.profile_steps and run_dir:
    jax.profiler.stop_trace()
  steps.state, steps.batch = (params, rest, opt_state), batch
  return steps


def _log_step(cfg: TrainConfig, step: int, metrics: dict[str, jax.Array], steps: _Steps, common: dict[str, Any],
              peak, out: TrainLog, say) -> None:
  """One step's record, TensorBoard scalars and stdout line (and the router's counts, with experts)."""
  loss_v, norm_v, dt = steps.losses[-1], steps.norms[-1], steps.times[-1]
  item = common["item"]
  tflops = common["flops_per_step"] / dt / common["devices"] / 1e12
  profiled = step >= cfg.steps
  record = {"kind": "step", "step": step, "loss": loss_v, "grad_norm": norm_v, "step_time_s": dt,
            "warmup": step < cfg.warmup_steps, "profiled": profiled}
  if "moe_dropped" in metrics:  # router counts, summed over layers and microbatches
    steps.dropped.append(_scalar(metrics["moe_dropped"]))
    steps.assigned.append(_scalar(metrics["moe_assignments"]))
    record["moe_dropped_fraction"] = steps.dropped[-1] / steps.assigned[-1]
    if step == cfg.steps - 1:
      steps.expert_counts = np.asarray(metrics["moe_expert_assignments"].addressable_data(0))
  out.line(record)
  # Warm-up steps (compilation, caches) are often far slower than the rest: their time goes under its own
  # tag and they add no throughput points, so they do not set the scale of the timed steps' charts.
  if step < cfg.warmup_steps:
    out.scalars({"train/loss": loss_v, "train/grad_norm": norm_v, "train/warmup_step_time_s": dt}, step)
  else:
    out.scalars({"train/loss": loss_v, "train/grad_norm": norm_v, "train/step_time_s": dt,
                 f"train/{item}_per_s": common[f"{item}_per_step"] / dt, "train/tflops_per_device": tflops,
                 "train/mfu": None if peak.tflops is None else tflops / peak.tflops}, step)
  say(f"  step {step:4d}  loss {loss_v:.4f}  grad norm {norm_v:.4f}  {dt * 1e3:9.2f} ms"
      f"{'  (warm-up)' if step < cfg.warmup_steps else ''}{'  (profiled)' if profiled else ''}")


def _summary(p: Plan, trainer: Trainer, common: dict[str, Any], steps: _Steps, peak, layers: int,
             run_dir: str | None, say) -> dict[str, Any]:
  """The run's last record: the timed steps' figures, and the overheads measured after them."""
  cfg, n = p.cfg, p.mesh.size
  item, items = common["item"], common[f"{common['item']}_per_step"]
  timed = steps.times[cfg.warmup_steps:cfg.steps]
  med = statistics.median(timed)
  state = steps.state[:2]
  measured = _measure_overheads(cfg, p, trainer, state, steps.batch, say) if cfg.measure_overheads else {}
  if cfg.measure_overheads and steps.expert_counts is not None:
    measured.update(_measure_dispatch(cfg, p, steps.expert_counts, layers, say))
  tflops = common["flops_per_step"] / med / n / 1e12
  tflops_full = common["flops_per_step_full_attention"] / med / n / 1e12
  dropped, assigned = steps.dropped[cfg.warmup_steps:cfg.steps], steps.assigned[cfg.warmup_steps:cfg.steps]
  return {
      "kind": "summary", **common, "steps": cfg.steps, "warmup_steps": cfg.warmup_steps, "timed_steps": len(timed),
      "median_step_time_s": med, "min_step_time_s": min(timed), "max_step_time_s": max(timed),
      f"{item}_per_s": items / med, f"{item}_per_s_per_device": items / med / n,
      "tflops_per_device": tflops, "tflops_per_device_full_attention": tflops_full,
      "peak_tflops_per_device": peak.tflops, "peak_source": peak.source, "peak_calibration": peak.calibration,
      "mfu": None if peak.tflops is None else tflops / peak.tflops,
      "mfu_full_attention": None if peak.tflops is None else tflops_full / peak.tflops,
      "final_loss": steps.losses[cfg.steps - 1], "final_grad_norm": steps.norms[cfg.steps - 1],
      "moe_dropped_fraction": sum(dropped) / sum(assigned) if steps.dropped else None,
      **measured,
      "profile_dir": os.path.join(run_dir, "plugins", "profile") if (run_dir and cfg.profile_steps) else None,
  }
