"""A run folder's records with what differs between two runs of the same sweep masked (times, timestamps, host
load), so a refactor can be checked to leave a sweep's outputs unchanged: `python tests/run_records.py A B`."""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from typing import Any

# Fields that depend on timing (how long, when, which sample stopped the pairs early) or the host's state.
TIMING_KEYS = frozenset({
    "finished_at", "started_at", "resumed_at", "samples", "timed_check", "rank_samples", "rank_median_us", "noisy",
    "straggler", "slowest_rank", "time_method", "iters_first", "resolution_first", "environment", "outdir",
    "compilation_cache", "processes", "samples_us"})
MASK = "<masked>"


def _mask(value: Any, key: str = "") -> Any:
  if key in TIMING_KEYS:
    return MASK
  if isinstance(value, dict):
    return {k: _mask(v, k) for k, v in value.items()}
  if isinstance(value, list):
    return [_mask(v) for v in value]
  if isinstance(value, float):
    return MASK
  return value


def _mask_cell(key: str, text: str) -> str:
  if key in TIMING_KEYS or re.fullmatch(r"-?\d+\.\d*(e-?\d+)?", text) or text.startswith("[") and "." in text:
    return MASK
  return text


def masked(outdir: str) -> dict[str, Any]:
  """results.jsonl, results.csv and meta.json of `outdir`, every timing-dependent value masked."""
  with open(os.path.join(outdir, "results.jsonl"), encoding="utf-8") as f:
    results = [_mask(json.loads(line)) for line in f if line.strip()]
  with open(os.path.join(outdir, "results.csv"), newline="", encoding="utf-8") as f:
    table = [{k: _mask_cell(k, v) for k, v in row.items()} for row in csv.DictReader(f)]
  with open(os.path.join(outdir, "meta.json"), encoding="utf-8") as f:
    meta = _mask(json.load(f))
  return {"results.jsonl": results, "results.csv": table, "meta.json": meta}


def masked_console(text: str, outdir: str = "") -> list[str]:
  """The console's lines with numbers that carry a decimal point (times, bandwidths) and the folder masked."""
  if outdir:
    text = text.replace(outdir, "OUTDIR")
  text = re.sub(r"\(git [0-9a-f]+", "(git HASH", text)
  text = re.sub(r"  NOISY \(median \+-\d+%\)", "", text)  # how noisy a point was: the host's load
  return [" ".join(re.sub(r"\d+\.\d+(e-?\d+)?", "#.#", line).split()) for line in text.splitlines()]


def config_text(outdir: str) -> str:
  """The run's flags as TensorBoard's Text tab shows them (the `config` text of its events)."""
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  ea = event_accumulator.EventAccumulator(outdir)
  ea.Reload()
  return ea.Tensors("config")[0].tensor_proto.string_val[0].decode()


def differences(a: str, b: str) -> list[str]:
  """What differs between two run folders once masked (empty: the same records)."""
  ma, mb = masked(a), masked(b)
  out = []
  for name in ma:
    if ma[name] != mb[name]:
      out.append(f"{name} differs")
  if config_text(a).replace(a, "OUTDIR") != config_text(b).replace(b, "OUTDIR"):
    out.append("the config text differs")
  return out


if __name__ == "__main__":
  found = differences(sys.argv[1], sys.argv[2])
  print("\n".join(found) or "the same once masked")
  sys.exit(1 if found else 0)
