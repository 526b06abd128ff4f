"""End-to-end training throughput of a Flax model: the run loop and its reports.

`run` compiles the step ahead of time (compile time, memory and the communication fingerprint come from
the compiled program), runs it, and writes one JSONL file (config, a line per step, summary),
TensorBoard scalars and text, and optionally a profiler trace. Only process 0 writes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import time
from typing import Any

import jax
import numpy as np

from meshes import parallelism as par
from microbench.cluster import environment
from microbench.output.train_log import TrainLog
from microbench.train import comm_fingerprint, peaks
from microbench.train.config import DTYPES, Plan, TrainConfig, check_shardable, plan
from models.optimizer import AdamWConfig, adamw
from models.train_step import Trainer


def _markdown(d: dict[str, Any]) -> str:
  rows = [f"| {k} | {json.dumps(v) if isinstance(v, (dict, list)) else v} |" for k, v in d.items()]
  return "| key | value |\n|---|---|\n" + "\n".join(rows)


def format_table(summary: dict[str, Any]) -> str:
  """The stdout summary: one `name  value` row per figure."""
  s = summary
  item = s["item"]
  rows = [
      ("model", f"{s['model']}-{s['size']} ({s['layers']} layers, {s['params'] / 1e6:.2f}M params)"),
      ("parallelism", f"{s['parallelism']}  mesh {s['mesh']}"),
      ("placement", "; ".join(f"{a}={w}" for a, w in s["placement"].items()) or "one device"),
      ("batch / seq / dtype", f"{s['batch']} / {s['seq_len']} / {s['dtype']}"),
      ("median step time", f"{s['median_step_time_s'] * 1e3:.2f} ms over {s['timed_steps']} steps"),
      (f"{item}/s", f"{s[f'{item}_per_s']:.1f} global, {s[f'{item}_per_s_per_device']:.1f} per device"),
      ("model FLOPs / step", f"{s['flops_per_step']:.4g}  [{s['flops_formula']}]"),
      ("TFLOP/s per device", f"{s['tflops_per_device']:.4f}"),
      ("peak TFLOP/s / device", f"{s['peak_tflops_per_device']:.4f}  [{s['peak_source']}]"),
      ("MFU", f"{100 * s['mfu']:.2f} %"),
      ("memory per device", f"{s['memory_per_device_bytes'] / 2**20:.1f} MiB (args {s['memory']['argument_bytes'] / 2**20:.1f},"
       f" temp {s['memory']['temp_bytes'] / 2**20:.1f} MiB)"),
      ("compile time", f"{s['compile_time_s']:.2f} s"),
      ("final loss", f"{s['final_loss']:.4f}"),
  ]
  comm = s["comm"] or {}
  rows.append(("comm / step / device", ", ".join(f"{op} x{c['count']} {c['bytes'] / 2**20:.2f} MiB"
                                                  for op, c in comm.items()) or "none"))
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def default_run_dir(cfg: TrainConfig) -> str:
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
  name = f"{cfg.model}-{cfg.size or 'default'}_{(cfg.parallelism or 'dp').replace(':', '').replace(',', '-')}"
  return os.path.join("runs", "train", f"{name}_{stamp}")


@dataclasses.dataclass
class Result:
  losses: list[float]
  step_times: list[float]
  summary: dict[str, Any]
  run_dir: str | None
  trainer: Trainer
  state: Any


def _memory(compiled) -> dict[str, int]:
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    m = None
  if m is None:
    return {"argument_bytes": 0, "output_bytes": 0, "temp_bytes": 0, "alias_bytes": 0, "code_bytes": 0}
  return {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
          "temp_bytes": int(m.temp_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
          "code_bytes": int(m.generated_code_size_in_bytes)}


def _hlo_flops(compiled) -> float | None:
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])
  except Exception:  # pylint: disable=broad-except
    return None


def _scalar(x: jax.Array) -> float:
  return float(np.asarray(x.addressable_data(0)))


def run(cfg: TrainConfig, p: Plan | None = None) -> Result:
  """Trains `cfg.steps` steps (+ `cfg.profile_steps` traced ones) and reports; returns the figures."""
  p = p or plan(cfg)
  cfg, spec, mesh = p.cfg, p.spec, p.mesh
  n = mesh.size
  writer_on = cfg.write and jax.process_index() == 0
  say = print if (cfg.verbose and jax.process_index() == 0) else (lambda *a, **k: None)

  tx = adamw(AdamWConfig(learning_rate=cfg.learning_rate))
  trainer = Trainer(spec, mesh, DTYPES[cfg.dtype], tx, cfg.batch, cfg.seed)
  check_shardable(trainer, p)

  layers = getattr(spec.config, "num_layers", len(getattr(spec.config, "stage_blocks", ())))
  mesh_text = " ".join(f"{a}={mesh.shape[a]}" for a in p.axis_order if mesh.shape[a] > 1) or "1 device"
  hidden = ("write", "verbose", "compiler_options")
  config_record = {
      "kind": "config", **{k: v for k, v in dataclasses.asdict(cfg).items() if k not in hidden},
      "size": spec.size, "layers": layers, "seq_len": spec.seq_len, "params": trainer.num_params,
      "mesh": mesh_text, "mesh_axes": list(p.axis_order), "mesh_shape": [mesh.shape[a] for a in p.axis_order],
      "placement_map": p.placement, "topology": str(p.topology), "topology_note": p.topology_note,
      "rules": {k: v for k, v in par.RULES if v}, "devices": n, "device_kind": mesh.devices.flat[0].device_kind,
      "processes": jax.process_count(), "jax_version": jax.__version__,
      "environment": environment.capture() if writer_on else None,
  }
  run_dir = (cfg.outdir or default_run_dir(cfg)) if writer_on else None
  out = TrainLog(run_dir)
  out.line(config_record)
  out.hparams(config_record)
  out.text("config", _markdown({k: v for k, v in config_record.items() if k not in ("kind", "environment")}))
  say(f"microbench-train: {spec.family}-{spec.size}, {trainer.num_params / 1e6:.2f}M params, {n} devices,"
      f" {p.topology_note}")
  for line in environment.header(config_record["environment"]) if writer_on else []:
    say(" " + line[1:])
  say(f"  mesh {mesh_text} (axes outer->inner {','.join(p.axis_order)})")
  for axis, where in p.placement.items():
    say(f"  {axis:7s} {where}")
  if run_dir:
    say(f"  run folder {run_dir}")

  t0 = time.perf_counter()
  compiled = trainer.compile_step(cfg.compiler_options)
  compile_s = time.perf_counter() - t0
  memory = _memory(compiled)
  comm = comm_fingerprint.comm_fingerprint(compiled.as_text(), n)
  hlo_flops = _hlo_flops(compiled)
  params, rest, opt_state = trainer.init_state()
  make_batch = trainer.batch_fn()
  batch = make_batch(0)
  jax.block_until_ready(batch)

  items = spec.items_per_step(cfg.batch)
  flops = spec.step_flops(cfg.batch)
  peak = peaks.device_peak(mesh.devices.flat[0], cfg.dtype, len(jax.local_devices()))
  losses, times = [], []
  total = cfg.steps + cfg.profile_steps
  for step in range(total):
    profiled = step >= cfg.steps
    if profiled and step == cfg.steps and run_dir:
      jax.profiler.start_trace(run_dir)
    t = time.perf_counter()
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      params, rest, opt_state, loss = compiled(params, rest, opt_state, batch)
      loss_v = _scalar(loss)  # waits for the step
    dt = time.perf_counter() - t
    batch = make_batch(step + 1)  # next batch, generated on the devices outside the timed region
    losses.append(loss_v)
    times.append(dt)
    tflops = flops / dt / n / 1e12
    out.line({"kind": "step", "step": step, "loss": loss_v, "step_time_s": dt, "warmup": step < cfg.warmup_steps,
              "profiled": profiled})
    out.scalars({"train/loss": loss_v, "train/step_time_s": dt, f"train/{spec.item_name}_per_s": items / dt,
                 "train/tflops_per_device": tflops, "train/mfu": tflops / peak.tflops}, step)
    say(f"  step {step:4d}  loss {loss_v:.4f}  {dt * 1e3:9.2f} ms{'  (warm-up)' if step < cfg.warmup_steps else ''}"
        f"{'  (profiled)' if profiled else ''}")
  if cfg.profile_steps and run_dir:
    jax.profiler.stop_trace()

  timed = times[cfg.warmup_steps:cfg.steps]
  med = statistics.median(timed)
  tflops = flops / med / n / 1e12
  item = spec.item_name
  summary = {
      "kind": "summary", "model": spec.family, "size": spec.size, "layers": layers, "params": trainer.num_params,
      "parallelism": str(p.parallelism), "mesh": mesh_text, "placement": p.placement, "topology": str(p.topology),
      "devices": n, "device_kind": config_record["device_kind"], "batch": cfg.batch, "seq_len": spec.seq_len,
      "dtype": cfg.dtype, "steps": cfg.steps, "warmup_steps": cfg.warmup_steps, "timed_steps": len(timed),
      "item": item, "median_step_time_s": med, "min_step_time_s": min(timed), "max_step_time_s": max(timed),
      f"{item}_per_step": items, f"{item}_per_s": items / med, f"{item}_per_s_per_device": items / med / n,
      "flops_per_step": flops, "flops_formula": spec.flops_formula, "tflops_per_device": tflops,
      "peak_tflops_per_device": peak.tflops, "peak_source": peak.source, "mfu": tflops / peak.tflops,
      "hlo_flops_per_device": hlo_flops, "memory": memory,
      "memory_per_device_bytes": memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
      - memory["alias_bytes"],
      "compile_time_s": compile_s, "comm": comm, "final_loss": losses[cfg.steps - 1],
      "profile_dir": os.path.join(run_dir, "plugins", "profile") if (run_dir and cfg.profile_steps) else None,
  }
  out.line(summary)
  out.summary(summary)
  out.text("summary", _markdown({k: v for k, v in summary.items() if k != "kind"}), cfg.steps)
  out.close()
  say("summary:\n" + format_table(summary))
  return Result(losses[:cfg.steps], times, summary, run_dir, trainer, (params, rest, opt_state))
