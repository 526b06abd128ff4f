"""Compile time against depth (not a test): the step of GPT-2 124M (or any model) compiled at a shallow and a
deep layer count, with the layers scanned and unrolled, alternating, several rounds; medians reported.

Target: scanned layers compile in at most 1.5x the time at 24 layers as at 2. Each compile is
`microbench-train --compile_only` in-process (the same path, XLA's default optimisation level); a new
Trainer per compile, so nothing is reused between rounds; one throwaway compile first takes the process's
one-time start-up costs.

  python scripts/bench_compile.py --model=gpt2 --size=124m --depths=2,24 --rounds=3
"""

from __future__ import annotations

import json
import dataclasses
import os
import statistics

from absl import app, flags

from microbench.cli import absl_app

flags.DEFINE_string("model", "gpt2", "Model family.")
flags.DEFINE_string("size", "124m", "Model size.")
flags.DEFINE_list("depths", ["2", "24"], "Layer counts to compile (shallow first).")
flags.DEFINE_integer("rounds", 3, "Alternating rounds.")
flags.DEFINE_integer("batch", 8, "Global batch.")
flags.DEFINE_integer("seq_len", 256, "Tokens per example.")
flags.DEFINE_string("parallelism", "dp:1", "Strategy degrees (the CPU devices are emulated to match).")
flags.DEFINE_bool("unrolled", True, "Also compile with the layers unrolled, for contrast.")
flags.DEFINE_string("out", None, "Also write the result as JSON here.")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
  del argv
  from microbench.meshes.parallelism import ParallelismError, parse_parallelism  # pylint: disable=g-import-not-at-top
  try:
    devices = parse_parallelism(FLAGS.parallelism).num_devices
    depths = [int(d) for d in FLAGS.depths]
  except ParallelismError as e:
    raise app.UsageError(str(e)) from None
  except ValueError as e:
    raise app.UsageError(f"--depths={','.join(FLAGS.depths)}: {e}") from None
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(devices))
  from microbench import train  # pylint: disable=g-import-not-at-top

  # A throwaway compile first: the first compile in a process pays one-time start-up costs (seconds).
  first = train.TrainConfig(model=FLAGS.model, size=FLAGS.size, layers=1, batch=FLAGS.batch, seq_len=FLAGS.seq_len,
                            parallelism=FLAGS.parallelism, compile_only=True, write=False, verbose=False)
  try:
    train.check_request(dataclasses.replace(first, layers=max(depths)))  # bad flags: one line, before compiling
    train.run(first)
  except train.ConfigError as e:
    raise app.UsageError(str(e)) from None
  arms = [(d, scan) for scan in ((True, False) if FLAGS.unrolled else (True,)) for d in depths]
  times: dict[str, list[float]] = {f"{d}{'' if s else '_unrolled'}": [] for d, s in arms}
  for r in range(FLAGS.rounds):
    for d, scan in (arms if r % 2 == 0 else arms[::-1]):
      cfg = train.TrainConfig(model=FLAGS.model, size=FLAGS.size, layers=d, batch=FLAGS.batch,
                              seq_len=FLAGS.seq_len, parallelism=FLAGS.parallelism, scan_layers=scan,
                              compile_only=True, write=False, verbose=False)
      s = train.run(cfg).summary
      times[f"{d}{'' if scan else '_unrolled'}"].append(s["compile_time_s"])
      print(f"round {r}: {d} layers {'scanned' if scan else 'unrolled'}: {s['compile_time_s']:.2f} s", flush=True)
  med = {k: statistics.median(v) for k, v in times.items()}
  lo, hi = depths[0], depths[-1]
  result = {"model": f"{FLAGS.model}-{FLAGS.size}", "batch": FLAGS.batch, "seq_len": FLAGS.seq_len,
            "parallelism": FLAGS.parallelism, "rounds": FLAGS.rounds, "compile_s": times, "median_s": med,
            "scanned_growth": med[str(hi)] / med[str(lo)]}
  if FLAGS.unrolled:
    result["unrolled_growth"] = med[f"{hi}_unrolled"] / med[f"{lo}_unrolled"]
  for k, v in med.items():
    print(f"  {k:>14} layers: {v:.2f} s")
  print(f"  scanned {hi} vs {lo} layers: {result['scanned_growth']:.2f}x (target <= 1.5x)")
  if FLAGS.unrolled:
    print(f"  unrolled {hi} vs {lo} layers: {result['unrolled_growth']:.2f}x")
  print(json.dumps(result))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  absl_app.run(main, "bench_compile.py", [__name__])
