"""What a training run leaves behind: metrics.jsonl (config, a line per step, summary) and TensorBoard
scalars and text, written by process 0 only (other processes pass no folder and write nothing)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from microbench.output.tensorboard import TensorBoardLog

METRICS_FILE = "metrics.jsonl"


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

  def close(self) -> None:
    if self._jsonl:
      self._jsonl.close()
      self._tb.close()
