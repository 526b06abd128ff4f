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


@dataclasses.dataclass(frozen=True)
class Flow:
  name: str
  links: tuple[str, ...]  # every link it crosses, each with a capacity in the model (bytes per second)
  size: float  # bytes
  start: float = 0.0  # seconds


def max_min_rates(paths: Mapping[str, Sequence[str]], capacity: Mapping[str, float]) -> dict[str, float]:
  """Max-min fair rate of each flow (name -> the links it crosses) on links of the given capacities."""
  rates: dict[str, float] = {}
  left = dict(capacity)
  active = {f: tuple(p) for f, p in paths.items()}
  for f, p in active.items():
    missing = [x for x in p if x not in capacity]
    if missing:
      raise ValueError(f"flow {f} crosses links with no capacity: {', '.join(missing)}")
  unconstrained = [f for f, p in active.items() if not p]
  if unconstrained:
    raise ValueError(f"flows cross no link (their rate is unbounded): {', '.join(unconstrained)}")
  while active:
    users: dict[str, list[str]] = {}
    for f, p in active.items():
      for x in p:
        users.setdefault(x, []).append(f)
    # The link that saturates first at an equal increment for all its flows.
    link = min(users, key=lambda x: left[x] / len(users[x]))
    share = left[link] / len(users[link])
    for f in users[link]:
      rates[f] = share
      for x in active.pop(f):
        left[x] -= share
  return rates


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
      if remaining[f] <= EPS * max(1.0, rates[f]):
        done[f] = now
        del remaining[f], paths[f]
  return done
