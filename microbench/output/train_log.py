"""What a training run leaves behind: metrics.jsonl (config, a line per step, summary) and TensorBoard
scalars, text and HParams, written by process 0 only (other processes pass no folder and write nothing).

Per-step curves use the step; the summary is written at one fixed step (SUMMARY_STEP) for every run, so
runs of different lengths line up, and the run is an HParams session: its configuration as hyperparameters
and its summary scalars as metrics, so the HParams table and parallel coordinates compare strategies."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from microbench.output.tensorboard import TensorBoardLog

METRICS_FILE = "metrics.jsonl"
SUMMARY_STEP = 0
# HParams columns (name -> type) from the config line, and metric tags with their display names. Every run
# writes this same experiment (TensorBoard reads one of them), so it lists what any model may report.
HPARAMS = {"model": "string", "size": "string", "layers": "number", "parallelism": "string",
           "placement": "string", "mesh": "string", "batch": "number", "seq_len": "number", "dtype": "string",
           "devices": "number", "processes": "number", "topology": "string", "device_kind": "string",
           "remat": "string", "grad_accum": "number", "attention_impl": "string", "scan_layers": "bool",
           "schedule": "string", "microbatches": "number", "virtual_stages": "number", "context_impl": "string",
           "moe_dispatch_impl": "string", "capacity_factor": "number", "preset": "string"}
HPARAMS_LEAD = ("model", "size", "parallelism", "placement", "devices")  # the columns shown by default
# The HParams metric columns: only figures every finished run reports. TensorBoard's parallel coordinates and
# scatter plots drop a session lacking any shown metric, so one column only image models fill (images/s), or
# only runs with a known peak (MFU), would empty the view for the rest. Throughput is one column whatever the
# item (`summary/items_per_s_per_device`: tokens or images); the other summary figures (MFU, bubble, all-to-all
# share, bytes per collective) stay scalars under `summary/` in the Scalars tab.
#
# Display names are short (at most HPARAM_NAME_MAX characters): parallel coordinates give each axis about
# 110 px at a 1600 px window, and longer titles ran into their neighbours'. What each means is its
# description (HParams shows it on hovering the column's name); the tags stay as they were.
HPARAM_METRICS = {
    "summary/median_step_time_s": "step time (s)", "summary/items_per_s_per_device": "items/s/dev",
    "summary/items_per_s": "items/s", "summary/tflops_per_device": "TFLOP/s/dev",
    "summary/memory_per_device_bytes": "mem/dev (B)", "summary/final_loss": "final loss",
    "summary/compile_time_s": "compile (s)",
}
HPARAM_NAME_MAX = 13
HPARAM_METRIC_DESCRIPTIONS = {
    "summary/median_step_time_s": "Median time per training step (s).",
    "summary/items_per_s_per_device": "Throughput per device: tokens/s for language models, images/s for image"
                                      " models.",
    "summary/items_per_s": "Throughput of the whole run: tokens/s for language models, images/s for image models.",
    "summary/tflops_per_device": "Model TFLOP/s per device (MFU, where the device's peak is known, is the scalar"
                                 " summary/mfu).",
    "summary/memory_per_device_bytes": "Memory per device (bytes).",
    "summary/final_loss": "Training loss at the last step.",
    "summary/compile_time_s": "Compile time (s).",
}
# Measured shares and the flag saying whether their 95% interval resolves them (microbench.train.overheads).
RESOLVED_FLAGS = {"bubble_measured": "bubble_resolved", "all_to_all_share": "all_to_all_resolved"}


def _cell(v: Any) -> str:
  """A value as a table cell: 4 significant digits, n/a for None, anything with Markdown's characters
  (`*`, `_`, `|`) in a code span so formulas and names arrive as written."""
  def rounded(x: Any) -> Any:
    if isinstance(x, float):
      return float(f"{x:.4g}")
    if isinstance(x, dict):
      return {k: rounded(w) for k, w in x.items()}
    return [rounded(w) for w in x] if isinstance(x, (list, tuple)) else x
  if v is None:
    return "n/a"
  if isinstance(v, bool):
    return "yes" if v else "no"
  if isinstance(v, float):
    text = f"{v:.4g}"
  elif isinstance(v, (dict, list, tuple)):
    text = json.dumps(rounded(v))
  else:
    text = str(v)
  if any(c in text for c in "*_|`<>[]\\#"):
    fence = "``" if "`" in text else "`"
    text = f"{fence} {text} {fence}"  # a pipe inside a code span stays in its cell (TensorBoard's Markdown)
  return text


def markdown_table(d: dict[str, Any]) -> str:
  """A run's config or summary as TensorBoard's Text tab renders it: a two-column table, names in code spans
  (their underscores are not emphasis), values through `_cell`."""
  rows = [f"| `{k}` | {_cell(v)} |" for k, v in d.items()]
  return "| name | value |\n|---|---|\n" + "\n".join(rows)


class TrainLog:
  """JSONL (flushed per line) and TensorBoard, on process 0 only."""

  def __init__(self, run_dir: str | None):
    self.run_dir = run_dir
    self._jsonl = self._tb = None
    if run_dir:
      os.makedirs(run_dir, exist_ok=True)
      self._jsonl = open(os.path.join(run_dir, METRICS_FILE), "w")
      self._tb = TensorBoardLog(run_dir)

  def line(self, record: dict[str, Any]) -> None:
    if self._jsonl:
      self._jsonl.write(json.dumps(record) + "\n")
      self._jsonl.flush()

  def scalars(self, values: dict[str, float], step: int) -> None:
    if self._tb:
      for tag, v in values.items():
        if v is not None and np.isfinite(v):
          self._tb.scalar(tag, v, step)

  def text(self, tag: str, text: str, step: int = 0) -> None:
    if self._tb:
      self._tb.text(tag, text, step)

  def hparams(self, config: dict[str, Any]) -> None:
    """The run as an HParams session: the configuration's values (those set) as hyperparameters."""
    if self._tb:
      self._tb.hparams_experiment(HPARAMS, HPARAM_METRICS, HPARAMS_LEAD, HPARAM_METRIC_DESCRIPTIONS)
      self._tb.hparams_session_start({k: config[k] for k in HPARAMS if config.get(k) is not None})

  def summary(self, summary: dict[str, Any]) -> None:
    """Every numeric summary figure as `summary/<name>` and the bytes per collective type as
    `summary/comm_bytes/<op>`, all at SUMMARY_STEP; then the session ends. A measured share comes with its
    interval (`<name>_ci_low`, `_ci_high`) and its resolved flag as 1/0; an unresolved share's own value is
    left out, so the HParams column is empty rather than showing noise as a figure."""
    values = {f"summary/{k}": float(v) for k, v in summary.items()
              if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for figure, flag in RESOLVED_FLAGS.items():
      if flag in summary:
        values[f"summary/{flag}"] = float(bool(summary[flag]))
        if not summary[flag]:
          values.pop(f"summary/{figure}", None)
      if summary.get(f"{figure}_ci"):
        values[f"summary/{figure}_ci_low"], values[f"summary/{figure}_ci_high"] = map(float, summary[f"{figure}_ci"])
    item = summary.get("item")
    for suffix in ("_per_s", "_per_s_per_device"):  # throughput under one name whatever the item
      if item and isinstance(summary.get(f"{item}{suffix}"), (int, float)):
        values[f"summary/items{suffix}"] = float(summary[f"{item}{suffix}"])
    values.update({f"summary/comm_bytes/{op}": float(c["bytes"]) for op, c in (summary.get("comm") or {}).items()})
    self.scalars(values, SUMMARY_STEP)
    if self._tb:
      self._tb.hparams_session_end(ok=True)

  def close(self) -> None:
    if self._jsonl:
      self._jsonl.close()
      self._tb.close()
