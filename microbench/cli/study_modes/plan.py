"""job mixes for a machine, one JSON each (the placer's nodes for every job).

  microbench-study plan --machine=leonardo --patterns=A,E --out=plan/
  microbench-study plan --machine=testbed:racks=4,hosts_per_rack=2 --jobs=dp@0,2 --jobs=dp@1,3 --out=plan/
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

from microbench.cli.study_modes import common
from microbench.study import generator, machines, workloads

FLAGS = flags.FLAGS
say = common.say

common.define_machine()
flags.DEFINE_string("out", None, "The plan's folder (required).")
flags.DEFINE_string("slurm_topology", None, "Plan inside a SLURM allocation: `auto` reads `scontrol show "
                    "topology`, or a topology.conf path; the allocation's hosts (SLURM_JOB_NODELIST) and their "
                    "switches become the machine's nodes (leaf switch = L1, its parent = group).")
flags.DEFINE_list("patterns", ["A", "E"], "Allocation pattern families (A equal split, E stochastic tiers; "
                  "B geometric, C hierarchical, D power law).")
flags.DEFINE_float("rho_min", 0.8, "Lowest utilisation (share of the machine's GPUs allocated).")
flags.DEFINE_float("rho_max", 1.0, "Highest utilisation.")
flags.DEFINE_integer("rho_steps", 1, "Utilisations from rho_min to rho_max (1: rho_max only).", lower_bound=1)
flags.DEFINE_integer("size_divisor", 1, "Divide the study's job sizes by this for small machines.", lower_bound=1)
flags.DEFINE_list("strategies", None, "Strategies to mix (default: all five).")
flags.DEFINE_integer("gpus", None, "The design's GPUs (the artifact's -G; default: the machine's; spare nodes are "
                     "room for the placer).", lower_bound=1)
flags.DEFINE_integer("g_min", None, "Smallest job in GPUs (default: the study's max(8, 2 q1), scaled).",
                     lower_bound=1)
flags.DEFINE_integer("k_max", None, "Most jobs in a mix (default: GPUs / g_min).", lower_bound=2)
flags.DEFINE_integer("stochastic_patterns", 3, "Pattern-E mixes per utilisation.", lower_bound=0)
flags.DEFINE_integer("samples_per_bin", 4, "Strategy labellings per entropy bin and pattern.", lower_bound=1)
flags.DEFINE_integer("placement_samples_per_bin", 1, "Placement vectors per locality bin and labelling.",
                     lower_bound=1)
flags.DEFINE_integer("enum_threshold", 5000, "Enumerate labellings up to this many, else rejection-sample.",
                     lower_bound=1)
flags.DEFINE_float("placement_med_hi", 2.33, "Locality score between the medium and high bins (the study's runs "
                   "used 2.55 and 2.35).")
flags.DEFINE_integer("max_experiments", None, "Keep at most this many experiments (the 3x3 placement x entropy "
                     "grid is interleaved first, so a prefix covers it).", lower_bound=1)
flags.DEFINE_integer("seed", 42, "Seed of every random choice (same seed, same plan).")
flags.DEFINE_list("derive", None, "STRATEGY=MODEL pairs (e.g. fsdp=llama3-8b,dp=vit-h14): that strategy's jobs run "
                  "proxies derived from microbench-train's step of MODEL (see `schedule --proxy_from`).")
flags.DEFINE_multi_string("jobs", None, "A hand-written mix instead of a generated one, one flag per job: "
                          "STRATEGY[:MODEL]@NODES, e.g. dp@0,2 (GPUs = nodes x GPUs per node).")


def main(argv: list[str]) -> int:
  del argv
  if not FLAGS.out:
    raise app.UsageError("--out=FOLDER is required (the plan's folder)")
  try:
    machine = machines.parse(FLAGS.machine, FLAGS.node_map, _allocation_layout() if FLAGS.slurm_topology else None)
    settings = generator.Settings(
        machine, patterns=tuple(p.strip().upper() for p in FLAGS.patterns), rho_min=FLAGS.rho_min,
        rho_max=FLAGS.rho_max, rho_steps=FLAGS.rho_steps, size_divisor=FLAGS.size_divisor,
        strategies=tuple(FLAGS.strategies or workloads.STRATEGIES), g_min=FLAGS.g_min, k_max=FLAGS.k_max,
        n_stochastic=FLAGS.stochastic_patterns, n_per_bin=FLAGS.samples_per_bin,
        n_placement_per_bin=FLAGS.placement_samples_per_bin, enum_threshold=FLAGS.enum_threshold,
        placement_cuts=(1.67, FLAGS.placement_med_hi), max_experiments=FLAGS.max_experiments, seed=FLAGS.seed,
        gpus=FLAGS.gpus)
    if FLAGS.jobs:
      experiments, dropped = [generator.manual(machine, [_job_spec(j) for j in FLAGS.jobs])], {}
    else:
      experiments, dropped = generator.generate(settings)
  except (machines.MachineError, generator.PlanError, workloads.WorkloadError) as e:
    raise app.UsageError(str(e)) from None
  if not experiments:
    say(f"no experiment fits this machine and these settings (dropped: {dropped}); nothing written")
    return 1
  if FLAGS.derive:
    _use_derived(experiments)
  path = generator.write(FLAGS.out, settings, experiments, dropped, " ".join(sys.argv))
  say(f"{len(experiments)} experiment(s) for {machine.name} ({machine.total_gpus} GPUs) -> {path}")
  for e in experiments:
    jobs = " ".join(f"{j['strategy']}x{j['gpus']}@{j['placement_class']}" for j in e["jobs"])
    print(f"{e['id']}  {e['pattern']['id']:7s} H={e['entropy_bin']:6s} P={e['placement_bin']:6s}  {jobs}")
  tiers = {t: n for t, n in json.load(open(path, encoding="utf-8"))["placement"]["tiers"].items() if n}
  if tiers:
    say(f"placer tiers (experiments): {tiers}; every job records requested_class, placement_class (what its"
        " nodes form) and fallback")
  return 0


def _allocation_layout() -> tuple:
  """The current SLURM allocation's hosts, in order, with their switches (--slurm_topology)."""
  nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
  if not nodelist:
    raise machines.MachineError("--slurm_topology plans inside an allocation, but SLURM_JOB_NODELIST is not set")
  try:
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           check=True).stdout.split()
    if FLAGS.slurm_topology == "auto":
      text = subprocess.run(["scontrol", "show", "topology"], capture_output=True, text=True, check=True).stdout
    else:
      with open(FLAGS.slurm_topology, encoding="utf-8") as f:
        text = f.read()
  except (OSError, subprocess.CalledProcessError) as e:
    raise machines.MachineError(f"cannot read the allocation's topology: {e}") from None
  return machines.allocation_layout(hosts, machines.read_slurm_topology(text))


