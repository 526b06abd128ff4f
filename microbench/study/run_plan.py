"""Runs a plan: baselines (each job alone on its placement) and concurrent runs (every job of a mix at once),
on a backend, keeping every record as it arrives and resuming an interrupted study (docs/study.md, section 3).

Baselines are run once per matching key (strategy, model, GPUs, placement class), on the nodes of the first
job with that key, `baseline_repeats` times. A concurrent run starts every job of the mix; a job that ends
is started again at once on the same nodes (small and large alike, as the study's scheduler does), until
every large job (GPUs >= small_job_threshold; 0 makes every job large, ALL_SMALL none: the artifact's
default, where every mix runs for the whole walltime) has finished once, or the walltime
passes; then the kill sequence: SIGUSR1 to every running job's process group, SIGKILL after a grace period.
A job that keeps failing (max_failures in a row) fails its unit; the study goes on with the next unit.

Results folder: `study.json` (the settings), `units.jsonl` (one line per finished unit: how each job
instance ended), `raw/<unit>/<job>.<instance>.jsonl` (the proxy's records, written as each iteration ends),
`logs/<unit>/<job>.<instance>/` (every rank's log). On resume, units already in units.jsonl as done are
skipped; a unit interrupted half-way is moved to `aborted/` and run again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence

from microbench.cluster import launch
from microbench.output import jsonl
from microbench.study import backends as bk
from microbench.study import machines as mm
from microbench.study import workloads as wl

UNITS_FILE = "units.jsonl"
SETTINGS_FILE = "study.json"


class RunError(RuntimeError):
  """The study can't start or resume (bad plan, settings mismatch); one line."""


ALL_SMALL = 1 << 40  # a small-job threshold above every job: all jobs small (the artifact's default)


@dataclasses.dataclass(frozen=True)
class RunSettings:
  plan_dir: str
  out_dir: str
  backend: str = "local"
  compute: str = "sleep"
  compute_scale: float = 1.0
  bytes_scale: float = 1.0
  iters: int | None = None  # per job instance; None: the study's runs for the strategy
  warmup: int | None = None  # None: the study's (1)
  baseline_repeats: int = 1
  small_job_threshold: int = 0  # the CLI's default is ALL_SMALL, the artifact's
  walltime: float = 200.0  # the artifact's concurrent.yaml
  grace: float = 30.0
  max_failures: int = 3
  dtype: str = "bfloat16"
  experiments: tuple[str, ...] = ()  # subset of experiment ids; empty: all
  baselines: bool = True


@dataclasses.dataclass(frozen=True)
class Unit:
  id: str
  kind: str  # baseline | concurrent
  experiment: str | None
  jobs: tuple[dict, ...]
  meta: dict = dataclasses.field(default_factory=dict, compare=False)  # the experiment's bins and scores


EXPERIMENT_META = ("pattern", "utilization", "entropy", "entropy_norm", "entropy_bin", "placement_score",
                   "placement_bin")


def load_plan(plan_dir: str) -> tuple[dict, list[dict]]:
  """plan.json and its experiments; RunError if missing or malformed."""
  path = os.path.join(plan_dir, "plan.json")
  try:
    with open(path, encoding="utf-8") as f:
      plan = json.load(f)
    experiments = []
    for name in plan["experiments"]:
      with open(os.path.join(plan_dir, name), encoding="utf-8") as f:
        experiments.append(json.load(f))
  except (OSError, ValueError, KeyError) as e:
    raise RunError(f"cannot read the plan in {plan_dir}: {e}") from None
  return plan, experiments


def key_of(job: dict) -> tuple[str, str, int, str]:
  """The matching key of a job: baselines and concurrent samples with the same key are compared."""
  return job["strategy"], job["model"], job["gpus"], job["placement_class"]


def key_name(key: Sequence) -> str:
  strategy, model, gpus, cls = key
  return f"{strategy}-{model}-g{gpus}-{cls}"


def units(experiments: Sequence[dict], baselines: bool = True, only: Sequence[str] = ()) -> list[Unit]:
  """Baselines first (one per matching key), then each experiment's concurrent run."""
  chosen = [e for e in experiments if not only or e["id"] in only]
  out: list[Unit] = []
  if baselines:
    seen: set = set()
    for e in chosen:
      for j in e["jobs"]:
        k = key_of(j)
        if k not in seen:
          seen.add(k)
          out.append(Unit("base-" + key_name(k), "baseline", None, (dict(j, name="j0"),)))
  out += [Unit(e["id"], "concurrent", e["id"], tuple(e["jobs"]), {k: e.get(k) for k in EXPERIMENT_META})
          for e in chosen]
  return out


