"""Sigma predicted before the run: every job of a plan's experiments, from its proxy's per-iteration schedule
mapped onto the links its placement uses, alone and beside the other jobs of its mix (fabric.jobs: flows
share each link max-min fairly while they overlap in time).

A collective becomes flows the way NCCL's ring moves it: all-reduce sends 2(n-1)/n S from each member to
the next, all-gather and reduce-scatter (n-1)/n S, all-to-all S/n to every other member, a permute S from
each source to its target. A flow crosses the source GPU's NVLink out and the target's in (same node), or
the source node's NICs out, the leaf uplink and group links where it leaves them, and the target's way in.
Levels without a rate (non-blocking) are left out of the path. Each collective also pays a latency no
neighbour changes: the fabric's base latency plus its steps, those between nodes at the network hop (the
uplinks' where it leaves a leaf) and the others at the scale-up hop (NCCL's tuning model, counted as the fabric
model counts it: fabric.conventions; `fit_from` sweeps replace the described hops with the measured alpha per
step), plus `call_us` per call if given. The baseline of a matching key is its first job alone on that job's
nodes, as `run` measures it.

A job whose proxy is derived from a model's HLO (`proxy_from`) gets the schedule `run` will derive
(`derive_schedules`, compiling its training step once per model and size).

Written to RESULTS/predicted.json before the run (the folder `run` then fills); `report` puts it beside the
measured sigma.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence

from microbench.fabric import conventions
from microbench.fabric import description as fd
from microbench.fabric import jobs as fj
from microbench.report import fabric_fit
from microbench.study import backends, rank_programs, run_plan
from microbench.study import machines as mm

PREDICTED = "predicted.json"
LATENCY_BOUND_SHARE = 0.5  # a key whose latency is more than this share of its time alone is latency-bound
LATENCY_BOUND = ("latency-bound: latencies are most of its time alone, so its sigma rests on the latency term,"
                 " not on the shared links")
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Links:
  """Link names and capacities (bytes/s) of a machine's fabric, and the path between two GPUs."""
  machine: mm.Machine
  fabric: fd.Fabric

  def capacity(self) -> dict[str, float]:
    m, f = self.machine, self.fabric
    cap: dict[str, float] = {}
    for n in range(m.nodes):
      if f.scale_up_gbps and m.gpus_per_node > 1:
        for g in range(m.gpus_per_node):
          cap[f"gpu{n}.{g}:out"] = cap[f"gpu{n}.{g}:in"] = f.scale_up_gbps * 1e9
      if f.nic_gbps:
        cap[f"node{n}:out"] = cap[f"node{n}:in"] = f.nic_gbps * f.nics_per_node * 1e9
    if f.leaf_up_gbps:
      for leaf in m.l1s():
        cap[f"leaf{leaf}:up"] = cap[f"leaf{leaf}:down"] = f.leaf_up_gbps * 1e9
    if f.group_up_gbps:
      for group in m.groups():
        cap[f"group{group}:out"] = cap[f"group{group}:in"] = f.group_up_gbps * 1e9
    cap["local"] = math.inf
    return cap

  def path(self, a: tuple[int, int], b: tuple[int, int]) -> tuple[str, ...]:
    """The links a flow from (node, gpu) `a` to (node, gpu) `b` crosses, in order."""
    m, f = self.machine, self.fabric
    (na, ga), (nb, gb) = a, b
    if na == nb:
      if f.scale_up_gbps and m.gpus_per_node > 1:
        return (f"gpu{na}.{ga}:out", f"gpu{nb}.{gb}:in")
      return ("local",)
    out = [f"node{na}:out"] if f.nic_gbps else []
    if m.l1_of(na) != m.l1_of(nb) and f.leaf_up_gbps:
      out.append(f"leaf{m.l1_of(na)}:up")
    if m.group_of(na) != m.group_of(nb) and f.group_up_gbps:
      out += [f"group{m.group_of(na)}:out", f"group{m.group_of(nb)}:in"]
    if m.l1_of(na) != m.l1_of(nb) and f.leaf_up_gbps:
      out.append(f"leaf{m.l1_of(nb)}:down")
    if f.nic_gbps:
      out.append(f"node{nb}:in")
    return tuple(out) or ("local",)

  def latency_s(self, op: str, n: int, paths: Sequence[tuple[str, ...]], call_us: float = 0.0,
                nodes: int | None = None) -> float:
    """A collective's unshared time, NCCL's ring model as the fabric model counts it (fabric.conventions): base
    + the steps inside a node at the scale-up hop + the steps between its `nodes` nodes at the network hop (the
    uplinks' where a path leaves a leaf), + `call_us`. `nodes` None: one rank per node."""
    f = self.fabric
    if n < 2 or not paths:
      return call_us * 1e-6
    across = any(x.startswith(("leaf", "group")) for p in paths for x in p)
    network = across or any(x.startswith("node") for p in paths for x in p)
    on_domain, between = conventions.latency_steps(op, n, max(2, nodes or n) if network else 1)
    net_hop = f.hop_us("leaf_up") if across else f.net_hop_us
    return (f.base_us + on_domain * f.scale_up_hop_us + between * net_hop + call_us) * 1e-6


