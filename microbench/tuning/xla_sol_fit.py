"""XLA:GPU's speed-of-light collective model, and its options fitted to the collectives measured across nodes.

XLA costs a collective that leaves the NVLink domain with an analytical ring model
(`--xla_gpu_analytical_latency_estimator_options`, sol_gpu_cost_model.cc in jaxlib 0.10): per ring step, the
bytes over the NIC (`nic_speed_gbps`, GB/s, plus a 2.5% header), a preparation cost per chunk
(`chunk_prep_us` per `chunk_size_bytes`) and a round trip (`rtt_us`); once per call, a launch
(`nccl_op_launch_us`); `gpus_per_node` decides how many ranks share a node. The defaults are an H100's (or a
generic device's) nominal figures x 0.45, not this machine's. With the chunk size fixed the model is linear in
(launch, rtt, chunk prep, 1/NIC speed), so those come from a non-negative least-squares fit on relative error
over every checked point across nodes; an option the points cannot tell apart from the others (e.g. chunk
preparation when every message is one chunk) is kept at XLA's default and said so. XLA reads the three latency
options as whole microseconds and ignores a value below 1: the rounded options are what the error is stated for.

Left out of the model: XLA's memory term (the bytes through HBM over its bandwidth: ~1 us at 1 MiB on an H100,
under 1% of these times) and the reduction's compute.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from microbench.output import run_folder

HEADER = 1.025  # XLA's kHeaderOverhead: 2.5% on every byte over the NIC
NAMES = ("nccl_op_launch_us", "rtt_us", "chunk_prep_us", "nic_speed_gbps")
INTEGER = ("nccl_op_launch_us", "rtt_us", "chunk_prep_us", "gpus_per_node", "chunk_size_bytes")
# XLA's defaults by the device's name (SolGPUCostModel, jaxlib 0.10.2: nominal figures x 0.45); any other name
# gets the generic row.
DEFAULTS = {
    "NVIDIA H100 80GB HBM3": {"nccl_op_launch_us": 45, "nic_speed_gbps": 25.002, "chunk_prep_us": 6.003,
                              "rtt_us": 31.0005, "gpus_per_node": 8, "chunk_size_bytes": 4194304},
    "NVIDIA B200": {"nccl_op_launch_us": 45, "nic_speed_gbps": 50.004, "chunk_prep_us": 2.0025, "rtt_us": 21.0015,
                    "gpus_per_node": 8, "chunk_size_bytes": 4194304},
}
GENERIC = {"nccl_op_launch_us": 45, "nic_speed_gbps": 50.004, "chunk_prep_us": 6.003, "rtt_us": 31.0005,
           "gpus_per_node": 8, "chunk_size_bytes": 4194304}
CHUNKS = tuple(1 << k for k in range(16, 27))  # 64 KiB .. 64 MiB, tried when chunk preparation is identifiable
RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")
OPS = (*RING_OPS, "all_to_all", "ppermute")


@dataclasses.dataclass(frozen=True)
class Point:
  """One measured collective across nodes: its group size, groups, nodes per group and time."""
  collective: str
  nbytes: int  # nccl-tests' size: all-reduce's buffer, all-gather's output, reduce-scatter's input
  group_size: int
  groups: int
  nodes: int  # nodes one group spans
  time_us: float


def shape(p: Point, gpus_per_node: int) -> tuple[int, int, bool]:
  """(nodes, comms, send/recv) as XLA dispatches a collective across nodes: a group holding whole nodes is
  `nodes = S / P` with the group count as communicators; any other is `nodes = S`."""
  if p.collective == "ppermute":
    return 2, 1, True
  whole = p.group_size == p.nodes * gpus_per_node
  return (p.nodes if whole else p.group_size), p.groups, False


def terms(p: Point, gpus_per_node: int, chunk: int) -> np.ndarray:
  """The point's time as coefficients of (launch, rtt, chunk prep, 1/NIC GB/s): time = terms . x."""
  nodes, comms, sendrecv = shape(p, gpus_per_node)
  g = 2 if sendrecv else max(1, nodes * gpus_per_node // comms)
  gpn = max(1, g // nodes)
  if p.collective == "all_to_all":
    steps, piece = gpn * (nodes - 1), p.nbytes // max(1, g - 1)
  else:
    piece = p.nbytes if sendrecv else p.nbytes // g
    steps = (g - 1) / gpn * (2 if p.collective == "all_reduce" else 1)
  return np.array([1.0, steps, steps * math.ceil(piece / chunk), steps * piece * HEADER * 1e-3])


def predict(p: Point, options: dict[str, float]) -> float:
  """XLA's SoL time of the point in microseconds under `options`."""
  o = options
  x = np.array([o["nccl_op_launch_us"], o["rtt_us"], o["chunk_prep_us"], 1.0 / o["nic_speed_gbps"]])
  return float(terms(p, int(o["gpus_per_node"]), int(o["chunk_size_bytes"])) @ x)


@dataclasses.dataclass
class Fit:
  options: dict[str, float]
  how: dict[str, str]  # option -> "fitted" | "kept at XLA's default (why)" | "the machine's"
  points: int
  median_error: float  # |predicted / measured - 1| over the points, with the rounded options
  max_error: float
  errors: list[float]

  collectives: tuple[str, ...] = ()  # each point's, in order (errors[i] is collectives[i]'s)

  def worst_by_collective(self) -> dict[str, float]:
    """The largest error per collective: where XLA's model does not fit this machine."""
    out: dict[str, float] = {}
    for c, e in zip(self.collectives, self.errors):
      out[c] = max(out.get(c, 0.0), e)
    return out

  def xla_flags(self) -> str:
    keys = ("nccl_op_launch_us", "nic_speed_gbps", "chunk_prep_us", "rtt_us", "gpus_per_node", "chunk_size_bytes")
    text = ",".join(f"{k}={fmt(k, self.options[k])}" for k in keys)
    return ("--xla_gpu_enable_analytical_sol_latency_estimator=true"
            f" --xla_gpu_analytical_latency_estimator_options={text}")

  def record(self) -> dict[str, Any]:
    return {"options": self.options, "how": self.how, "points": self.points, "median_error": self.median_error,
            "max_error": self.max_error, "worst_by_collective": self.worst_by_collective(),
            "xla_flags": self.xla_flags()}


def fmt(key: str, value: float) -> str:
  """An option's value as XLA reads it (whole numbers for all but the NIC speed)."""
  return str(int(value)) if key in INTEGER else f"{value:.6g}"


def _nnls(a: np.ndarray, b: np.ndarray, free: Sequence[int]) -> np.ndarray | None:
  """Least squares over the columns `free` with every coefficient >= 0 (all active sets tried: 4 columns)."""
  best, best_cost = None, math.inf
  for k in range(len(free), 0, -1):
    for cols in itertools.combinations(free, k):
      x_sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
      if np.any(x_sub < 0):
        continue
      cost = float(np.sum((a[:, cols] @ x_sub - b) ** 2))
      if cost < best_cost - 1e-12:
        x = np.zeros(a.shape[1])
        x[list(cols)] = x_sub
        best, best_cost = x, cost
  return best


def identifiable(a: np.ndarray, tol: float = 1e-3) -> list[int]:
  """The columns not (nearly) a combination of the others: what the points can tell apart."""
  out = []
  norm = a / np.maximum(np.linalg.norm(a, axis=0), 1e-300)
  for j in range(a.shape[1]):
    others = np.delete(norm, j, axis=1)
    if not np.any(norm[:, j]):
      continue
    coef, *_ = np.linalg.lstsq(others, norm[:, j], rcond=None)
    if np.linalg.norm(norm[:, j] - others @ coef) > tol:
      out.append(j)
  return out


class FitError(ValueError):
  """No points across nodes to fit, or runs of different machines; one line."""


def defaults_for(device_kind: str | None) -> dict[str, float]:
  return dict(DEFAULTS.get(device_kind or "", GENERIC))


def fit(points: Sequence[Point], gpus_per_node: int, defaults: dict[str, float]) -> Fit:
  """The options reproducing the points' times best (relative error), chunk sizes tried where they matter."""
  if len(points) < 2:
    raise FitError(f"{len(points)} checked point(s) across nodes: the SoL options need a sweep over scale_out or"
                   " global (several sizes)")
  default_chunk = int(defaults["chunk_size_bytes"])
  a = _relative(points, gpus_per_node, default_chunk)
  chunks = CHUNKS if 2 in identifiable(a) else (default_chunk,)
  fits = [_fit_one(points, gpus_per_node, defaults, c) for c in dict.fromkeys((default_chunk, *chunks))]
  return min(fits, key=lambda f: (round(f.max_error, 6), f.median_error))


def _relative(points: Sequence[Point], gpus_per_node: int, chunk: int) -> np.ndarray:
  return np.array([terms(p, gpus_per_node, chunk) / p.time_us for p in points])


def _fit_one(points: Sequence[Point], gpus_per_node: int, defaults: dict[str, float], chunk: int) -> Fit:
  a = _relative(points, gpus_per_node, chunk)
  x_def = np.array([defaults["nccl_op_launch_us"], defaults["rtt_us"], defaults["chunk_prep_us"],
                    1.0 / defaults["nic_speed_gbps"]])
  free = identifiable(a)
  how = {NAMES[j]: "kept at XLA's default (the points cannot tell it from the others)"
         for j in range(4) if j not in free}
  fixed = [j for j in range(4) if j not in free]
  x = _nnls(a, np.ones(len(points)) - a[:, fixed] @ x_def[fixed], free) if free else None
  x = np.zeros(4) if x is None else x
  x[fixed] = x_def[fixed]
  if 3 in free and x[3] <= 0:  # no byte term at all: keep XLA's NIC speed
    x[3] = x_def[3]
    how["nic_speed_gbps"] = "kept at XLA's default (the fit gave the bytes no cost)"
  options = {"nccl_op_launch_us": float(x[0]), "rtt_us": float(x[1]), "chunk_prep_us": float(x[2]),
             "nic_speed_gbps": float(1.0 / x[3]),
             "gpus_per_node": gpus_per_node, "chunk_size_bytes": chunk}
  for k in ("nccl_op_launch_us", "rtt_us", "chunk_prep_us"):  # XLA reads whole microseconds, ignores < 1
    how.setdefault(k, "fitted" if round(options[k]) >= 1 else "fitted as ~0; written as 1, XLA's least")
    options[k] = max(1, int(round(options[k])))
  how.setdefault("nic_speed_gbps", "fitted")
  how["gpus_per_node"] = "the machine's (the runs' topology)"
  how["chunk_size_bytes"] = ("kept at XLA's default" if chunk == int(defaults["chunk_size_bytes"])
                             else "chosen from 64 KiB .. 64 MiB (best fit)")
  errors = [abs(predict(p, options) / p.time_us - 1) for p in points]
  return Fit(options, how, len(points), float(np.median(errors)), float(max(errors)), errors,
             tuple(p.collective for p in points))


def points_from(records: Sequence[dict[str, Any]], meta: dict[str, Any]) -> tuple[list[Point], dict[str, int]]:
  """The sweep's checked, steady points whose groups span nodes; and the count left out, by reason."""
  checked = (meta.get("flags") or {}).get("check", True) is not False
  out, left = [], {}
  for rec in records:
    groups = run_folder.scope_groups(meta, rec.get("scope"))
    nodes = run_folder.group_nodes(meta, groups[0]) if groups else 0
    why = ("not a collective XLA's SoL model costs" if rec.get("collective") not in OPS else
           "failed or unchecked" if rec.get("status") != "ok" or not checked or rec.get("wrong") else
           "NOISY" if rec.get("noisy") else "no resolved time" if not (rec.get("time_us") or 0) > 0 else
           "inside one node (the performance table's)" if nodes < 2 else None)
    if why:
      left[why] = left.get(why, 0) + 1
      continue
    out.append(Point(rec["collective"], int(rec["bytes"]), len(groups[0]), len(groups), nodes, float(rec["time_us"])))
  return out, left