def proxy_command(job: dict, machine: mm.Machine, s: RunSettings, raw: str, tag: str, baseline: bool = False
                  ) -> list[str]:
  """The proxy's command line. A baseline times its warm-up iteration too (the artifact's baselines run 0
  warm-up + (1 + R) iterations), unless --warmup is given."""
  st = wl.strategy(job["strategy"])
  iters, warmup = s.iters or st.runs, st.warmup if s.warmup is None else s.warmup
  if baseline and s.warmup is None:
    iters, warmup = iters + warmup, 0
  cmd = [sys.executable, "-m", "microbench.cli.study", "proxy", f"--strategy={st.name}", f"--model={job['model']}",
         f"--gpu={machine.gpu}", f"--gpus={job['gpus']}", f"--iters={iters}", f"--warmup={warmup}",
         f"--compute={s.compute}",
         f"--compute_scale={s.compute_scale}", f"--bytes_scale={s.bytes_scale}", f"--proxy_dtype={s.dtype}",
         f"--records={raw}", f"--label={tag}"]
  if job.get("proxy_from"):
    cmd.append(f"--proxy_from={job['proxy_from']}")
  return cmd


@dataclasses.dataclass
class Instance:
  job: int
  number: int
  procs: list[launch.Proc]
  raw: str
  started: float
  outcome: str | None = None  # ok | failed | stopped
  seconds: float = 0.0
  returncode: int | None = None

  def record(self, out_dir: str) -> dict:
    return {"n": self.number, "raw": os.path.relpath(self.raw, out_dir), "outcome": self.outcome, "returncode": self.returncode,
            "seconds": round(self.seconds, 3)}


class UnitRunner:
  """Starts, watches, respawns and stops the job instances of one unit."""

  def __init__(self, unit: Unit, machine: mm.Machine, backend: bk.Backend, s: RunSettings,
               say: Callable[[str], None], poll: float = 0.3):
    self.unit, self.machine, self.backend, self.s, self.say, self.poll = unit, machine, backend, s, say, poll
    self.raw_dir = os.path.join(s.out_dir, "raw", unit.id)
    self.log_dir = os.path.join(s.out_dir, "logs", unit.id)
    self.instances: list[Instance] = []
    self.counts = [0] * len(unit.jobs)

  def start(self, j: int) -> Instance:
    job = self.unit.jobs[j]
    n = self.counts[j]
    self.counts[j] += 1
    tag = f"{self.unit.id}.{job['name']}.{n}"
    raw = os.path.join(self.raw_dir, f"{job['name']}.{n}.jsonl")
    command = proxy_command(job, self.machine, self.s, raw, tag, baseline=self.unit.kind == "baseline")
    procs = self.backend.procs(job, command, tag, os.path.join(self.log_dir, f"{job['name']}.{n}"))
    for p in procs:
      launch.start(p)
    inst = Instance(j, n, procs, raw, time.monotonic())
    self.instances.append(inst)
    return inst

  def check(self, inst: Instance) -> bool:
    """True once the instance has ended (all ranks exited 0, or one failed and the rest were stopped)."""
    if inst.outcome is not None:
      return True
    codes = [p.returncode for p in inst.procs]
    failed = [c for c in codes if c not in (None, 0)]
    if failed:
      launch.stop(inst.procs, 2.0)
      first = min((p for p in inst.procs if p.returncode not in (None, 0)), key=lambda p: p.exit_time)
      inst.outcome, inst.returncode = "failed", first.returncode
      self.say(f"{self.unit.id}: {self.unit.jobs[inst.job]['name']} instance {inst.number} failed "
               f"({launch.describe_code(first.returncode)}); log {first.log_path}")
    elif all(c == 0 for c in codes):
      inst.outcome, inst.returncode = "ok", 0
    else:
      return False
    inst.seconds = time.monotonic() - inst.started
    return True

  def kill_sequence(self, running: Sequence[Instance]) -> None:
    """SIGUSR1 to every running instance's process groups, SIGKILL after the grace period."""
    live = [i for i in running if i.outcome is None]
    for inst in live:
      for p in inst.procs:
        launch.signal_group(p, signal.SIGUSR1)
    deadline = time.monotonic() + self.s.grace
    while time.monotonic() < deadline and any(p.returncode is None for i in live for p in i.procs):
      time.sleep(0.05)
    for inst in live:
      for p in inst.procs:
        if p.returncode is None:
          launch.signal_group(p, signal.SIGKILL)
      launch.stop(inst.procs, 0.0)  # reaps what is left (and its log threads)
      inst.outcome = "stopped"
      inst.returncode = inst.procs[0].returncode
      inst.seconds = time.monotonic() - inst.started

  def run(self) -> dict:
    s, unit = self.s, self.unit
    t0 = time.monotonic()
    status, ended, reason = "done", "", ""
    try:
      if unit.kind == "baseline":
        for _ in range(s.baseline_repeats):
          inst = self.start(0)
          while not self.check(inst):
            if time.monotonic() - t0 > s.walltime:
              self.kill_sequence([inst])
              ended = "walltime"
              break
            time.sleep(self.poll)
          if inst.outcome == "failed":
            status, reason = "failed", f"baseline instance {inst.number} failed"
            break
        ended = ended or "finished"
      else:
        large = [j for j, job in enumerate(unit.jobs) if job["gpus"] >= s.small_job_threshold]
        finished = [False] * len(unit.jobs)
        failures = [0] * len(unit.jobs)
        running = {j: self.start(j) for j in range(len(unit.jobs))}
        while True:
          for j, inst in list(running.items()):
            if not self.check(inst):
              continue
            if inst.outcome == "ok":
              finished[j], failures[j] = True, 0
            else:
              failures[j] += 1
            if failures[j] >= s.max_failures:
              status, reason = "failed", f"job {unit.jobs[j]['name']} failed {failures[j]} times in a row"
              break
            if not (large and all(finished[k] for k in large)):
              running[j] = self.start(j)
          if status == "failed":
            ended = "failure"
            break
          if large and all(finished[k] for k in large):
            ended = "large jobs finished"
            break
          if time.monotonic() - t0 > s.walltime:
            ended = "walltime"
            break
          time.sleep(self.poll)
        self.kill_sequence([i for i in running.values() if i.outcome is None])
    except BaseException:
      for inst in self.instances:
        if inst.outcome is None:
          launch.stop(inst.procs, 2.0)
      raise
    jobs = []
    for j, job in enumerate(unit.jobs):
      jobs.append(dict(job, large=unit.kind == "baseline" or job["gpus"] >= s.small_job_threshold,
                       instances=[i.record(s.out_dir) for i in self.instances if i.job == j]))
    return {"unit": unit.id, "kind": unit.kind, "experiment": unit.experiment, "meta": unit.meta,
            "status": status, "ended": ended, "reason": reason, "seconds": round(time.monotonic() - t0, 3),
            "jobs": jobs}


