"""a plan's baselines and concurrent mixes on local processes, the emulated cluster or SLURM.

  microbench-study run --plan=plan/ --backend=testbed|local|slurm --out=res/ [--resume]
"""

from __future__ import annotations

from absl import app, flags

from microbench.cli import store_flags
from microbench.cli.study_modes import common
from microbench.study import run_plan

FLAGS = flags.FLAGS
say = common.say

common.define_backend()
common.define_scales()
common.define_dtype()
common.define_compute()
flags.DEFINE_string("plan", None, "The plan folder written by `plan` (required).")
flags.DEFINE_string("out", None, "The results folder (required).")
flags.DEFINE_bool("resume", False, "Continue the study in --out (same settings), skipping finished units.")
flags.DEFINE_integer("iters", None, "Timed iterations per job instance (default: the study's runs per strategy).",
                     lower_bound=1)
flags.DEFINE_integer("warmup", None, "Untimed first iterations per job instance (default: the study's, 1; a "
                     "baseline then times its warm-up too, as the artifact's).", lower_bound=0)
flags.DEFINE_integer("baseline_repeats", 1, "Baseline runs per matching key.", lower_bound=1)
flags.DEFINE_integer("small_job_threshold", None, "Jobs with fewer GPUs are small (respawned until every large job "
                     "has finished once); unset, as the artifact: every job is small, so a mix runs for the whole "
                     "--walltime; 1: every job is large (a mix ends once each job has run). The study used 512 on "
                     "Leonardo.", lower_bound=0)
flags.DEFINE_float("walltime", 200, "Seconds a unit may take before the kill sequence (the artifact's 200).",
                   lower_bound=1)
flags.DEFINE_integer("max_failures", 3, "Failed runs in a row after which a job fails its unit.", lower_bound=1)
flags.DEFINE_list("experiments", None, "Only these experiment ids (default: all).")
flags.DEFINE_bool("baselines", True, "Run the baselines (--nobaselines: concurrent runs only).")


def settings() -> run_plan.RunSettings:
  return run_plan.RunSettings(
      plan_dir=FLAGS.plan, out_dir=FLAGS.out, backend=FLAGS.backend, compute=FLAGS.compute,
      compute_scale=FLAGS.compute_scale, bytes_scale=FLAGS.bytes_scale, iters=FLAGS.iters, warmup=FLAGS.warmup,
      baseline_repeats=FLAGS.baseline_repeats,
      small_job_threshold=run_plan.ALL_SMALL if FLAGS.small_job_threshold is None else FLAGS.small_job_threshold,
      walltime=FLAGS.walltime, grace=FLAGS.grace, max_failures=FLAGS.max_failures, dtype=FLAGS.proxy_dtype,
      experiments=tuple(FLAGS.experiments or ()), baselines=FLAGS.baselines)


def main(argv: list[str]) -> int:
  del argv
  if not FLAGS.plan or not FLAGS.out:
    raise app.UsageError("--plan=PLAN_FOLDER and --out=RESULTS_FOLDER are required")
  s = settings()
  try:
    _, experiments, machine = run_plan.prepare(s, FLAGS.resume)
    unknown = set(s.experiments) - {e["id"] for e in experiments}
    if unknown:
      raise app.UsageError(f"--experiments: {', '.join(sorted(unknown))} not in the plan")
  except run_plan.RunError as e:
    raise app.UsageError(str(e)) from None
  rc, records = common.on_backend(machine, lambda backend: run_plan.run(s, backend, machine, experiments, say=say),
                                  f"; `run --resume --out={FLAGS.out} --plan={FLAGS.plan}` continues")
  store_flags.record(FLAGS.out)  # finished or stopped: the units done so far are kept
  if rc:
    return rc
  failed = [r["unit"] for r in records if r["status"] != "done"]
  if failed:
    say(f"{len(failed)} unit(s) failed: {', '.join(failed)}; `run --resume` runs them again")
  say(f"results in {FLAGS.out}; `{common.NAME} report --results={FLAGS.out}` summarises them")
  return 1 if failed else 0
