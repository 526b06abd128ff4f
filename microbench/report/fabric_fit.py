"""A fabric's levels fitted from a sweep: each series' alpha-beta fit turned into the rate and hop latency of
the level its groups cross, so predictions for other group shapes start from what this machine measured.

Which level a scope measures comes from the run's meta.json: groups inside a node (`gpu` axis) measure
scale_up; groups across nodes of one rack measure the NICs (scale_out is one rail: one GPU and one NIC per
node); groups across racks measure the leaf uplinks. The rate is the fit's asymptotic busbw (a ring's busbw
is the slowest link it crosses), the hop latency the fit's alpha over the ring's steps (a hop across racks
is the uplink level's own, `Fabric.uplink_hop_us`). All-reduce fits are preferred (the collective every
model is about); a level no series measured keeps its described rate.

An uplink's rate is taken from a ring of 3 or more ranks before a 2-rank group: two ranks are each other's only
neighbours, so each direction of the path carries one transfer's data and the acknowledgements of the transfer
coming back. Where those share a queue behind a remote bottleneck (TCP through the emulated cluster's per-pair
queues) the pair gets 73-83% of the uplink while rings over the same uplinks get 95%, and a fit from the pair
predicted every cross-rack ring 17-19% too slow (docs/fabric.md, "Fitting the uplinks").
"""

from __future__ import annotations

from collections.abc import Sequence

from microbench.fabric.description import LEVELS, Fabric, FabricError
from microbench.output import run_folder
from microbench.report import alpha_beta
from microbench.report.alpha_beta import Fit

PREFERRED = ("all_reduce", "all_gather", "reduce_scatter")
PAIR_SHY = ("leaf_up", "group_up")  # levels whose rate is taken from a ring before a 2-rank exchange


def level_of(scope: str, meta: dict) -> str | None:
  """The fabric level a scope's groups cross last (the one its ring's busbw measures)."""
  info = (meta.get("scopes") or {}).get(scope) or {}
  axes = set(info.get("axes") or ())
  topo = meta.get("topology") or {}
  if not axes or info.get("skipped"):
    return None
  if "rack" in axes and topo.get("racks", 1) > 1:
    return "leaf_up"
  if "node" in axes and topo.get("nodes", 1) > 1:
    return "nic" if axes != {"node", "gpu"} or topo.get("gpus", 1) == 1 else None  # rack_scale mixes levels
  if axes == {"gpu"} and topo.get("gpus", 1) > 1:
    return "scale_up"
  return None


def _rate_ok(f: Fit) -> bool:
  return f.busbw_beta_gbps is not None and f.bandwidth_poor() is None and not (
      f.r2 is not None and f.r2 < alpha_beta.POOR_R2)


def _hop_ok(f: Fit) -> bool:
  """A two-regime fit's latency stands on its own points; a one-line fit's alpha only when the line is good."""
  if f.alpha_per_step_us is None:
    return False
  return f.latency_poor() is None if f.latency_points else f.poor() is None


def pair_exchange(f: Fit, level: str) -> bool:
  """A 2-rank group across uplinks: not how a ring loads them (module docstring)."""
  return level in PAIR_SHY and f.group_size == 2


def _best(fits: Sequence[Fit], meta: dict, ok, shun_pairs: bool = False) -> dict[str, Fit]:
  """Per level the preferred good fit: (with `shun_pairs`) a ring over a 2-rank exchange, then all-reduce over
  all-gather over reduce-scatter, then the larger group."""
  chosen: dict[str, tuple[tuple, Fit]] = {}
  for f in fits:
    level = level_of(f.scope, meta)
    if level is None or f.collective not in PREFERRED or not ok(f):
      continue
    rank = (shun_pairs and pair_exchange(f, level), PREFERRED.index(f.collective), -f.group_size)
    if level not in chosen or rank < chosen[level][0]:
      chosen[level] = (rank, f)
  return {level: f for level, (_, f) in chosen.items()}


def fit_levels(fab: Fabric, fits: Sequence[Fit], meta: dict) -> tuple[Fabric, list[str]]:
  """`fab` with every level a good fit measured replaced by the fit: its rate from a fit whose bandwidth is
  good, its hop latency from one whose latency is good (a two-regime fit can have one and not the other);
  notes say what came from where."""
  rates, hops = _best(fits, meta, _rate_ok, shun_pairs=True), _best(fits, meta, _hop_ok)
  notes = []
  for level in [lv for lv in LEVELS if lv in rates or lv in hops]:
    r, h = rates.get(level), hops.get(level)
    fab = fab.fitted(level, gbps=r.busbw_beta_gbps if r else None, hop_us=h.alpha_per_step_us if h else None)
    parts = []
    if r:
      parts.append(f"{r.busbw_beta_gbps:.4g} GB/s from {r.collective} over {r.scope} ({r.group_size} ranks,"
                   f" {r.dtype})")
    if h:
      src = "" if h is r else f" from {h.collective} over {h.scope} ({h.group_size} ranks, {h.dtype})"
      parts.append(f"hop {h.alpha_per_step_us or 0:.3g} us{src}"
                   + (f" ({h.latency_points} latency-bound sizes)" if h.latency_points else ""))
    if r and pair_exchange(r, level):
      parts.append("from a 2-rank exchange, which can underuse an uplink that rings fill (TCP on the emulated"
                   " cluster: ~82%); fit it from 2 or more nodes per rack")
    kept = [] if r else ["rate as described (no good bandwidth fit)"]
    kept += [] if h else ["hop as described (no good latency fit)"]
    notes.append(f"{level} fitted: {', '.join(parts + kept)}")
  poor = sorted({f"{f.scope} ({f.collective}: {f.poor()})" for f in fits if f.poor() and f.collective in PREFERRED})
  if poor:
    notes.append(f"series with a poor fit (only their good regime used): {'; '.join(poor)}")
  return fab, notes


def fit_from_run(fab: Fabric, run_dir: str) -> tuple[Fabric, list[str]]:
  """`fab` with the levels `run_dir`'s sweep measured fitted; FabricError (one line) when it holds no sweep
  or no series with a good fit of a level."""
  meta = run_folder.read_meta(run_dir)
  if not meta:
    raise FabricError(f"--fit_from={run_dir}: no meta.json there (not a sweep's run folder)")
  fits = alpha_beta.read_model(run_dir)
  if fits is None:
    fits = alpha_beta.fit_run(run_folder.read_results(run_dir))
  fab, notes = fit_levels(fab, fits, meta)
  if not any(" fitted: " in n for n in notes):
    raise FabricError(f"--fit_from={run_dir}: no series there measures a level of the fabric with a good"
                      " all-reduce, all-gather or reduce-scatter fit (of its bandwidth or its latency)")
  return fab, notes
