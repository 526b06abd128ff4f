"""`microbench-doctor`: find the slow node, NIC or uplink of an allocation (flags only; the work is in
microbench.doctor, docs/doctor.md).

  srun --nodes=64 --ntasks-per-node=1 microbench-doctor --distributed --fabric=leonardo --out=doctor
  microbench-testbed --hosts=8 --racks=4 --host_rate=200mbit --fault=h3:rate=0.25 -- microbench-doctor
  microbench-doctor --simulate=512 --nodes_per_rack=32 --fault=h100:rate=0.25    # the schedule, no JAX

Exit status: 0 healthy, 1 a bad part named, 3 something slow that could not be pinned to a part, 2 bad flags.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app, flags

from microbench.cli import absl_app, cluster_flags, store_flags
from microbench.bench import sizes
from microbench.doctor import diagnose, pair_rounds, survey, verdict
from microbench.fabric import description as fd

FLAGS = flags.FLAGS
flags.DEFINE_string("fabric", None, "The machine the expectation comes from: a described system (leonardo, lumi,"
                    " alps, jupiter, dgx, nvl72, with options) or testbed:racks=R,hosts_per_rack=H,host_rate=...,"
                    "uplink_rate=...; none: the fleet is its own reference. Default: the emulated cluster's own"
                    " description on testbed hosts, else none.")
flags.DEFINE_string("out", None, "Output folder for doctor.json and doctor.txt. Default: runs/doctor_<UTC time>.")
flags.DEFINE_float("threshold", diagnose.THRESHOLD, "A test is slow at this many times its reference (the model's"
                   " expectation scaled by the fleet's typical ratio to it, or the fleet's typical time).")
flags.DEFINE_integer("survey_rounds", pair_rounds.SURVEY_ROUNDS, "Round-robin rounds of disjoint pairs (fewer when a"
                     " full round robin is shorter).", lower_bound=1)
flags.DEFINE_integer("confirm_rounds", survey.CONFIRM_ROUNDS, "Most confirmation rounds on the suspects.",
                     lower_bound=0)
flags.DEFINE_string("p2p_bytes", "auto", "Bytes each rank sends in the point-to-point swap; auto (or 0): 1M, or 10 ms"
                    " at the fabric's NIC rate where that is more (bandwidth-bound: 128M on 12.5 GB/s NICs).")
flags.DEFINE_string("all_reduce_bytes", "4K", "Bytes per rank of the small (latency-bound) pair all-reduce.")
flags.DEFINE_string("scale_up_bytes", "1M", "Bytes per device of the all-reduce inside each node.")
flags.DEFINE_integer("samples", 5, "Timed calls per program (their median counts).", lower_bound=1)
flags.DEFINE_integer("warmup", 1, "Untimed calls per program first.", lower_bound=0)
flags.DEFINE_integer("reps", 1, "Operations per call, back to back (raise it on GPUs, where one operation is"
                     " microseconds).", lower_bound=1)
flags.DEFINE_integer("simulate", None, "Simulate a fleet of this many nodes (pure Python, no JAX): the schedule and"
                     " the diagnosis on the fabric model with --fault planted; prints the rounds it took.",
                     lower_bound=2)
flags.DEFINE_multi_string("fault", [], "--simulate only: a planted fault, PART:rate=FRACTION, PART:delay=TIME or"
                          " PART:loss=PERCENT, PART h<i>, h<i>.nic<r>, h<i>.gpus or uplink<r> (repeatable; on the"
                          " emulated cluster: microbench-testbed --fault).")
flags.DEFINE_float("noise", 0.05, "--simulate only: log-normal noise (sigma) on every simulated time.", lower_bound=0)
flags.DEFINE_integer("seed", 0, "--simulate only: the noise's seed.")

NAME = "microbench-doctor"
SIMULATE_ONLY = ("fault", "noise", "seed")


def say(msg: str) -> None:
  print(f"{NAME}: {msg}", file=sys.stderr, flush=True)


def _settings() -> survey.Settings:
  sized = []
  for kind in ("p2p", "all_reduce", "scale_up"):
    text = FLAGS[f"{kind}_bytes"].value
    if kind == "p2p" and text == "auto":
      sized.append((kind, 0))  # chosen once the fabric is known (fleet.auto_p2p_bytes)
      continue
    try:
      sized.append((kind, sizes.parse_size(text)))
    except ValueError as e:
      raise app.UsageError(f"--{kind}_bytes: {e}") from None
  try:
    return survey.check(survey.Settings(threshold=FLAGS.threshold, survey_rounds=FLAGS.survey_rounds,
                                        confirm_rounds=FLAGS.confirm_rounds, sizes=tuple(sized)))
  except survey.SettingsError as e:
    raise app.UsageError(str(e)) from None


def _fabric() -> fd.Fabric | None:
  if not FLAGS.fabric or FLAGS.fabric == "none":
    return None
  try:
    return fd.parse(FLAGS.fabric)
  except fd.FabricError as e:
    raise app.UsageError(str(e)) from None


def _simulate(settings: survey.Settings) -> int:
  from microbench.doctor import fleet as fleet_mod, simulate  # pylint: disable=g-import-not-at-top
  fab = _fabric()
  per = FLAGS.nodes_per_rack or (fab.nodes_per_leaf if fab else FLAGS.simulate)
  gpus = fab.gpus_per_node if fab else 1  # one process per node driving all its GPUs: a rail per NIC
  fleet = fleet_mod.Fleet.dense(FLAGS.simulate, per, fabric=fab, rails=fleet_mod.rails_for(fab, gpus),
                                gpus_per_node=gpus)
  sized = dict(settings.sizes)
  sized["p2p"] = sized["p2p"] or fleet_mod.auto_p2p_bytes(fab)
  settings = dataclasses.replace(settings, sizes=tuple(sized.items()))
  try:
    faults = simulate.parse_faults(FLAGS.fault, fleet)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  sim = simulate.SimulatedFleet(fleet, faults, noise=FLAGS.noise, seed=FLAGS.seed, sizes=dict(settings.sizes))
  outcome = survey.run(fleet, sim.measure, settings)
  outcome.notes.append(f"simulated: {len(faults)} planted fault(s) ({', '.join(faults) or 'none'}), noise"
                       f" {FLAGS.noise:g}, seed {FLAGS.seed}; a full round robin would take"
                       f" {pair_rounds.full_round_count(fleet.nodes)} rounds")
  doc = verdict.to_json(fleet, outcome, dict(settings.sizes), dict(threshold=settings.threshold,
                       survey_rounds=settings.survey_rounds, confirm_rounds=settings.confirm_rounds, simulated=True))
  if FLAGS.out:
    try:
      verdict.write(FLAGS.out, doc)
    except OSError as e:
      raise app.UsageError(f"cannot write --out={FLAGS.out}: {e.strerror}") from None
  print(verdict.table(doc), end="")
  store_flags.record(FLAGS.out)
  return verdict.exit_status(outcome)


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
  settings = _settings()
  if FLAGS.simulate:
    if FLAGS.distributed:
      raise app.UsageError("--simulate runs no job: drop --distributed")
    return _simulate(settings)
  given = [f"--{n}" for n in SIMULATE_ONLY if FLAGS[n].present]
  if given:
    raise app.UsageError(f"{', '.join(given)} only with --simulate (plant faults on the testbed with"
                         f" microbench-testbed --fault)")
  _fabric()
  cluster_flags.refuse_with_target(("fabric",))
  if FLAGS.target:
    raise app.UsageError("--target compiles without running; the doctor has to run on the allocation")
  from microbench.doctor import job  # pylint: disable=g-import-not-at-top
  out_dir = FLAGS.out or job.default_out_dir()
  try:
    return job.run(cluster_flags.settings(), settings, dict(samples=FLAGS.samples, warmup=FLAGS.warmup,
                   reps=FLAGS.reps), FLAGS.fabric, FLAGS.nodes_per_rack, out_dir, say)
  except job.JobError as e:
    raise app.UsageError(str(e)) from None
  finally:
    store_flags.record(out_dir if os.path.exists(os.path.join(out_dir, "doctor.json")) else None)


def run() -> None:
  """Console-script entry point."""
  absl_app.run(main, NAME, [__name__, cluster_flags.__name__, store_flags.__name__])


if __name__ == "__main__":
  run()
