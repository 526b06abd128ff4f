"""A simulated fleet with planted faults: what each test would take, from the fabric's flow model.

For the unit tests of the schedule and the diagnosis (a planted fault must be named, and nothing else), and for
stating the round count at sizes no lab has (`microbench-doctor --simulate=512`). A pair test's time is its
round's max-min fair flow time on the fabric's links, with a planted part's links scaled down, plus a latency
(and a planted delay, both ways), and its `loss` the share of frames its planted parts drop; a node's scale-up
test is a base time over its planted rate; every time gets multiplicative log-normal noise. Parts are the
fleet's (`h3`, `h3.nic1`, `h3.gpus`, `uplink1`).
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Sequence

from microbench.doctor.survey import SIZES
from microbench.doctor.fleet import Fleet, Test
from microbench.fabric import flows
from microbench.fabric import rates

_PART = re.compile(r"^(h[0-9]+(\.nic[0-9]+|\.gpus)?|uplink[0-9]+)$")
SYNTAX = ("want PART:rate=FRACTION, PART:delay=TIME or PART:loss=PERCENT, PART h<i>, h<i>.nic<r>, h<i>.gpus or"
          " uplink<r>; e.g. h3:rate=0.25, uplink1:rate=0.5, h5:delay=5ms, h2:loss=2%")


@dataclasses.dataclass(frozen=True)
class Fault:
  part: str
  rate: float = 1.0  # fraction of the part's rate left
  delay_s: float = 0.0
  loss: float = 0.0  # fraction of frames dropped


def parse_faults(specs: Sequence[str], fleet: Fleet) -> dict[str, Fault]:
  """`h3:rate=0.25`, `uplink1:rate=0.5`, `h5:delay=5ms` -> faults by part; ValueError, one line."""
  out: dict[str, Fault] = {}
  for spec in specs:
    part, _, rest = spec.strip().partition(":")
    if not _PART.match(part) or not rest:
      raise ValueError(f"bad simulated fault {spec!r}: {SYNTAX}")
    kw = {}
    for item in rest.split(","):
      key, eq, value = item.partition("=")
      try:
        if key == "rate" and eq:
          kw["rate"] = float(value)
          if not 0 < kw["rate"] <= 1:
            raise ValueError
        elif key == "delay" and eq:
          kw["delay_s"] = rates.parse_delay(value) * 1e-6
        elif key == "loss" and eq and value.endswith("%"):
          kw["loss"] = float(value[:-1]) / 100
          if not 0 < kw["loss"] < 1:
            raise ValueError
        else:
          raise ValueError
      except ValueError:
        raise ValueError(f"bad simulated fault {spec!r}: {SYNTAX}") from None
    if part not in known_parts(fleet):
      raise ValueError(f"simulated fault on {part}: the fleet has no such part ({fleet.nodes} nodes,"
                       f" {fleet.rack_count} racks, {fleet.rails} rail(s))")
    out[part] = dataclasses.replace(out.get(part, Fault(part)), **kw)
  return out


def known_parts(fleet: Fleet) -> set[str]:
  out = {fleet.nic(i, r) for i in range(fleet.nodes) for r in range(fleet.rails)}
  out |= {f"h{i}.gpus" for i in range(fleet.nodes)}
  out |= {f"h{i}" for i in range(fleet.nodes)}  # with several rails: all of the node's NICs
  if fleet.rack_count > 1:
    out |= {f"uplink{k}" for k in set(fleet.racks)}
  return out


class SimulatedFleet:
  """`measure` for doctor.run: a round's tests timed on the model with the planted faults."""

  def __init__(self, fleet: Fleet, faults: dict[str, Fault] | None = None, *, noise: float = 0.05,
               seed: int = 0, latency_s: float = 20e-6, nic_gbps: float = 25.0, uplink_gbps: float | None = None,
               sizes: dict[str, int] | None = None):
    self.fleet = fleet
    self.faults = faults or {}
    self.noise = noise
    self.rng = random.Random(seed)
    self.latency_s = latency_s
    fab = fleet.fabric
    self.nic_gbps = fab.nic_gbps if fab is not None and fab.nic_gbps else nic_gbps
    self.uplink_gbps = fab.leaf_up_gbps if fab is not None else uplink_gbps
    self.sizes = dict(sizes or SIZES)
    self.calls = 0

  def _factor(self, part: str) -> Fault:
    """A part's fault; a node-wide fault (`h3`) applies to each of its NICs."""
    own = self.faults.get(part)
    node = self.faults.get(part.split(".")[0]) if ".nic" in part else None
    if own and node:
      return Fault(part, own.rate * node.rate, own.delay_s + node.delay_s, 1 - (1 - own.loss) * (1 - node.loss))
    return own or node or Fault(part)

  def _noisy(self, seconds: float) -> float:
    return seconds * math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else seconds

  def measure(self, tests: Sequence[Test]) -> dict[Test, float]:
    self.calls += 1
    fleet = self.fleet
    out = {}
    p2p = [t for t in tests if t.kind == "p2p"]
    if p2p:
      paths, capacity = fleet.flow_paths(p2p, self.nic_gbps, self.uplink_gbps)
      capacity = {link: c * self._factor(link.split(">")[0]).rate for link, c in capacity.items()}
      keys = list(paths)
      rates_ = flows.max_min_rates({str(i): paths[k] for i, k in enumerate(keys)}, capacity)
      rate_of = {k: rates_[str(i)] for i, k in enumerate(keys)}
      for t in p2p:
        rate = min(rate_of[(t, 0)], rate_of[(t, 1)])
        delay = sum(self._factor(p).delay_s for p in fleet.parts(t)) * 2
        out[t] = self._noisy(self.sizes["p2p"] / rate + self.latency_s + delay)
        kept = 1.0
        for p in fleet.parts(t):
          kept *= 1 - self._factor(p).loss
        out[dataclasses.replace(t, kind="loss")] = (1 - kept) * math.exp(self.rng.gauss(0.0, self.noise))
    for t in tests:
      if t.kind == "all_reduce":
        delay = sum(self._factor(p).delay_s for p in fleet.parts(t)) * 2
        out[t] = self._noisy(self.latency_s + delay)  # small: latency-bound, a slower rate barely shows
      elif t.kind == "scale_up":
        out[t] = self._noisy(1e-3 / self._factor(f"h{t.a}.gpus").rate)
    return out
