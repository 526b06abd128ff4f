"""The doctor as a multi-process job: start-up, the fleet from the processes, the loop, the outputs.

One process per node (as the testbed and `srun --ntasks-per-node=1` start it): node i is process i. The racks
and the expectation come from, in order: `nodes_per_rack`, the emulated cluster's own description when the
nodes are testbed hosts (its state file names their racks and healthy link rates), the fabric's leaves. The
fabric (`--fabric`) is what each test is expected to take; without one the fleet is its own reference.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable

from microbench.cluster import distributed
from microbench.cluster import testbed as tbm
from microbench.doctor import survey, verdict
from microbench.doctor.fleet import Fleet, auto_p2p_bytes, racks_from_fabric, rails_for
from microbench.fabric import description as fd
from microbench.fabric import rates
from microbench.output import run_folder

_TESTBED_HOST = re.compile(r"^(tb[0-9a-z]{1,12})-h([0-9]+)$")


class JobError(ValueError):
  """The job cannot be diagnosed as started (one line: what is wrong, what is allowed)."""


def testbed_layout(hosts: list[str]) -> tuple[tuple[int, ...], fd.Fabric] | None:
  """Racks and healthy fabric of testbed hosts, from the testbed's state file (None: not testbed hosts, or no
  state readable). The planted faults are left out: the expectation is the healthy design's."""
  found = [_TESTBED_HOST.match(h) for h in hosts]
  if not all(found) or len({m.group(1) for m in found}) != 1:
    return None
  try:
    bed = tbm.Testbed.load(tbm.state_path_for(found[0].group(1)))
  except (tbm.TestbedError, ValueError, TypeError):
    return None
  racks = tuple(bed.rack_of(int(m.group(2))) for m in found)
  gbps = lambda bits: rates.gbytes_per_s(bits) if bits else None  # noqa: E731
  fab = fd.testbed(bed.hosts // bed.racks, gbps(bed.host_rate), gbps(bed.uplink_rate) if bed.racks > 1 else None,
                   racks=bed.racks, queue=bed.queue)
  return racks, fab


def build_fleet(hosts: list[str], local_devices: int, fabric: fd.Fabric | None,
                nodes_per_rack: int | None) -> tuple[Fleet, list[str]]:
  """The fleet and notes on how it was read."""
  notes = []
  racks = None
  if fabric is None:
    layout = testbed_layout(hosts)
    if layout:
      racks, fabric = layout
      notes.append("racks and link rates from the emulated cluster's description")
  if nodes_per_rack:
    racks = tuple(i // nodes_per_rack for i in range(len(hosts)))
  if racks is None:
    racks = racks_from_fabric(fabric, len(hosts))
  rails = rails_for(fabric, local_devices)
  if rails == 1:
    nics = fabric.nics_per_node if fabric else 1
    notes.append("one rail: each node's network tested as one link" if nics <= 1 else
                 f"one rail tested: the fabric has {nics} NICs per node but each process drives {local_devices}"
                 f" device(s), too few to drive one per NIC")
  else:
    notes.append(f"{rails} rails: device r of each node against device r of its partner, one rail at a time")
  return Fleet(tuple(hosts), racks, rails, local_devices, fabric), notes


def run(settings: distributed.Settings, doctor_settings: survey.Settings, plan_samples: dict, fabric_spec: str | None,
        nodes_per_rack: int | None, out_dir: str, say: Callable[[str], None]) -> int:
  """The whole job; returns the exit status (verdict.exit_status). JobError for a job it cannot diagnose."""
  distributed.initialize(settings)
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from microbench.doctor import measure  # pylint: disable=g-import-not-at-top

  hosts = distributed.process_hosts()
  if len(set(hosts)) != len(hosts):
    raise JobError(f"{len(hosts)} processes on {len(set(hosts))} host(s): the doctor runs one process per node"
                   f" (srun --ntasks-per-node=1, or one per testbed host)")
  fabric = fd.parse(fabric_spec) if fabric_spec and fabric_spec != "none" else None
  local = jax.local_device_count()
  fleet, notes = build_fleet(hosts, local, fabric, nodes_per_rack)
  scale_up = local > 1
  if not scale_up:
    notes.append("scale-up skipped: one device per process (nothing inside a node to test)")
  sizes = dict(doctor_settings.sizes)
  if not sizes["p2p"]:
    sizes["p2p"] = auto_p2p_bytes(fleet.fabric)
  ds = dataclasses.replace(doctor_settings, scale_up=scale_up and doctor_settings.scale_up,
                           sizes=tuple(sizes.items()))
  plan = measure.Plan(sizes=dict(ds.sizes), **plan_samples)
  me = jax.process_index()
  outcome = survey.run(fleet, lambda tests: measure.run_group(tests, plan), ds,
                       say=say if me == 0 else (lambda s: None))
  outcome.notes[:0] = notes
  for line in measure.WRONG:
    say(f"WRONG RESULT on process {me}: {line}")
  status = verdict.exit_status(outcome)
  problem = None
  if me == 0:
    doc = verdict.to_json(fleet, outcome, dict(ds.sizes), dict(threshold=ds.threshold,
                         survey_rounds=ds.survey_rounds, confirm_rounds=ds.confirm_rounds, **plan_samples))
    print(verdict.table(doc), end="", flush=True)
    try:
      json_path, _ = verdict.write(out_dir, doc)
      say(f"wrote {json_path} and doctor.txt")
    except OSError as e:
      problem = f"cannot write the verdict to {out_dir}: {e.strerror}"
  # Every process exits with the verdict's status; none before process 0 has written it (a launcher that stops
  # a job when one process exits non-zero would otherwise stop process 0 mid-write).
  multihost_utils.sync_global_devices("doctor-written")
  if problem:
    raise JobError(problem)
  return status


def default_out_dir() -> str:
  return os.path.join("runs", run_folder.default_name("doctor"))
