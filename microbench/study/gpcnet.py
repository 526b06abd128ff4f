"""GPCNeT's experiment: a canary (a strategy proxy or one collective point) runs alone, then beside congestor
jobs on other nodes; its congestion impact factor (`impact.py`) next to the flow model's prediction.

The prediction comes first (written before anything runs, as `predict` does): the canary's schedule and the
congestors' mapped onto the machine's links (`predict.job_model`), the canary's steady iteration alone and
beside them (`fabric.jobs`), and the links they share. Then, on a backend: the canary alone; the congestors,
which loop until stopped; once every congestor has finished a round the canary again; then the study's kill
sequence stops the congestors (SIGUSR1, SIGKILL after the grace period).

Results folder: `gpcnet.json` (specs, prediction, the canary's per-iteration times of both runs, the impact
factors), `report.md`, `raw/<run>/<job>.jsonl` (the proxies' records), `logs/<run>/<job>/`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from microbench.cluster import launch
from microbench.fabric import jobs as fj
from microbench.output import jsonl
from microbench.study import backends as bk
from microbench.study import congestors as cg
from microbench.study import impact as im
from microbench.study import machines as mm
from microbench.study import predict as pr
from microbench.study import rank_programs, run_plan
from microbench.study import workloads as wl

RESULT = "gpcnet.json"


class GpcnetError(ValueError):
  """A bad canary or congestor spec, or an experiment that can't run; one line."""


@dataclasses.dataclass(frozen=True)
class Spec:
  """A canary or a congestor on whole nodes. kind: a strategy (dp, fsdp, ...), a point op (all_reduce, ...)
  or a congestor kind (alltoall, incast, broadcast, permutation)."""
  name: str
  role: str  # canary | congestor
  kind: str
  nodes: tuple[int, ...]
  message_bytes: int | None = None  # points and congestors
  model: str | None = None  # strategies

  @property
  def is_strategy(self) -> bool:
    return self.role == "canary" and self.kind not in cg.POINT_OPS

  def job(self, machine: mm.Machine) -> dict:
    """The job as the backends and the predictor take it."""
    st = wl.strategy(self.kind) if self.is_strategy else None
    return {"name": self.name, "strategy": st.name if st else self.kind,
            "model": (self.model or st.model) if st else "-", "gpus": len(self.nodes) * machine.gpus_per_node,
            "nodes": list(self.nodes), "ranks_per_node": machine.gpus_per_node, "first_slot": 0,
            "placement_class": mm.classify(machine, list(self.nodes))}

  def describe(self) -> str:
    size = f":{self.message_bytes}B" if self.message_bytes else ""
    return f"{self.kind}{size}@{','.join(map(str, self.nodes))}"


def parse_nodes(text: str, machine: mm.Machine) -> tuple[int, ...]:
  out: list[int] = []
  try:
    for part in filter(None, (p.strip() for p in text.split(","))):
      lo, dash, hi = part.partition("-")
      out += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
  except ValueError:
    raise GpcnetError(f"bad node list {text!r}; want e.g. 0,2 or 4-7") from None
  bad = [n for n in out if not 0 <= n < machine.nodes]
  if not out or bad or len(set(out)) != len(out):
    raise GpcnetError(f"node list {text!r}: want distinct nodes in 0..{machine.nodes - 1}")
  return tuple(out)


def parse_canary(text: str, machine: mm.Machine) -> Spec:
  """`STRATEGY[:MODEL]@NODES` (dp@0,2) or `OP:SIZE@NODES` (all_reduce:1M@0,2)."""
  head, at, nodes = text.partition("@")
  if not at:
    raise GpcnetError(f"--canary={text!r}: want STRATEGY[:MODEL]@NODES or OP:SIZE@NODES (e.g. dp@0,2, "
                      "all_reduce:1M@0,2)")
  kind, _, rest = head.strip().partition(":")
  where = parse_nodes(nodes, machine)
  if kind in cg.POINT_OPS:
    if not rest:
      raise GpcnetError(f"--canary={text!r}: a collective point needs its size, e.g. {kind}:1M@{nodes}")
    return Spec("canary", "canary", kind, where, message_bytes=cg.parse_size(rest))
  try:
    st = wl.strategy(kind)
    if rest:
      wl.model(rest)
  except wl.WorkloadError as e:
    raise GpcnetError(f"--canary={text!r}: {e}; or a collective point: {', '.join(cg.POINT_OPS)}") from None
  return Spec("canary", "canary", st.name, where, model=rest or None)