def comm_flows(c: rank_programs.Comm, where: Sequence[tuple[int, int]], links: Links,
               element_bytes: int) -> tuple[tuple[tuple[str, ...], float], ...]:
  """A collective's flows (links, bytes) as NCCL's ring (or direct sends) would move it."""
  ranks = c.group.ranks
  n = len(ranks)
  size = c.elements * element_bytes
  pairs: list[tuple[int, int, float]] = []
  if c.op == "permute":
    pairs = [(ranks[a], ranks[b], size) for a, b in c.pairs]
  elif c.op == "all_to_all":
    pairs = [(x, y, size / n) for x in ranks for y in ranks if x != y]
  else:
    share = conventions.ring_bytes(c.op, n, size)
    pairs = [(ranks[i], ranks[(i + 1) % n], share) for i in range(n)] if n > 1 else []
  return tuple((links.path(where[a], where[b]), v) for a, b, v in pairs if v > 0)


def job_model(name: str, sched: rank_programs.JobSchedule, job: dict, links: Links, element_bytes: int,
              call_us: float = 0.0) -> fj.Job:
  """The job's ranks as fabric.jobs programs on the nodes `job` places them on."""
  nodes = backends.rank_nodes(job)
  where = [(nodes[r], backends.rank_gpu(job, r)) for r in range(job["gpus"])]
  programs = {}
  for r, steps in enumerate(sched.ranks):
    seen: dict[tuple, int] = {}
    out: list[fj.Step] = []
    for s in steps:
      if isinstance(s, rank_programs.Compute):
        out.append(fj.Compute(s.seconds))
      elif isinstance(s, rank_programs.Wait):
        out.append(fj.Wait(s.handles))
      else:
        c = s.comm
        ident = (c.op, c.label, c.group.ranks, c.pairs)
        seen[ident] = seen.get(ident, 0) + 1
        flows = comm_flows(c, where, links, element_bytes)
        spread = len({where[x][0] for x in c.group.ranks})
        coll = fj.Collective(f"{c.label}:{c.op}:{','.join(map(str, c.group.ranks))}:{seen[ident]}", c.group.ranks,
                             flows, links.latency_s(c.op, len(c.group.ranks), [p for p, _ in flows], call_us, spread))
        out.append(fj.Start(coll, s.handle) if isinstance(s, rank_programs.Start) else fj.Blocking(coll))
    programs[r] = tuple(out)
  return fj.Job(name, programs)


Derived = dict[tuple[str, int], rank_programs.JobSchedule]  # (proxy_from, gpus) -> the schedule read from its HLO


def derive_schedules(experiments: Sequence[dict], machine: mm.Machine, devices: Sequence) -> Derived:
  """The HLO-derived schedules of the plan's `proxy_from` jobs, as `run` derives them (step_collectives.derive on
  the first `gpus` of `devices`: virtual CPU devices, or a GPU kind's compile-only ones), each once."""
  from microbench.study import step_collectives  # pylint: disable=g-import-not-at-top  (compiles models)
  out: Derived = {}
  for e in experiments:
    for job in e["jobs"]:
      key = (job.get("proxy_from"), job["gpus"])
      if key[0] and key not in out:
        if len(devices) < job["gpus"]:
          raise ValueError(f"job {job.get('name')}: deriving {key[0]} on {job['gpus']} ranks needs as many"
                           f" devices; {len(devices)} here")
        out[key] = step_collectives.derive(key[0], job["gpus"], gpu=machine.gpu, devices=list(devices)[:job["gpus"]])
  return out


def proxy_from_gpus(experiments: Sequence[dict]) -> int:
  """The most ranks of any job whose proxy is derived from HLO (0: none): the devices `predict` needs."""
  return max((j["gpus"] for e in experiments for j in e["jobs"] if j.get("proxy_from")), default=0)


