"""Flows sharing links: max-min fair rates, and the finish times of flows that start at different moments.

The flow-level model congestion studies use (and that TCP or InfiniBand's credit flow control approach on
long transfers): every active flow crossing a link gets an equal share of it, except that a flow held back
elsewhere leaves its unused share to the others (progressive filling). Between two events (a flow starting
or finishing) rates are constant, so finish times are exact under the model: no time step to tune.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

EPS = 1e-12
TIME_EPS = 1e-9  # seconds: a flow this close to its end is done (float error must not add events)


@dataclasses.dataclass(frozen=True)
class Flow:
  name: str
  links: tuple[str, ...]  # every link it crosses, each with a capacity in the model (bytes per second)
  size: float  # bytes
  start: float = 0.0  # seconds


def max_min_rates(paths: Mapping[str, Sequence[str]], capacity: Mapping[str, float]) -> dict[str, float]:
  """Max-min fair rate of each flow (name -> the links it crosses) on links of the given capacities."""
  bundles: dict[tuple[str, ...], list[str]] = {}  # flows with the same path get the same rate: solved once
  for f, p in paths.items():
    p = tuple(p)
    if not p:
      raise ValueError(f"flows cross no link (their rate is unbounded): {f}")
    missing = [x for x in p if x not in capacity]
    if missing:
      raise ValueError(f"flow {f} crosses links with no capacity: {', '.join(missing)}")
    bundles.setdefault(p, []).append(f)
  rate_of = path_rates({p: len(fs) for p, fs in bundles.items()}, capacity)
  return {f: rate_of[p] for p, fs in bundles.items() for f in fs}


def path_rates(counts: Mapping[tuple[str, ...], int], capacity: Mapping[str, float]) -> dict[tuple[str, ...], float]:
  """Max-min fair rate of one flow on each path, `counts[path]` flows following it (progressive filling)."""
  left = {x: capacity[x] for p in counts for x in p}
  active = dict(counts)
  rate_of: dict[tuple[str, ...], float] = {}
  while active:
    users: dict[str, int] = {}
    for p, count in active.items():
      for x in p:
        users[x] = users.get(x, 0) + count
    # The link that saturates first when every flow still growing gets the same increment.
    link = min(users, key=lambda x: left[x] / users[x])
    share = left[link] / users[link]
    for p in [p for p in active if link in p]:
      rate_of[p] = share
      for x in p:
        left[x] -= share * active[p]
      del active[p]
  return rate_of


def simulate(flows: Sequence[Flow], capacity: Mapping[str, float]) -> dict[str, float]:
  """Finish time of each flow when they share `capacity` max-min fairly from their start times on."""
  pending = sorted(flows, key=lambda f: f.start)
  remaining: dict[str, float] = {}
  paths: dict[str, tuple[str, ...]] = {}
  done: dict[str, float] = {}
  now = 0.0
  while pending or remaining:
    while pending and pending[0].start <= now + EPS:
      f = pending.pop(0)
      if f.size <= 0:
        done[f.name] = max(now, f.start)
        continue
      remaining[f.name], paths[f.name] = f.size, f.links
    if not remaining:
      now = pending[0].start
      continue
    rates = max_min_rates({f: paths[f] for f in remaining}, capacity)
    finish = min(remaining[f] / rates[f] for f in remaining)
    step = finish if not pending else min(finish, pending[0].start - now)
    now += step
    for f in list(remaining):
      remaining[f] -= rates[f] * step
      if remaining[f] <= rates[f] * TIME_EPS:
        done[f] = now
        del remaining[f], paths[f]
  return done