def parse_congestors(items: Sequence[str], machine: mm.Machine, canary: Spec) -> list[tuple[str, int | None,
                                                                                            tuple[int, ...]]]:
  """(kind, bytes or None, nodes) per congestor: `KIND[:SIZE]@NODES` each, or `KIND[:SIZE],KIND...` (no @):
  those kinds share the nodes the canary and the placed congestors leave, in equal blocks in node order."""
  placed, spread = [], []
  for item in items:
    if "@" in item:
      head, _, nodes = item.partition("@")
      placed.append((head.strip(), parse_nodes(nodes, machine)))
    else:
      spread += [p.strip() for p in item.split(",") if p.strip()]
  out: list[tuple[str, int | None, tuple[int, ...]]] = []
  used = set(canary.nodes)
  for head, nodes in placed:
    if used & set(nodes):
      raise GpcnetError(f"congestor {head}@{','.join(map(str, nodes))}: node(s) {sorted(used & set(nodes))} are "
                        "the canary's or another congestor's")
    used |= set(nodes)
    out.append((*_kind_size(head), nodes))
  if spread:
    free = [n for n in range(machine.nodes) if n not in used]
    block = len(free) // len(spread)
    if block * machine.gpus_per_node < 2:
      raise GpcnetError(f"{len(free)} free node(s) for {len(spread)} congestor(s): each needs 2 ranks or more")
    for i, head in enumerate(spread):
      out.append((*_kind_size(head), tuple(free[i * block:(i + 1) * block])))
  if not out:
    raise GpcnetError("no congestor given: --congestors=KIND[,KIND...] or KIND@NODES "
                      f"({', '.join(cg.KINDS)})")
  return out


def _kind_size(head: str) -> tuple[str, int | None]:
  kind, _, size = head.partition(":")
  if kind not in cg.KINDS:
    raise GpcnetError(f"unknown congestor {kind!r}; choose one of {', '.join(cg.KINDS)}")
  return kind, cg.parse_size(size) if size else None


@dataclasses.dataclass(frozen=True)
class Settings:
  out_dir: str
  iters: int = 40
  warmup: int = 1
  dtype: str = "bfloat16"
  compute: str = "sleep"
  bytes_scale: float = 1.0  # strategy canaries
  compute_scale: float = 1.0
  congestor_seconds: float = 1.0  # a congestor round alone lasts this long under the model (unless sized)
  seed: int = 0
  call_us: float = 0.0  # the model's fixed cost per collective call (predict --call_us)
  grace: float = 10.0
  walltime: float = 600.0
  resamples: int = 2000
  backend: str = ""  # where it ran (said in the report: the local backend shares no described link)


def schedule(spec: Spec, machine: mm.Machine, s: Settings) -> rank_programs.JobSchedule:
  gpus = len(spec.nodes) * machine.gpus_per_node
  eb = pr.ELEMENT_BYTES[s.dtype]
  try:
    if spec.role == "congestor":
      return cg.build(spec.kind, gpus, spec.message_bytes or 1, eb, s.seed)
    if not spec.is_strategy:
      return cg.point(spec.kind, gpus, spec.message_bytes, eb)
    return rank_programs.build(spec.kind, gpus, machine.gpu, spec.model).scaled(s.bytes_scale, s.compute_scale)
  except (cg.CongestorError, wl.WorkloadError) as e:
    raise GpcnetError(f"{spec.name} {spec.describe()}: {e}") from None


def _model(spec: Spec, machine: mm.Machine, s: Settings, links: pr.Links) -> fj.Job:
  return pr.job_model(spec.name, schedule(spec, machine, s), spec.job(machine), links, pr.ELEMENT_BYTES[s.dtype],
                      s.call_us)