def _schedule(job: dict, machine: mm.Machine, bytes_scale: float, compute_scale: float,
              derived: Derived | None = None) -> rank_programs.JobSchedule:
  if job.get("proxy_from"):
    full = (derived or {}).get((job["proxy_from"], job["gpus"]))
    if full is None:
      raise ValueError(f"job {job.get('name')}: its proxy is derived from {job['proxy_from']}'s HLO; derive it"
                       " first (predict.derive_schedules; `microbench-study predict` does)")
    return full.scaled(bytes_scale, compute_scale)
  return rank_programs.build(job["strategy"], job["gpus"], machine.gpu, job["model"]).scaled(bytes_scale, compute_scale)


def dominant_link(model: fj.Job, others: Sequence[fj.Job], capacity: dict[str, float]) -> str | None:
  """Of the links the job's flows cross, the one the whole mix loads most per iteration (bytes / capacity)."""
  load: dict[str, float] = {}
  for j in (model, *others):
    for steps in j.programs.values():
      for s in steps:
        if isinstance(s, (fj.Start, fj.Blocking)):
          for path, size in s.collective.flows:
            for x in path:
              load[x] = load.get(x, 0.0) + size
  mine = {x for steps in model.programs.values() for s in steps if isinstance(s, (fj.Start, fj.Blocking))
          for path, _ in s.collective.flows for x in path if x != "local"}
  return max(sorted(mine), key=lambda x: load[x] / capacity[x], default=None)  # ties: the first by name


def predict(plan_dir: str, bytes_scale: float = 1.0, compute_scale: float = 1.0, dtype: str = "bfloat16",
            iterations: int = 6, fabric: fd.Fabric | None = None, call_us: float = 0.0,
            derived: Derived | None = None, fit_from: Sequence[str] = (),
            say: Callable[[str], None] = lambda msg: None) -> dict:
  """Predicted iteration times alone and in the mix, sigma per job and per matching key, for a plan folder:
  what `microbench-study predict` runs. `fabric` replaces the machine's described links; `fit_from` sweep
  folders then replace its levels with their fits (each change said through `say`). Jobs whose proxies come
  from a model's HLO are derived here as `run` will (on virtual CPU devices) unless `derived` is given."""
  plan, experiments = run_plan.load_plan(plan_dir)  # read once: the fits, the derivations and the model use it
  machine = mm.Machine.from_json(plan["machine"])
  if fit_from:
    fabric = fabric or mm.fabric_of(machine)
    for run_dir in fit_from:
      fabric, notes = fabric_fit.fit_from_run(fabric, run_dir)
      for line in notes:
        say(line)
  need = proxy_from_gpus(experiments)
  if derived is None and need:
    # JAX only here, after the virtual devices are set (a plan without such jobs needs none).
    from microbench.meshes.topology import Topology  # pylint: disable=g-import-not-at-top
    from microbench.cluster import machine as cluster_machine  # pylint: disable=g-import-not-at-top
    cluster_machine.prepare_cpu_devices(Topology(1, 1, need), False)
    import jax  # pylint: disable=g-import-not-at-top
    say(f"deriving the schedules of {sum(1 for e in experiments for j in e['jobs'] if j.get('proxy_from'))} job(s)"
        f" from their training steps' HLO ({need} virtual devices)")
    derived = derive_schedules(experiments, machine, jax.devices())
  return predict_experiments(machine, experiments, bytes_scale, compute_scale, dtype, iterations, fabric=fabric,
                             call_us=call_us, derived=derived)


def table(prediction: dict) -> list[str]:
  """The prediction as a Markdown table, one row per job of every experiment."""
  out = ["| experiment | job | key | alone (s) | in the mix (s) | sigma | link |", "|---|---|---|---|---|---|---|"]
  for eid, e in prediction["experiments"].items():
    for j in e["jobs"]:
      out.append(f"| {eid} | {j['job']} | {j['key']} | {j['alone_s']:.4g} | {j['together_s']:.4g} |"
                 f" {j['sigma']:.3f} | {j['link'] or '-'} |")
  return out


def key_notes(prediction: dict) -> list[str]:
  """One line per key whose prediction rests on its latency term rather than on the shared links."""
  return [f"{name}: {k['note']} ({100 * k['latency_share']:.0f}% of its time alone)"
          for name, k in prediction["keys"].items() if k.get("note")]


