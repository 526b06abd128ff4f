"""Finding and reading run folders: collective sweeps (results.jsonl, meta.json) and training runs
(metrics.jsonl), under short labels a table or legend can show."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from microbench.output import jsonl, run_folder
from microbench.output.train_log import METRICS_FILE


class RunError(ValueError):
  """A path that holds no run; the message says what was expected."""


@dataclasses.dataclass
class SweepRun:
  path: str
  label: str
  meta: dict[str, Any]
  records: list[dict[str, Any]]  # one per point, the latest written


@dataclasses.dataclass
class TrainRun:
  path: str
  label: str
  config: dict[str, Any]
  steps: list[dict[str, Any]]
  summary: dict[str, Any] | None  # None: the run did not finish


def _is_sweep(path: str) -> bool:
  return os.path.exists(os.path.join(path, run_folder.RESULTS))


def _is_train(path: str) -> bool:
  return os.path.exists(os.path.join(path, METRICS_FILE))


def expand(paths: list[str]) -> list[str]:
  """Run folders named, or found one level below a folder that holds runs (`runs/train`)."""
  out: list[str] = []
  for p in paths:
    if not os.path.isdir(p):
      raise RunError(f"{p}: no such folder (give run folders, or a folder that holds them)")
    if _is_sweep(p) or _is_train(p):
      out.append(p)
      continue
    found = sorted(os.path.join(p, d) for d in os.listdir(p)
                   if os.path.isdir(os.path.join(p, d)) and (_is_sweep(os.path.join(p, d))
                                                            or _is_train(os.path.join(p, d))))
    if not found:
      raise RunError(f"{p}: holds no {run_folder.RESULTS} (collective sweep) or {METRICS_FILE} (training run),"
                     " nor folders that do")
    out.extend(found)
  return list(dict.fromkeys(os.path.normpath(p) for p in out))


def labels(paths: list[str]) -> list[str]:
  """Folder names, with enough parent folders to tell runs apart."""
  parts = [os.path.abspath(p).split(os.sep) for p in paths]
  for depth in range(1, max(len(p) for p in parts) + 1):
    names = [os.sep.join(p[-depth:]) for p in parts]
    if len(set(names)) == len(names):
      return names
  return [os.path.abspath(p) for p in paths]


def read_train(path: str) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
  config: dict[str, Any] = {}
  steps: list[dict[str, Any]] = []
  summary = None
  for rec in jsonl.read(os.path.join(path, METRICS_FILE)):
    kind = rec.get("kind")
    if kind == "config":
      config = rec
    elif kind == "step":
      steps.append(rec)
    elif kind == "summary":
      summary = rec
  return config, steps, summary


def load(paths: list[str]) -> tuple[list[SweepRun], list[TrainRun]]:
  """Every run under `paths`, split by kind, labelled."""
  found = expand(paths)
  sweeps, trains = [], []
  for path, label in zip(found, labels(found)):
    if _is_sweep(path):
      try:
        meta = run_folder.read_meta(path) or {}
      except ValueError as e:
        raise RunError(str(e)) from None
      sweeps.append(SweepRun(path, label, meta,
                             run_folder.latest(run_folder.read_results(path))))
    else:
      trains.append(TrainRun(path, label, *read_train(path)))
  return sweeps, trains


# Keys that differ between any two runs by construction (when, where to), so listing them hides real changes.
_UNCOMPARED = {"started_at", "resumed_at", "finished_at", "status", "reason", "flags.outdir", "flags.out",
               "environment.hosts", "environment.nics", "environment.devices", "scopes"}


def _flat(value: Any, prefix: str) -> dict[str, Any]:
  if isinstance(value, dict):
    out: dict[str, Any] = {}
    for k, v in value.items():
      out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
  return {prefix: value}


def settings_diff(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
  """(key, A, B) for every setting that differs: flags, package and driver versions, XLA_FLAGS and NCCL_*
  variables, device kinds and counts, topology. A ratio between runs means little before a reader knows
  which of these moved, so the report lists them first. Nested keys are dotted (`flags.iters`,
  `environment.variables.XLA_FLAGS`); a key one run lacks shows as None."""
  fa, fb = _flat(meta_a, ""), _flat(meta_b, "")
  rows = []
  for k in dict.fromkeys([*fa, *fb]):
    if k in _UNCOMPARED or any(k.startswith(u + ".") for u in _UNCOMPARED):
      continue
    if fa.get(k) != fb.get(k):
      rows.append((k, fa.get(k), fb.get(k)))
  return rows