def size_congestors(machine: mm.Machine, given: Sequence[tuple[str, int | None, tuple[int, ...]]],
                    s: Settings) -> list[Spec]:
  """Congestor specs with their message size: given, or so one round alone takes `congestor_seconds` on the
  described links (a round is latency + bytes / rate under the model: two trial sizes give both)."""
  links = pr.Links(machine, mm.fabric_of(machine))
  cap = links.capacity()
  out = []
  for i, (kind, size, nodes) in enumerate(given):
    spec = Spec(f"c{i}-{kind}", "congestor", kind, nodes, size)
    if size is None:
      t1, t2 = (fj.steady(fj.run([_model(dataclasses.replace(spec, message_bytes=b), machine, s, links)], cap,
                                  3)[spec.name]) for b in (1 << 20, 2 << 20))
      per_byte = (t2 - t1) / (1 << 20)
      if not per_byte > 0:
        raise GpcnetError(f"congestor {kind}@{','.join(map(str, nodes))} crosses no link with a rate: give its "
                          f"size ({kind}:SIZE@NODES)")
      latency = max(0.0, t1 - per_byte * (1 << 20))
      size = max(4096, int(max(s.congestor_seconds - latency, 0.0) / per_byte) // 4096 * 4096)
      spec = dataclasses.replace(spec, message_bytes=size)
    out.append(spec)
  return out


def prediction(machine: mm.Machine, canary: Spec, congs: Sequence[Spec], s: Settings, iterations: int = 6) -> dict:
  """The canary's iteration alone and beside the congestors under the flow model, their ratio, the links the
  canary shares with a congestor, and the one the mix loads most."""
  links = pr.Links(machine, mm.fabric_of(machine))
  cap = links.capacity()
  c = _model(canary, machine, s, links)
  others = [_model(x, machine, s, links) for x in congs]
  alone = fj.steady(fj.run([c], cap, iterations)[c.name])
  beside = fj.steady(fj.run([c, *others], cap, iterations)[c.name])

  def crossed(job: fj.Job) -> set[str]:
    return {x for steps in job.programs.values() for st in steps if isinstance(st, (fj.Start, fj.Blocking))
            for path, _ in st.collective.flows for x in path if x != "local"}
  shared = sorted(crossed(c) & set().union(*(crossed(o) for o in others)))
  return {"alone_s": alone, "beside_s": beside, "cif": beside / alone if alone > 0 else float("nan"),
          "shared_links": shared, "dominant_link": pr.dominant_link(c, others, cap),
          "fabric": "; ".join(mm.fabric_of(machine).describe()),
          "assumptions": list(fj.ASSUMPTIONS) + [
              "a collective moves as NCCL's ring (all-to-all, permutes and incast as direct sends)",
              "the model is deterministic: its factor stands for the mean and the p99 alike"]}


# ---------------------------------------------------------------------------------------------------------
# Running it.


def command(spec: Spec, machine: mm.Machine, s: Settings, raw: str, tag: str, iters: int) -> list[str]:
  if spec.is_strategy:
    rs = run_plan.RunSettings(plan_dir="", out_dir=s.out_dir, compute=s.compute, compute_scale=s.compute_scale,
                            bytes_scale=s.bytes_scale, iters=iters, warmup=s.warmup, dtype=s.dtype)
    return run_plan.proxy_command(spec.job(machine), machine, rs, raw, tag)
  which = f"--congestor={spec.kind}" if spec.role == "congestor" else f"--point={spec.kind}"
  return [sys.executable, "-m", "microbench.cli.study", "proxy", which, f"--message_bytes={spec.message_bytes}",
          f"--gpus={len(spec.nodes) * machine.gpus_per_node}", f"--iters={iters}", f"--warmup={s.warmup}",
          f"--proxy_dtype={s.dtype}", f"--seed={s.seed}", f"--records={raw}", f"--label={tag}"]


def iteration_times(path: str) -> list[float]:
  """The timed (not warm-up) iterations' times of a proxy's records."""
  recs = jsonl.read(path) if os.path.exists(path) else []
  return [r["runtime_s"] for r in recs if r.get("kind") == "iter" and not r.get("warmup")]


def _rounds(path: str) -> list[dict]:
  return [r for r in (jsonl.read(path) if os.path.exists(path) else []) if r.get("kind") == "iter"]


def coverage(window: tuple[float, float], rounds: Sequence[dict], stopped: float | None = None) -> float:
  """The share of `window` (wall-clock start, end) during which one of a congestor's rounds was in flight:
  a congestor that stopped, or spent its time between rounds, did not congest the canary then. A round is
  recorded when it ends, so a congestor still running when it was stopped (wall time `stopped`) was in its
  next round from the last recorded one's end on."""
  lo, hi = window
  spans = [(r["t_start"], r["t_start"] + r["runtime_s"]) for r in rounds]
  if stopped is not None and spans:
    spans.append((max(b for _, b in spans), stopped))
  spans = sorted((max(lo, a), min(hi, b)) for a, b in spans)
  covered, reach = 0.0, lo
  for a, b in spans:
    a = max(a, reach)
    if b > a:
      covered += b - a
      reach = b
  return covered / (hi - lo) if hi > lo else 0.0


class _Run:
  def __init__(self, name: str, machine: mm.Machine, backend: bk.Backend, s: Settings, say: Callable[[str], None]):
    self.name, self.machine, self.backend, self.s, self.say = name, machine, backend, s, say
    self.raw_dir = os.path.join(s.out_dir, "raw", name)
    os.makedirs(self.raw_dir, exist_ok=True)
    self.procs: dict[str, list[launch.Proc]] = {}

  def raw(self, spec: Spec) -> str:
    return os.path.join(self.raw_dir, f"{spec.name}.jsonl")

  def start(self, spec: Spec, iters: int) -> None:
    raw = self.raw(spec)
    if os.path.exists(raw):
      os.remove(raw)  # a rerun into the same folder starts the records afresh
    tag = f"{self.name}.{spec.name}"
    procs = self.backend.procs(spec.job(self.machine), command(spec, self.machine, self.s, raw, tag, iters), tag,
                               os.path.join(self.s.out_dir, "logs", self.name, spec.name))
    for p in procs:
      launch.start(p)
    self.procs[spec.name] = procs

  def failed(self, name: str) -> str | None:
    bad = [p for p in self.procs[name] if p.returncode not in (None, 0)]
    if not bad:
      return None
    p = min(bad, key=lambda x: x.exit_time)
    return f"{name} ({launch.describe_code(p.returncode)}; log {p.log_path})"

  def done(self, name: str) -> bool:
    return all(p.returncode == 0 for p in self.procs[name])

  def stop_all(self) -> None:
    """The study's kill sequence: SIGUSR1 to every running job, SIGKILL after the grace period."""
    live = [p for ps in self.procs.values() for p in ps if p.returncode is None]
    for p in live:
      launch.signal_group(p, signal.SIGUSR1)
    deadline = time.monotonic() + self.s.grace
    while time.monotonic() < deadline and any(p.returncode is None for p in live):
      time.sleep(0.05)
    launch.stop([p for ps in self.procs.values() for p in ps], 0.0)


def measure(machine: mm.Machine, canary: Spec, congs: Sequence[Spec], s: Settings, backend: bk.Backend,
            say: Callable[[str], None] = print, poll: float = 0.2) -> dict:
  """Runs the canary alone, then beside the congestors; returns both runs' canary times and what the
  congestors did during the congested run. Raises GpcnetError when a job fails or the walltime passes."""
  out: dict = {}
  for name, with_congestors in (("isolated", False), ("congested", True)):
    run = _Run(name, machine, backend, s, say)
    t0 = time.monotonic()
    try:
      if with_congestors:
        for c in congs:
          run.start(c, 10 ** 9)  # loop until the kill sequence
        while not all(_rounds(run.raw(c)) for c in congs):
          problem = next(filter(None, (run.failed(c.name) for c in congs)), None)
          if problem or time.monotonic() - t0 > s.walltime:
            raise GpcnetError(f"{name}: congestor {problem} failed" if problem else
                              f"{name}: the congestors did not finish a round within {s.walltime:.0f} s")
          time.sleep(poll)
        say(f"{name}: {len(congs)} congestor(s) loading; starting the canary")
      run.start(canary, s.iters)
      while not run.done(canary.name):
        problem = next(filter(None, (run.failed(x) for x in run.procs)), None)
        if problem or time.monotonic() - t0 > s.walltime:
          raise GpcnetError(f"{name}: {problem} failed" if problem else
                            f"{name}: the canary did not finish within --walltime={s.walltime:.0f} s")
        time.sleep(poll)
    finally:
      stopped = time.time()
      running = {c.name for c in congs if c.name in run.procs and all(p.returncode is None
                                                                        for p in run.procs[c.name])}
      run.stop_all()
    canary_recs = _rounds(run.raw(canary))
    times = iteration_times(run.raw(canary))
    rec = {"canary_s": times, "seconds": round(time.monotonic() - t0, 2)}
    if with_congestors and canary_recs:
      window = (canary_recs[0]["t_start"], canary_recs[-1]["t_start"] + canary_recs[-1]["runtime_s"])
      rec["congestor_coverage"] = {c.name: coverage(window, _rounds(run.raw(c)), stopped if c.name in running
                                                    else None) for c in congs}
    say(f"{name}: canary {len(times)} iteration(s)" + (f", mean {sum(times) / len(times) * 1e3:.1f} ms" if times
                                                        else ""))
    out[name] = rec
  return out


def result(machine: mm.Machine, canary: Spec, congs: Sequence[Spec], s: Settings, predicted: dict,
           measured: dict | None, command_line: str = "") -> dict:
  out = {"machine": machine.to_json(), "canary": dict(dataclasses.asdict(canary), job=canary.job(machine)),
         "congestors": [dict(dataclasses.asdict(c), job=c.job(machine)) for c in congs],
         "settings": dataclasses.asdict(s), "predicted": predicted, "command": command_line}
  if measured:
    out["measured"] = measured
    out["impact"] = im.impact(measured["isolated"]["canary_s"], measured["congested"]["canary_s"], s.resamples,
                              s.seed)
  return out


def markdown(res: dict) -> str:
  p = res["predicted"]
  lines = ["# GPCNeT congestion impact", "",
           f"Canary `{_spec_text(res['canary'])}`; congestors "
           + ", ".join(f"`{_spec_text(c)}`" for c in res["congestors"]) + f" on {res['machine']['name']}"
           f" ({res['machine']['nodes']} nodes).", ""]
  lines += [f"Predicted (flow model, {p['fabric']}): {p['alone_s'] * 1e3:.2f} ms alone, {p['beside_s'] * 1e3:.2f}"
            f" ms beside the congestors: **CIF {p['cif']:.3f}**; links shared with a congestor: "
            f"{', '.join(p['shared_links']) or 'none'}; the mix loads {p['dominant_link'] or '-'} most.", ""]
  imp = res.get("impact")
  if imp:
    lines += ["| statistic | isolated (ms) | congested (ms) | measured CIF [95% CI] | predicted CIF |",
              "|---|---|---|---|---|"]
    for name in ("mean", "p99"):
      f = imp[name]
      ci = f"[{f['low']:.3f}, {f['high']:.3f}]" if f["low"] is not None else "(no interval)"
      flag = "" if f["resolved"] else " unresolved"
      lines.append(f"| {name} | {f['isolated_s'] * 1e3:.2f} | {f['congested_s'] * 1e3:.2f} | {f['cif']:.3f} {ci}"
                   f"{flag} | {p['cif']:.3f} |")
    lines += ["", f"Iterations: {imp['samples']['isolated']} isolated, {imp['samples']['congested']} congested "
                  f"(bootstrap, {imp['resamples']} resamples)."]
    cover = res["measured"]["congested"].get("congestor_coverage")
    if cover:
      lines.append("Share of the canary's congested run with a congestor round in flight: "
                   + ", ".join(f"{k} {100 * v:.0f}%" for k, v in cover.items()) + ".")
    lines += [f"- {n}" for n in imp["notes"]]
    if res["settings"].get("backend") == "local":
      lines.append("- backend local: every rank ran on this machine, over no described link; the prediction is "
                   "for the machine's fabric, the measurement for this host's CPUs and loopback")
  else:
    lines.append("Not measured (prediction only).")
  lines += ["", "Model assumptions: " + "; ".join(p["assumptions"]) + "."]
  if res.get("command"):
    lines += ["", f"Command: `{res['command']}`"]
  return "\n".join(lines) + "\n"


def _spec_text(d: dict) -> str:
  size = f":{d['message_bytes']}B" if d.get("message_bytes") else ""
  model = f":{d['model']}" if d.get("model") else ""
  return f"{d['kind']}{model}{size}@{','.join(map(str, d['nodes']))}"


def write(out_dir: str, res: dict) -> str:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, RESULT), "w", encoding="utf-8") as f:
    json.dump(res, f, indent=1)
  text = markdown(res)
  with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
    f.write(text)
  return text
