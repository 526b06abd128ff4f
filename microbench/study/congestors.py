"""Congestors and canary points as schedules: GPCNeT's congestion patterns and single collectives, in the
form the proxy executor runs (`proxy.py`) and the flow model predicts (`predict.job_model`).

One iteration is one round of the pattern, every rank's message `message_bytes` (nccl-tests' S):
- alltoall: an all-to-all over the job (S/n to every other rank);
- incast: every rank but rank 0 sends S to rank 0 at once (one two-rank communicator per sender, all
  started, then waited for: many-to-one into one NIC, as NCCL runs separate communicators at once; XLA:CPU
  runs the root's programs in order, so there the senders take turns - measured, BUILD_NOTES);
- broadcast: S from rank 0 along a chain 0 -> 1 -> ... -> n-1, every hop at once, as NCCL's pipelined ring
  broadcast moves it; run as one collective-permute along the chain, so every platform moves a broadcast's
  bytes (XLA:CPU has no broadcast and would run a masked all-reduce, twice the bytes);
- permutation: every rank sends S to its image under a seeded random permutation without fixed points.
Congestors have no compute: they load the links they cross back to back until stopped (SIGUSR1, as the
study's kill sequence ends a proxy). A canary point is one blocking collective per iteration.
"""

from __future__ import annotations

import random

from microbench.study import rank_programs as sch

KINDS = ("alltoall", "incast", "broadcast", "permutation")
POINT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


class CongestorError(ValueError):
  """A bad congestor or point (unknown kind, too few ranks, bad size); one line."""


def _elements(message_bytes: int, element_bytes: int, grain: int = 1) -> int:
  if message_bytes < 1:
    raise CongestorError(f"a message of {message_bytes} bytes moves nothing")
  e = max(1, message_bytes // element_bytes)
  return max(grain, e // grain * grain)


def derangement(n: int, seed: int) -> list[int]:
  """A seeded random permutation of range(n) with no fixed point (every rank sends to another)."""
  rng = random.Random(seed)
  while True:
    p = list(range(n))
    rng.shuffle(p)
    if all(p[i] != i for i in range(n)):
      return p


def build(kind: str, gpus: int, message_bytes: int, element_bytes: int = 2, seed: int = 0) -> sch.JobSchedule:
  """The congestor `kind` over `gpus` ranks, one round per iteration."""
  if kind not in KINDS:
    raise CongestorError(f"unknown congestor {kind!r}; choose one of {', '.join(KINDS)}")
  if gpus < 2:
    raise CongestorError(f"a {kind} congestor needs at least 2 ranks, got {gpus}")
  world = sch.Group("congestor", tuple(range(gpus)))
  ranks: list[tuple[sch.Step, ...]] = []
  if kind == "alltoall":
    c = sch.Comm("all_to_all", _elements(message_bytes, element_bytes, gpus), world, kind)
    ranks = [(sch.Blocking(c),)] * gpus
  elif kind == "broadcast":
    chain = tuple((i, i + 1) for i in range(gpus - 1))
    c = sch.Comm("permute", _elements(message_bytes, element_bytes), world, kind, chain)
    ranks = [(sch.Blocking(c),)] * gpus
  elif kind == "permutation":
    p = derangement(gpus, seed)
    c = sch.Comm("permute", _elements(message_bytes, element_bytes), world, kind, tuple(enumerate(p)))
    ranks = [(sch.Blocking(c),)] * gpus
  else:  # incast: one pair communicator per sender, all started by the root, then waited for
    e = _elements(message_bytes, element_bytes)
    pairs = [sch.Comm("permute", e, sch.Group("incast", (0, s)), kind, ((1, 0),)) for s in range(1, gpus)]
    root = tuple(sch.Start(c, h) for h, c in enumerate(pairs, 1)) + (sch.Wait(tuple(range(1, gpus)), kind),)
    ranks = [root] + [(sch.Blocking(pairs[s - 1]),) for s in range(1, gpus)]
  meta = {"congestor": kind, "message_bytes": message_bytes, "seed": seed if kind == "permutation" else None}
  return sch.JobSchedule(f"congestor/{kind}", gpus, 0, tuple(ranks), meta)


def point(op: str, gpus: int, message_bytes: int, element_bytes: int = 2) -> sch.JobSchedule:
  """A canary that is one collective point: `op` over every rank, one blocking call per iteration."""
  if op not in POINT_OPS:
    raise CongestorError(f"unknown collective {op!r} for a canary point; choose one of {', '.join(POINT_OPS)}")
  if gpus < 2:
    raise CongestorError(f"a {op} point needs at least 2 ranks, got {gpus}")
  grain = gpus if op in ("all_gather", "reduce_scatter", "all_to_all") else 1
  c = sch.Comm(op, _elements(message_bytes, element_bytes, grain), sch.Group("point", tuple(range(gpus))), op)
  return sch.JobSchedule(f"point/{op}", gpus, 0, tuple((sch.Blocking(c),) for _ in range(gpus)),
                         {"point": op, "message_bytes": message_bytes})


def parse_size(text: str) -> int:
  """`4M`, `512K`, `1G` or bytes (binary units, as the sweeps' sizes)."""
  t = text.strip().upper().removesuffix("IB").removesuffix("B")
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
  digits = t[:-1] if t[-1:] in "KMG" else t
  try:
    value = float(digits) * mult
  except ValueError:
    raise CongestorError(f"bad size {text!r}; want bytes or a number with K, M or G (e.g. 4M)") from None
  if value < 1:
    raise CongestorError(f"size {text!r} must be at least 1 byte")
  return int(value)