def done_units(out_dir: str) -> dict[str, dict]:
  """Units recorded as done (a torn last line from a crash is ignored)."""
  return {rec["unit"]: rec for rec in jsonl.read(os.path.join(out_dir, UNITS_FILE)) if rec.get("status") == "done"}


def prepare(s: RunSettings, resume: bool) -> tuple[dict, list[dict], mm.Machine]:
  """Reads the plan, writes or checks study.json; RunError on a mismatch with the recorded study."""
  plan, experiments = load_plan(s.plan_dir)
  machine = mm.Machine.from_json(plan["machine"])
  os.makedirs(s.out_dir, exist_ok=True)
  path = os.path.join(s.out_dir, SETTINGS_FILE)
  record = {"settings": dataclasses.asdict(s), "plan": plan, "started": time.time()}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
    if not resume:
      raise RunError(f"{s.out_dir} already holds a study; pass --resume to continue it or choose another --out")
    keep = ("plan_dir", "out_dir", "backend", "walltime", "grace", "experiments", "baselines", "max_failures")
    diff = [k for k, v in old["settings"].items() if k not in keep and v != record["settings"].get(k)]
    if diff or old["plan"]["experiments"] != plan["experiments"]:
      raise RunError(f"--resume with different settings ({', '.join(diff) or 'plan'}) than {path} records")
  else:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(record, f, indent=1)
  return plan, experiments, machine


def run(s: RunSettings, backend: bk.Backend, machine: mm.Machine, experiments: Sequence[dict],
        say: Callable[[str], None] = print) -> list[dict]:
  """Runs every unit not yet done; returns the unit records written in this call."""
  done = done_units(s.out_dir)
  todo = [u for u in units(experiments, s.baselines, s.experiments) if u.id not in done]
  say(f"{len(done)} unit(s) already done, {len(todo)} to run on {backend.describe()}")
  written = []
  for k, unit in enumerate(todo, 1):
    raw = os.path.join(s.out_dir, "raw", unit.id)
    if os.path.exists(raw):  # a unit interrupted half-way: keep its files aside, run it again
      dest = os.path.join(s.out_dir, "aborted", f"{unit.id}.{int(time.time())}")
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      shutil.move(raw, dest)
      logs = os.path.join(s.out_dir, "logs", unit.id)
      if os.path.exists(logs):
        shutil.move(logs, dest + ".logs")
    os.makedirs(raw, exist_ok=True)
    jobs = ", ".join(f"{j['strategy']}x{j['gpus']}@{j['placement_class']}" for j in unit.jobs)
    say(f"[{k}/{len(todo)}] {unit.kind} {unit.id}: {jobs}")
    rec = UnitRunner(unit, machine, backend, s, say).run()
    jsonl.append(os.path.join(s.out_dir, UNITS_FILE), rec)
    written.append(rec)
    say(f"[{k}/{len(todo)}] {unit.id}: {rec['status']} ({rec['ended']}) in {rec['seconds']:.1f} s"
        + (f": {rec['reason']}" if rec["reason"] else ""))
  return written
