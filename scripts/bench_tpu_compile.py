"""What TPU slices would run, compiled here without a TPU (figures for docs/measured-figures.md; not a test).

The training fit table: Llama-3 8B and 70B at full depth (layers scanned, so the compile time does not grow with
depth), sequence 8192, bf16 compute over float32 parameters and AdamW state, FSDP over every chip of a v5p or
v6e slice, each compiled by XLA:TPU for libtpu's compile-only chips (`microbench-train --target=v5p
--topology=...`): memory per chip from XLA:TPU's memory analysis against the kind's HBM (all of it: JAX on a TPU
preallocates no fraction), the step time a 100% MFU would give, the step's collectives, the compile time. A shape
XLA:TPU refuses as too large for HBM is a row too, with the compiler's own figure. Beside each row, what MaxText
publishes for the nearest configuration (benchmarks/maxtext_*_model_configs.py and its model tiering page).

  python scripts/bench_tpu_compile.py --parts=8b,70b --out=/tmp/tpu_compile.json
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from microbench.cli import absl_app

flags.DEFINE_list("parts", ["8b", "70b"], "Which rows to compile: 8b, 70b.")
flags.DEFINE_string("out", None, "Also write every row as JSON here.")
FLAGS = flags.FLAGS

# What MaxText publishes for the nearest configuration (AI-Hypercomputer/maxtext, benchmarks/
# maxtext_trillium_model_configs.py, maxtext_v5p_model_configs.py, docs/reference/models/tiering.md). Its runs use
# Pallas splash (flash) attention and a custom remat that offloads the decoder input and Q/K/V projections to host
# memory; the toolkit has XLA attention and no offload, so its memory is an upper bound on theirs.
MAXTEXT = {
    "8b-v6e": "v6e-256: per-device batch 4 (v6e-64: 5, v6e-8: 3), seq 8192, flash attention, remat custom with"
              " host offload; 45.5% MFU, 7,207 tokens/s/chip (v6e-8: 413 TFLOP/s/chip)",
    "70b-v6e": "v6e-256: per-device batch 5 (v6e-128: 4, v6e-64 and v6e-32: 2, v6e-32 with bf16 weights), seq 8192,"
               " flash, remat custom with host offload; 50.3% MFU, 960 tokens/s/chip, 462 TFLOP/s/chip",
    "70b-v5p": "Llama 2 70B on v5p-128: per-device batch 4, seq 4096, remat save_dot_except_mlpwi, fsdp 128 (no"
               " offload); Llama 2 70B on v5p-512: 65.4% MFU, 692 tokens/s/chip",
    "8b-v5p": "none published for Llama 3 8B on v5p; Llama 2 7B on v5p-128: per-device batch 4, seq 4096, remat"
              " minimal, fsdp 128",
}

# (size, kind, slice, chips, per-chip batch, seq, remat)
ROWS = {
    "8b": [
        ("8b", "v5p", "2x4x4", 32, 1, 8192, "dots_with_no_batch_dims_saveable"),
        ("8b", "v5p", "2x4x4", 32, 1, 8192, "full"),
        ("8b", "v5p", "4x4x4", 64, 4, 8192, "full"),
        ("8b", "v6e", "4x4", 16, 1, 8192, "full"),
        ("8b", "v6e", "16x16", 256, 1, 8192, "full"),
        ("8b", "v6e", "16x16", 256, 4, 8192, "full"),
    ],
    "70b": [
        ("70b", "v5p", "4x4x4", 64, 1, 8192, "full"),
        ("70b", "v5p", "4x4x8", 128, 1, 8192, "full"),
        ("70b", "v5p", "4x4x8", 128, 4, 4096, "full"),
        ("70b", "v6e", "16x16", 256, 1, 8192, "full"),
        ("70b", "v6e", "16x16", 256, 5, 8192, "full"),
    ],
}


def _gib(b) -> str:
  return "-" if b is None else f"{b / 2**30:.1f}"


def _per_layer(s: dict) -> str:
  """Each layer scan's collectives per iteration (per layer), GiB per chip: the forward scan's weight gathers,
  the backward scan's gathers and gradient reductions; `*` where XLA:TPU wrote gathers as zero-padded
  all-reduces. Per iteration, so it does not depend on reading the scan's trip count."""
  from microbench.train import comm_fingerprint  # pylint: disable=g-import-not-at-top
  padded = "*" if comm_fingerprint.ZERO_PADDED in (s.get("comm_forms") or {}).get("all-gather", {}) else ""
  short = {"all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS", "all-to-all": "A2A",
           "collective-permute": "CP"}
  return " / ".join(" + ".join(f"{short[op]} {v['bytes'] / 2**30:.2f}" for op, v in lp["ops"].items())
                    for lp in s["comm_loops"]) + padded or "-"


