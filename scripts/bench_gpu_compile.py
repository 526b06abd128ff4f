"""What the GPU clusters would run, compiled here without a GPU (figures for docs/measured-figures.md; not a test).

Parts (`--parts=70b,presets,scale`), each compiled with XLA:GPU for compile-only devices (`--target`):
- `70b`: Llama-3 70B (80 layers, seq 4096, bf16, one sample per data shard) on H200 at fsdp 8/16/32/64 and
  with tp:8 inside the node: memory per device, fit, margin, compile time.
- `presets`: the study's five strategies at the study's concurrent job sizes on an H100 cluster (hosts of
  8): the preset's model at full depth; memory, fit, the step's collectives, compile time.
- `scale`: the derived study proxies (microbench-study schedule --proxy_from --target) at growing sizes up
  to the paper's largest: per-rank bytes and collective count per iteration, and compile time; a size that
  does not compile says why.

  python scripts/bench_gpu_compile.py --parts=70b,presets,scale --out=/tmp/gpu_compile.json
"""

from __future__ import annotations

import json
import time

from absl import app, flags

from microbench.cli import absl_app

flags.DEFINE_list("parts", ["70b", "presets", "scale"], "Which tables to make.")
flags.DEFINE_string("out", None, "Also write every row as JSON here.")
flags.DEFINE_multi_string("scale", ["dp:8,64,256", "fsdp:16,64,256", "dp+pp:16,64,256", "dp+pp+tp:256,512,1024",
                                  "dp+pp+ep:512,1024,2048"], "STRATEGY:GPUS,... for the scale part (repeat the flag per strategy).")
FLAGS = flags.FLAGS

PRESET_SIZES = {"study-dp": (8, 16), "study-fsdp": (16, 32), "study-dp-pp": (16, 32, 64),
                "study-dp-pp-tp": (224, 256, 512), "study-dp-pp-ep": (512, 1024)}
STRATEGY_MODEL = {"dp": "vit-h14", "fsdp": "llama3-8b", "dp+pp": "minerva-7b", "dp+pp+tp": "llama3-70b",
                  "dp+pp+ep": "mixtral-8x7b"}


def _gib(b) -> str:
  return f"{b / 2**30:.1f}"


def _compile(**kw) -> dict:
  from microbench import train  # pylint: disable=g-import-not-at-top
  cfg = train.TrainConfig(compile_only=True, write=False, verbose=False, dtype="bfloat16", **kw)
  return train.run(cfg).summary


def _comm(s: dict) -> str:
  return ", ".join(f"{op} x{v['count']} {v['bytes'] / 2**30:.2f} GiB" for op, v in s["comm"].items())


def part_70b(rows: list) -> None:
  from microbench.fabric import gpu_kinds  # pylint: disable=g-import-not-at-top
  memory_gib = gpu_kinds.target("h200").memory_bytes / 2**30  # as the device reports it, with its source
  print(f"| parallelism | GPUs | memory/GPU GiB | fits 75% of {memory_gib:.1f} GiB | margin GiB | compile s |")
  print("|---|---|---|---|---|---|")
  for par in ("fsdp:8", "fsdp:16", "fsdp:32", "fsdp:64", "fsdp:2,tp:8", "fsdp:4,tp:8", "fsdp:8,tp:8"):
    from microbench.meshes.parallelism import parse_parallelism  # pylint: disable=g-import-not-at-top
    p = parse_parallelism(par)
    n = p.num_devices
    s = _compile(model="llama3", size="70b", seq_len=4096, parallelism=par, batch=p.batch_shards, target="h200",
                 topology=f"nodes:{n // 8},gpus:8")
    rows.append({"part": "70b", "parallelism": par, **{k: s[k] for k in (
        "devices", "memory_per_device_bytes", "fits", "fits_whole_device", "margin_bytes", "compile_time_s",
        "comm", "attention_compiled")}})
    print(f"| {par} | {n} | {_gib(s['memory_per_device_bytes'])} | {'yes' if s['fits'] else 'no'}"
          f"{' (whole device: yes)' if not s['fits'] and s['fits_whole_device'] else ''} |"
          f" {_gib(s['margin_bytes'])} | {s['compile_time_s']:.1f} |", flush=True)


def part_presets(rows: list) -> None:
  from microbench.study import presets  # pylint: disable=g-import-not-at-top
  print("| preset | GPUs | model, degrees | memory/GPU GiB | fits (60 GiB) | collectives per step per GPU | compile s |")
  print("|---|---|---|---|---|---|---|")
  for name, sizes in PRESET_SIZES.items():
    for n in sizes:
      fields, _ = presets.resolve(name, n, "gpu", None, {})
      t0 = time.perf_counter()
      try:
        s = _compile(**{k: v for k, v in fields.items() if k != "dtype"}, target="h100",
                     topology=f"nodes:{n // 8},gpus:8")
      except Exception as e:  # pylint: disable=broad-except
        print(f"| {name} | {n} | {fields['model']}-{fields['size']} {fields['parallelism']} | failed after"
              f" {time.perf_counter() - t0:.0f} s: {str(e).splitlines()[0][:120]} | | | |", flush=True)
        continue
      rows.append({"part": "presets", "preset": name, "gpus": n, "fields": fields, **{k: s[k] for k in (
          "memory_per_device_bytes", "fits", "margin_bytes", "compile_time_s", "comm", "attention_compiled",
          "compile_note")}})
      print(f"| {name} | {n} | {fields['model']}-{fields['size']} L{fields['layers']} {fields['parallelism']} |"
            f" {_gib(s['memory_per_device_bytes'])} | {'yes' if s['fits'] else 'no'} | {_comm(s)} |"
            f" {s['compile_time_s']:.1f} |", flush=True)


def part_scale(rows: list) -> None:
  from microbench.study import rank_programs, step_collectives  # pylint: disable=g-import-not-at-top
  from microbench.aot import gpu_compile  # pylint: disable=g-import-not-at-top
  print("| strategy | GPUs | rank 0 bytes/iteration by op (GB) | collectives/iteration (rank 0) | compile s |")
  print("|---|---|---|---|---|")
  for item in FLAGS.scale:
    strategy, _, sizes = item.partition(":")
    for n in (int(v) for v in sizes.split(",")):
      per_host = 8 if n % 8 == 0 else n
      t0 = time.perf_counter()
      try:
        devices = gpu_compile.make_target("h100", n // per_host, per_host).devices
        job = step_collectives.derive(f"{STRATEGY_MODEL[strategy]},{strategy}", n, devices=devices)
      except Exception as e:  # pylint: disable=broad-except
        print(f"| {strategy} | {n} | failed after {time.perf_counter() - t0:.0f} s:"
              f" {str(e).splitlines()[0][:160]} | | |", flush=True)
        continue
      dt = time.perf_counter() - t0
      per = rank_programs.bytes_per_iteration(job, 0)
      count = sum(1 for _ in job.comms(0))
      rows.append({"part": "scale", "strategy": strategy, "gpus": n, "bytes_rank0": per, "collectives_rank0": count,
                   "seconds": dt, "parallelism": job.meta.get("parallelism")})
      text = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(per.items()))
      print(f"| {strategy} ({job.meta.get('parallelism')}) | {n} | {text} | {count} | {dt:.1f} |", flush=True)


def main(argv: list[str]) -> None:
  del argv
  rows: list = []
  for part in FLAGS.parts:
    {"70b": part_70b, "presets": part_presets, "scale": part_scale}[part](rows)
    print(flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
  absl_app.run(main, "bench_gpu_compile", [__name__])