def mix_times(machine: mm.Machine, jobs: Sequence[dict], bytes_scale: float = 1.0, compute_scale: float = 1.0,
              dtype: str = "bfloat16", iterations: int = 6, fabric: fd.Fabric | None = None,
              call_us: float = 0.0, derived: Derived | None = None) -> dict[str, tuple[float, str | None]]:
  """Each job's predicted iteration time when `jobs` run together (one job: alone), and its dominant link."""
  links = Links(machine, fabric or mm.fabric_of(machine))
  cap = links.capacity()
  eb = ELEMENT_BYTES[dtype]
  models = [job_model(j["name"], _schedule(j, machine, bytes_scale, compute_scale, derived), j, links, eb, call_us)
            for j in jobs]
  together = fj.run(models, cap, iterations)
  return {m.name: (fj.steady(together[m.name]), dominant_link(m, [x for x in models if x is not m], cap))
          for m in models}


def predict_experiments(machine: mm.Machine, experiments: Sequence[dict], bytes_scale: float = 1.0,
                        compute_scale: float = 1.0, dtype: str = "bfloat16", iterations: int = 6,
                        fabric: fd.Fabric | None = None, call_us: float = 0.0,
                        derived: Derived | None = None) -> dict:
  """`predict` for experiments in memory."""
  scales = dict(bytes_scale=bytes_scale, compute_scale=compute_scale, dtype=dtype, iterations=iterations)
  fab = fabric or mm.fabric_of(machine)
  model = dict(fabric=fab, call_us=call_us, derived=derived)
  alone: dict[tuple, float] = {}
  latency_share: dict[tuple, float] = {}  # of the time alone, what the latencies add (nothing shares it)
  for e in experiments:
    for job in e["jobs"]:
      key = run_plan.key_of(job)
      if key not in alone:  # the baseline: the key's first job alone on its nodes
        alone[key] = mix_times(machine, [job], **scales, **model)[job["name"]][0]
        no_latency = dict(model, call_us=0.0, fabric=dataclasses.replace(
            fab, base_us=0.0, net_hop_us=0.0, uplink_hop_us=None, scale_up_hop_us=0.0))
        bare = mix_times(machine, [job], **scales, **no_latency)[job["name"]][0]
        latency_share[key] = 1.0 - bare / alone[key] if alone[key] > 0 else 0.0
  out_exps = {}
  per_key: dict[tuple, list[float]] = {}
  for e in experiments:
    times = mix_times(machine, e["jobs"], **scales, **model)
    rows = []
    for j in e["jobs"]:
      key = run_plan.key_of(j)
      t, link = times[j["name"]]
      per_key.setdefault(key, []).append(t)
      rows.append({"job": j["name"], "key": run_plan.key_name(key), "alone_s": alone[key], "together_s": t,
                   "sigma": t / alone[key], "link": link})
    out_exps[e["id"]] = {"jobs": rows}
  keys = {run_plan.key_name(k): {"strategy": k[0], "model": k[1], "gpus": k[2], "placement_class": k[3],
                               "alone_s": alone[k], "together_s_geomean": _geomean(v),
                               "sigma": _geomean(v) / alone[k], "latency_share": latency_share[k],
                               **({"note": LATENCY_BOUND} if latency_share[k] > LATENCY_BOUND_SHARE else {})}
          for k, v in per_key.items()}
  return {"fabric": fab.describe(), "assumptions": list(fj.ASSUMPTIONS) + [
              "a collective moves as NCCL's ring (all-to-all and permutes as direct sends)",
              f"a collective's latency: base {fab.base_us:g} us + steps x hop (between nodes {fab.net_hop_us:g} us,"
              + (f" across racks {fab.uplink_hop_us:g} us," if fab.uplink_hop_us is not None else "")
              + f" scale-up {fab.scale_up_hop_us:g} us)" + (f" + {call_us:g} us per call" if call_us else ""),
              "the key's baseline is its first job alone on that job's nodes"],
          "settings": {**scales, "call_us": call_us}, "experiments": out_exps, "keys": keys}


def _geomean(xs: Sequence[float]) -> float:
  return math.exp(sum(math.log(x) for x in xs) / len(xs))


def write(out_dir: str, prediction: dict) -> str:
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, PREDICTED)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(prediction, f, indent=1)
  os.replace(path + ".tmp", path)
  return path


def read(out_dir: str) -> dict | None:
  path = os.path.join(out_dir, PREDICTED)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)