def compile_row(size: str, kind: str, shape: str, chips: int, per_chip: int, seq: int, remat: str) -> dict:
  from microbench import train  # pylint: disable=g-import-not-at-top
  cfg = train.TrainConfig(model="llama3", size=size, seq_len=seq, dtype="bfloat16", parallelism=f"fsdp:{chips}",
                          batch=chips * per_chip, remat=remat, target=kind, topology=shape, compile_only=True,
                          write=False, verbose=False)
  return train.run(cfg).summary


def main(argv: list[str]) -> None:
  del argv
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  rows: list = []
  print("| model | slice (chips) | batch/chip x seq | remat | memory/chip GiB | fits (HBM GiB) | margin GiB |"
        " step at 100% MFU s | per layer GiB/chip: fwd / bwd | compile s |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for part in FLAGS.parts:
    for size, kind, shape, chips, per_chip, seq, remat in ROWS[part]:
      t0 = time.perf_counter()
      head = f"| llama3-{size} | {kind} {shape} ({chips}) | {per_chip} x {seq} | {remat} |"
      try:
        s = compile_row(size, kind, shape, chips, per_chip, seq, remat)
      except Exception as e:  # pylint: disable=broad-except
        words = " ".join(line.strip() for line in str(e).splitlines()[:2])
        print(f"{head} failed after {time.perf_counter() - t0:.0f} s: {words[:240]} | | | | | |", flush=True)
        continue
      refused = s.get("compile_refused")
      mem = (f">= {_gib(s['memory_per_device_bytes'])} (XLA:TPU refused: {_gib(s['xla_available_bytes'])} available)"
             if refused else _gib(s["memory_per_device_bytes"]))
      fits = f"{'yes' if s['fits'] else 'no'} ({_gib(s['usable_bytes'])})"
      print(f"{head} {mem} | {fits} | {'-' if refused else _gib(s['margin_bytes'])} |"
            f" {s['step_time_at_full_mfu_s']:.2f} | {_per_layer(s)} | {s['compile_time_s']:.0f} |", flush=True)
      rows.append({"size": size, "kind": kind, "slice": shape, "chips": chips, "batch_per_chip": per_chip, "seq": seq,
                   "remat": remat, **{k: s.get(k) for k in (
                       "memory_per_device_bytes", "memory", "fits", "usable_bytes", "margin_bytes", "compile_refused",
                       "xla_available_bytes", "step_time_at_full_mfu_s", "flops_per_step", "peak_tflops_per_device",
                       "compile_time_s", "comm", "comm_forms", "comm_loops")}})
  print()
  print("per layer: the forward scan's / the backward scan's collectives per iteration (AG all-gather, AR all-reduce,"
        " RS reduce-scatter); * XLA:TPU wrote the weight gathers as all-reduces of zero-padded buffers")
  print("MaxText's published configurations (flash attention, host offload; not compiled here):")
  for key, text in MAXTEXT.items():
    if key.split("-")[0] in FLAGS.parts:
      print(f"- llama3-{key}: {text}")
  if FLAGS.out:
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
  absl_app.run(main, "bench_tpu_compile", [__name__])