def _use_derived(experiments: list[dict]) -> None:
  """--derive: jobs of the named strategies get `proxy_from` (their model becomes the training model's). Imported
  here: step_collectives and the models import JAX, which a plan without --derive never needs."""
  from microbench.models import ModelError, get_model  # pylint: disable=g-import-not-at-top
  from microbench.study import step_collectives  # pylint: disable=g-import-not-at-top
  mapping = {}
  for item in FLAGS.derive:
    strategy, eq, model = item.partition("=")
    try:
      family, size, strategy = step_collectives.parse_proxy_from(f"{model},{strategy}")
      get_model(family, size)
    except (ValueError, ModelError) as e:
      raise app.UsageError(f"--derive={item}: {e}" if eq else f"--derive={item}: want STRATEGY=MODEL") from None
    mapping[strategy] = model
  for e in experiments:
    for job in e["jobs"]:
      if job["strategy"] in mapping:
        try:
          step_collectives.training_parallelism(job["strategy"], job["gpus"])
        except ValueError as err:
          raise app.UsageError(str(err)) from None
        job["model"] = mapping[job["strategy"]]
        job["proxy_from"] = f"{mapping[job['strategy']]},{job['strategy']}"


def _job_spec(text: str) -> tuple[str, str | None, list[int]]:
  head, at, nodes = text.partition("@")
  strategy, _, model = head.partition(":")
  node_list: list[int] = []
  try:
    for part in filter(None, (p.strip() for p in nodes.split(","))):
      lo, dash, hi = part.partition("-")
      node_list += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
  except ValueError:
    node_list = []
  if not at or not node_list:
    raise app.UsageError(f"--jobs={text!r}: want STRATEGY[:MODEL]@NODES, e.g. dp@0,2 or fsdp:llama3-8b@0-3")
  return strategy, model or None, node_list
