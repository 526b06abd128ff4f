"""The doctor's verdict as JSON (`doctor.json`) and a table (`doctor.txt`), and its exit status.

Each named part comes with what was measured through it (the median of its clean slow tests, by kind), what
the fabric model expected of those tests, the fleet's typical figure for them, and the partners it was slow
with; then what could not be resolved, and why. Exit status: 1 when a bad part is named, 3 when something is
slow but could not be pinned to a part, 0 when healthy. A fleet that runs far below the model everywhere is
said in a note (relative judgement cannot see it), without changing the status: the model's assumptions (a
full-duplex swap, links as the only limit) are not every stack's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from microbench.doctor import diagnose
from microbench.doctor.survey import Outcome
from microbench.doctor.fleet import Fleet, median

HEALTHY, FOUND, UNRESOLVED = 0, 1, 3


def exit_status(outcome: Outcome) -> int:
  if outcome.verdict.culprits:
    return FOUND
  if outcome.verdict.unresolved:
    return UNRESOLVED
  return HEALTHY


def fleet_slow(outcome: Outcome, threshold: float | None = None) -> str | None:
  """A line when the fleet's typical p2p time is `threshold` times the model's or more (every part slow, or a
  model that does not describe this machine: relative judgement cannot see it), else None."""
  scale = outcome.scales.get("p2p")
  limit = threshold or diagnose.THRESHOLD
  if scale is None or scale.ratio is None or scale.ratio < limit:
    return None
  return (f"the whole fleet's point-to-point runs at {1 / scale.ratio:.0%} of the fabric model's expectation:"
          f" every link slow, a stack that does not reach the links (gloo swaps one direction at a time), or a"
          f" fabric description that does not match this machine")


def _summary(name: str, rows: Sequence[diagnose.Result], sizes: dict[str, int]) -> list[dict]:
  """Per kind: medians of the evidence's measured, expected and reference times (for `loss`: shares of TCP
  segments resent), as times and, for p2p, GB/s."""
  out = []
  for kind in sorted({r.test.kind for r in rows}):
    mine = [r for r in rows if r.test.kind == kind]
    measured = median([r.measured_s for r in mine])
    expected = [r.expected_s for r in mine if r.expected_s]
    item = dict(kind=kind, tests=len(mine), measured_s=measured, expected_s=median(expected) if expected else None,
                fleet_s=median([r.reference_s for r in mine]), slowness=round(median([r.slowness for r in mine]), 3),
                partners=sorted({x for r in mine for x in r.test.nodes} - _own_nodes(name)))
    if kind == "p2p":
      size = sizes["p2p"]
      item.update(measured_gbps=size / measured / 1e9,
                  expected_gbps=size / item["expected_s"] / 1e9 if item["expected_s"] else None,
                  fleet_gbps=size / item["fleet_s"] / 1e9)
    out.append(item)
  return out


def _own_nodes(name: str) -> set[int]:
  return {int(p[1:].split(".")[0]) for p in name.split("+") if p.startswith("h")}


def to_json(fleet: Fleet, outcome: Outcome, sizes: dict[str, int], settings: dict) -> dict:
  v = outcome.verdict
  return dict(
      status=exit_status(outcome),
      nodes=fleet.nodes, hosts=list(fleet.hosts), racks=list(fleet.racks), rails=fleet.rails,
      fabric=fleet.fabric.describe() if fleet.fabric else None,
      settings=settings, sizes=sizes,
      rounds=dict(survey=outcome.survey_rounds, confirm=outcome.confirm_rounds, total=outcome.rounds),
      seconds=round(outcome.seconds, 3),
      fleet={k: dict(ratio_to_model=s.ratio, typical_s=s.time_s) for k, s in sorted(outcome.scales.items())},
      culprits=[dict(part=name, what=" or ".join(fleet.describe_part(p) for p in name.split("+")),
                     hosts=[fleet.hosts[n] for n in sorted(_own_nodes(name))],  # what a prolog would drain
                     evidence=_summary(name, rows, sizes)) for name, rows in v.culprits.items()],
      unresolved=[dict(part=name, why=why) for name, why in v.unresolved.items()],
      fleet_slow=fleet_slow(outcome),
      unexplained=[r.to_json() for r in v.unexplained],
      notes=outcome.notes,
      results=[r.to_json() for r in outcome.results],
  )


def _time(seconds: float | None) -> str:
  if seconds is None:
    return "-"
  return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def _figure(item: dict, key: str) -> str:
  if item["kind"] == "loss":
    value = item.get(f"{key}_s")
    return "-" if value is None else f"{value:.2%} resent"
  if item["kind"] == "p2p" and item.get(f"{key}_gbps") is not None:
    return f"{item[f'{key}_gbps']:.4g} GB/s"
  return _time(item.get(f"{key}_s"))


def _partners(nodes: Sequence[int], most: int = 6) -> str:
  text = ",".join(f"h{x}" for x in nodes[:most])
  return text + (f" +{len(nodes) - most} more" if len(nodes) > most else "")


def table(doc: dict) -> str:
  """The verdict for people: what was tested, each named part with measured vs expected vs fleet, the rest."""
  lines = [f"microbench-doctor: {doc['nodes']} node(s) in {len(set(doc['racks']))} rack(s), {doc['rails']}"
           f" rail(s); {doc['rounds']['survey']} survey round(s) + {doc['rounds']['confirm']} confirmation"
           f" round(s) in {doc['seconds']:.1f} s"]
  if doc["fabric"]:
    lines.append("expected from: " + "; ".join(doc["fabric"][:2]))
  if doc["culprits"]:
    lines.append("")
    header = f"{'part':<18} {'test':<10} {'measured':>12} {'expected':>12} {'fleet':>12} {'slower':>8}  partners"
    lines += [header, "-" * len(header)]
    for c in doc["culprits"]:
      for item in c["evidence"]:
        lines.append(f"{c['part']:<18} {item['kind']:<10} {_figure(item, 'measured'):>12}"
                     f" {_figure(item, 'expected'):>12} {_figure(item, 'fleet'):>12} {item['slowness']:>7.2f}x"
                     f"  {_partners(item['partners'])}")
    for c in doc["culprits"]:
      lines.append(f"BAD {c['part']}: {c['what']}")
  for u in doc["unresolved"]:
    lines.append(f"UNRESOLVED {u['part']}: {u['why']}")
  if doc["fleet_slow"]:
    lines.append(f"note: {doc['fleet_slow']}")
  if doc["unexplained"]:
    lines.append(f"{len(doc['unexplained'])} slow test(s) through parts cleared elsewhere (noise or an intermittent"
                 f" part): see doctor.json")
  lines += [f"note: {n}" for n in doc["notes"]]
  verdict = {HEALTHY: "healthy: no slow part found", FOUND: f"{len(doc['culprits'])} bad part(s) named",
             UNRESOLVED: "something is slow that could not be pinned to a part"}[doc["status"]]
  lines.append(f"verdict: {verdict} (exit {doc['status']})")
  return "\n".join(lines) + "\n"


def write(out_dir: str, doc: dict) -> tuple[str, str]:
  """doctor.json and doctor.txt into out_dir; OSError is the caller's to report."""
  os.makedirs(out_dir, exist_ok=True)
  json_path, text_path = os.path.join(out_dir, "doctor.json"), os.path.join(out_dir, "doctor.txt")
  with open(json_path, "w", encoding="utf-8") as f:
    json.dump(doc, f, indent=1)
  with open(text_path, "w", encoding="utf-8") as f:
    f.write(table(doc))
  return json_path, text_path
