"""Placements ranked by predicted interference: for a list of jobs, candidate node sets (every combination of
the placement classes each job can have on the machine, a few random draws of each, the study's placer),
each scored by the fabric model's predicted worst and mean sigma over its jobs; best first.

A job's sigma here is against that job alone on its own nodes (not the study's per-key baseline on the
first job's nodes): the question is what this placement costs each job.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from microbench.study import generator as gen
from microbench.study import machines as mm
from microbench.study import placement, predict

MAX_CANDIDATES = 60
ITERATIONS = 4  # per job in the model: the first is left out, the median of the other three kept


def candidates(machine: mm.Machine, jobs: Sequence[tuple[str, int]], draws: int = 3,
               max_candidates: int = MAX_CANDIDATES) -> list[dict]:
  """Experiments (the plan's format) placing `jobs` (strategy, GPUs), distinct node sets only."""
  per_job = []
  for strategy, gpus in jobs:
    classes = [c for c in mm.CLASSES if mm.class_fits(machine, c, gpus)]
    if not classes:
      raise mm.MachineError(f"a {strategy} job of {gpus} GPUs fits no placement class on {machine.name}"
                            f" ({machine.total_gpus} GPUs)")
    per_job.append(classes)
  seen: set = set()
  out = []
  for combo in itertools.product(*per_job):
    for d in range(draws):
      nodes = placement.place(machine, [(g, c) for (_, g), c in zip(jobs, combo)], seed=1000 * d + 7)
      if nodes is None:
        continue
      key = tuple(tuple(n) for n in nodes)
      if key in seen:
        continue
      seen.add(key)
      firsts = placement.first_slots(machine, [g for _, g in jobs], nodes)
      entries = [gen.job_entry(f"j{i}", s, g, mm.classify(machine, ns), list(ns), first_slot=f)
                 for i, ((s, g), ns, f) in enumerate(zip(jobs, nodes, firsts))]
      out.append({"id": f"c{len(out):03d}", "jobs": entries})
      if len(out) >= max_candidates:
        return out
  return out


def rank(machine: mm.Machine, jobs: Sequence[tuple[str, int]], bytes_scale: float = 1.0,
         compute_scale: float = 1.0, draws: int = 3) -> list[dict]:
  """Candidates with their predicted sigmas, best (lowest worst, then mean sigma) first."""
  exps = candidates(machine, jobs, draws)
  if not exps:
    raise mm.MachineError(f"no placement of these jobs fits {machine.name}")
  scored = []
  solo_time: dict[tuple, float] = {}  # a job alone on a node set: the same in every candidate that has it
  scales = dict(bytes_scale=bytes_scale, compute_scale=compute_scale, iterations=ITERATIONS)
  for e in exps:
    alone = {}
    for j in e["jobs"]:  # each job against itself alone on its own nodes
      key = (j["strategy"], j["gpus"], tuple(j["nodes"]), j["first_slot"])
      if key not in solo_time:
        solo_time[key] = predict.mix_times(machine, [j], **scales)[j["name"]][0]
      alone[j["name"]] = solo_time[key]
    times = predict.mix_times(machine, e["jobs"], **scales)
    mix = [{"job": name, "together_s": t, "link": link} for name, (t, link) in times.items()]
    sig = [row["together_s"] / alone[row["job"]] for row in mix]
    scored.append(dict(e, worst_sigma=max(sig), mean_sigma=sum(sig) / len(sig), sigmas=sig,
                       links=[row["link"] for row in mix]))
  scored.sort(key=lambda e: (round(e["worst_sigma"], 6), round(e["mean_sigma"], 6)))
  return scored
