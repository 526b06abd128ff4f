"""Any run folder (or nccl-tests output file) read into what the store keeps: its kind, machine, full
fingerprint, points and figures, and what it said of each node.

A run's machine is its hardware identity (accelerator kind and count, topology, node names, the fabric
description); the fingerprint adds what changes collectives without changing the machine (driver, CUDA, NCCL,
JAX and jaxlib, NCCL_* and XLA_FLAGS), so a run after an NCCL upgrade is compared against the same machine's
past and the upgrade is named beside the verdict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from microbench.output import jsonl, run_folder
from microbench.output.train_log import METRICS_FILE
from microbench.report import runs

DOCTOR_FILE = "doctor.json"
STUDY_FILE = "study.json"
STUDY_UNITS = "units.jsonl"
SWEEP, TARGET, TRAIN, DOCTOR, STUDY, NCCL_TESTS = "sweep", "target", "train", "doctor", "study", "nccl-tests"
# Environment variables that change what a collective does (the rest of the recorded environment does not).
_ENV_PREFIXES = ("NCCL_", "XLA_FLAGS", "LIBTPU_INIT_ARGS", "CUDA_VISIBLE_DEVICES", "TPU_")
_SOFTWARE = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-nccl-cu12")


class FolderError(ValueError):
  """A folder that is not a readable run; the message names it."""


@dataclasses.dataclass
class RunEntry:
  """One run as the store keeps it."""
  kind: str
  path: str
  name: str
  identity: dict[str, Any]  # the machine
  fingerprint: dict[str, Any]  # identity + software + environment
  command: str
  code_version: str | None
  started_at: str | None
  finished_at: str
  status: str  # finished, stopped or failed
  points: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  figures: dict[str, float] = dataclasses.field(default_factory=dict)
  nodes: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # node -> (verdict, detail)
  summary: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def machine_id(self) -> str:
    return digest(self.identity)

  @property
  def run_id(self) -> str:
    """Stable across re-indexing and resumes: the kind, folder name, machine and the run's start."""
    return digest([self.kind, self.name, self.machine_id, self.started_at or self.finished_at])

  @property
  def machine_name(self) -> str:
    i = self.identity
    nodes = i.get("nodes") or []
    where = f" on {','.join(nodes[:4])}{' +' + str(len(nodes) - 4) if len(nodes) > 4 else ''}" if nodes else ""
    topo = f" {i['topology']}" if i.get("topology") else ""
    return f"{i.get('count')} x {i.get('accelerator')}{topo}{where}"


def digest(value: Any) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:20]


def kind_of(path: str) -> str | None:
  """The kind of run a folder or file holds, or None."""
  if os.path.isfile(path):
    return NCCL_TESTS
  checks = ((run_folder.RESULTS, SWEEP), (METRICS_FILE, TRAIN), (DOCTOR_FILE, DOCTOR), (STUDY_FILE, STUDY))
  for name, kind in checks:
    if os.path.exists(os.path.join(path, name)):
      return kind
  return None


def find(paths: list[str]) -> list[str]:
  """Runs named, or found anywhere below the folders named (a run's own subfolders are not searched)."""
  out: list[str] = []
  for p in paths:
    if not os.path.exists(p):
      raise FolderError(f"{p}: no such file or folder")
    if kind_of(p):
      out.append(os.path.normpath(p))
      continue
    for dirpath, dirs, _ in os.walk(p):
      dirs.sort()
      for d in list(dirs):
        full = os.path.join(dirpath, d)
        if kind_of(full):
          out.append(os.path.normpath(full))
          dirs.remove(d)
  return list(dict.fromkeys(out))


def _env(variables: dict[str, str] | None) -> dict[str, str]:
  return {k: v for k, v in sorted((variables or {}).items()) if k.startswith(_ENV_PREFIXES)}


def _software(env: dict[str, Any] | None) -> dict[str, Any]:
  env = env or {}
  packages = env.get("packages") or {}
  gpu = env.get("gpu") or {}
  out = {k: packages.get(k) for k in _SOFTWARE if packages.get(k)}
  out.update({k: gpu.get(k) for k in ("nvidia_driver", "cuda_driver_api", "cuda_runtime", "nccl") if gpu.get(k)})
  out["env"] = _env(env.get("variables"))
  return out


def _sweep(path: str) -> RunEntry:
  meta = run_folder.read_meta(path) or {}
  records = run_folder.latest(run_folder.read_results(path))
  flags = meta.get("flags") or {}
  env = meta.get("environment") or {}
  identity = {"accelerator": meta.get("device_kind"), "count": meta.get("device_count"),
              "platform": meta.get("platform"), "topology": flags.get("topology"),
              "nodes": sorted(set(env.get("hosts") or [])), "fabric": meta.get("fabric"),
              "target": flags.get("target")}
  status = {"failed": "failed", "stopped": "stopped"}.get(str(meta.get("status")), "finished")
  finished = meta.get("finished_at") or max((r.get("finished_at") or "" for r in records), default="")
  if not finished:
    raise FolderError(f"{path}: {run_folder.META} says neither when the sweep finished nor has it a finished point")
  return RunEntry(TARGET if flags.get("target") else SWEEP, path, os.path.basename(os.path.abspath(path)),
                  identity, {**identity, **_software(env)}, "microbench " + json.dumps(flags, sort_keys=True),
                  ((env.get("toolkit") or {}).get("git_commit")), meta.get("started_at"), finished, status,
                  points=records, summary={"points": len(records)})


def _train(path: str) -> RunEntry:
  config, steps, summary = runs.read_train(path)
  if not config:
    raise FolderError(f"{path}: {METRICS_FILE} has no config line (not a microbench-train run)")
  env = config.get("environment") or {}
  devices = env.get("devices") or [{}]
  identity = {"accelerator": config.get("device_kind") or devices[0].get("kind"),
              "count": config.get("device_count") or sum(d.get("count") or 0 for d in devices),
              "platform": config.get("platform") or devices[0].get("platform"),
              "topology": config.get("mesh") if isinstance(config.get("mesh"), str) else None,
              "nodes": sorted(set(env.get("hosts") or [])), "fabric": config.get("fabric"),
              "target": config.get("target")}
  figures = {f"train/{k}": float(v) for k, v in (summary or {}).items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
  last = (summary or (steps[-1] if steps else {})).get("finished_at") or _mtime(path, METRICS_FILE)
  return RunEntry(TRAIN, path, os.path.basename(os.path.abspath(path)), identity,
                  {**identity, **_software(env)}, "microbench-train " + json.dumps(
                      {k: v for k, v in config.items() if k not in ("environment", "kind")}, sort_keys=True, default=str),
                  (env.get("toolkit") or {}).get("git_commit"), config.get("started_at"), last,
                  "finished" if summary else "stopped", figures=figures,
                  summary={"steps": len(steps), "model": config.get("model")})


def _mtime(path: str, name: str) -> str:
  import datetime  # pylint: disable=import-outside-toplevel
  t = os.path.getmtime(os.path.join(path, name))
  return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def _load_json(path: str, name: str) -> dict[str, Any]:
  try:
    with open(os.path.join(path, name), encoding="utf-8") as f:
      doc = json.load(f)
  except (OSError, ValueError) as e:
    raise FolderError(f"{os.path.join(path, name)}: unreadable ({str(e).splitlines()[0]})") from None
  if not isinstance(doc, dict):
    raise FolderError(f"{os.path.join(path, name)}: not a JSON object")
  return doc


def _doctor(path: str) -> RunEntry:
  doc = _load_json(path, DOCTOR_FILE)
  if "status" not in doc or "hosts" not in doc:
    raise FolderError(f"{os.path.join(path, DOCTOR_FILE)}: no status or hosts (not a microbench-doctor verdict)")
  hosts = [str(h) for h in doc.get("hosts") or []]
  identity = {"accelerator": None, "count": doc.get("nodes"), "platform": None, "topology": None,
              "nodes": sorted(hosts), "fabric": doc.get("fabric"), "target": None}
  nodes = {h: ("healthy", "") for h in hosts}
  for c in doc.get("culprits") or []:
    for h in c.get("hosts") or []:
      nodes[str(h)] = ("named", f"{c.get('part')}: {c.get('what')}")
  for u in doc.get("unresolved") or []:
    for h in _part_hosts(u.get("part", ""), hosts):
      if nodes.get(h, ("",))[0] != "named":
        nodes[h] = ("unresolved", f"{u.get('part')}: {u.get('why')}")
  figures = {"doctor/status": float(doc["status"]), "doctor/culprits": float(len(doc.get("culprits") or [])),
             "doctor/seconds": float(doc.get("seconds") or 0)}
  finished = doc.get("finished_at") or _mtime(path, DOCTOR_FILE)
  return RunEntry(DOCTOR, path, os.path.basename(os.path.abspath(path)), identity,
                  {**identity, "env": {}}, "microbench-doctor " + json.dumps(doc.get("settings") or {}, sort_keys=True),
                  doc.get("code_version"), doc.get("started_at") or finished, finished, "finished",
                  figures=figures, nodes=nodes, summary={"status": doc["status"]})


def _part_hosts(part: str, hosts: list[str]) -> list[str]:
  """The hosts a doctor part names (h3, h3.nic1, h1+h2); other parts (uplinks) name none."""
  out = []
  for p in part.split("+"):
    head = p.split(".")[0]
    if head.startswith("h") and head[1:].isdigit() and int(head[1:]) < len(hosts):
      out.append(hosts[int(head[1:])])
  return out


def _study(path: str) -> RunEntry:
  settings = _load_json(path, STUDY_FILE)
  units = jsonl.read(os.path.join(path, STUDY_UNITS)) if os.path.exists(os.path.join(path, STUDY_UNITS)) else []
  identity = {"accelerator": None, "count": settings.get("gpus"), "platform": settings.get("backend"),
              "topology": settings.get("machine"), "nodes": [], "fabric": settings.get("machine"), "target": None}
  done = sum(1 for u in units if u.get("status", "done") == "done")
  figures = {"study/units": float(len(units)), "study/units_done": float(done)}
  finished = max((u.get("finished_at") or "" for u in units), default="") or _mtime(path, STUDY_FILE)
  return RunEntry(STUDY, path, os.path.basename(os.path.abspath(path)), identity, {**identity, "env": {}},
                  "microbench-study run " + json.dumps(settings, sort_keys=True, default=str), None,
                  settings.get("started_at"), finished, "finished", figures=figures, summary={"units": len(units)})


def _nccl_tests(path: str) -> RunEntry:
  from microbench.report import nccl_tests  # pylint: disable=import-outside-toplevel
  try:
    records, notes = nccl_tests.read_file(path)
  except (nccl_tests.NcclTestsError, OSError, UnicodeDecodeError) as e:
    raise FolderError(f"{path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
  return nccl_tests_entry(path, records, notes)


def nccl_tests_entry(path: str, records: list[dict[str, Any]], notes: list[str]) -> RunEntry:
  """An nccl-tests output file as a run: its points as the report reads them, NCCL's version in the fingerprint."""
  version = next((r.get("nccl_version") for r in records if r.get("nccl_version")), None) or _nccl_version(path)
  ranks = max((int(r.get("group_size") or r.get("ranks") or 0) for r in records), default=0)
  devices = next((r.get("devices") for r in records if isinstance(r.get("devices"), str)), None)
  identity = {"accelerator": devices, "count": ranks or None, "platform": "nccl-tests", "topology": None,
              "nodes": [], "fabric": None, "target": None}
  finished = _mtime(os.path.dirname(os.path.abspath(path)), os.path.basename(path))
  return RunEntry(NCCL_TESTS, path, os.path.basename(path), identity, {**identity, "nccl": version, "env": {}},
                  "nccl-tests " + os.path.basename(path), None, finished, finished, "finished",
                  points=[dict(r, status=r.get("status", "ok"), scope=r.get("scope") or "nccl-tests",
                               group_size=r.get("group_size") or r.get("ranks") or 0) for r in records],
                  summary={"notes": notes[:5]})


def _nccl_version(path: str) -> str | None:
  """NCCL's version from a text log's `NCCL version 2.21.5+cuda12.4` line (its INFO output), if printed."""
  import re  # pylint: disable=import-outside-toplevel
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      m = re.search(r"NCCL version (\d+\.\d+\.\d+)", f.read(1 << 20))
  except OSError:
    return None
  return m.group(1) if m else None


_READERS = {SWEEP: _sweep, TRAIN: _train, DOCTOR: _doctor, STUDY: _study, NCCL_TESTS: _nccl_tests}


def read(path: str) -> RunEntry:
  """The run at `path`; FolderError (one line naming it) when it is not a readable run."""
  kind = kind_of(path)
  if kind is None:
    raise FolderError(f"{path}: not a run folder (no {run_folder.RESULTS}, {METRICS_FILE}, {DOCTOR_FILE} or"
                      f" {STUDY_FILE}) nor an nccl-tests output file")
  try:
    return _READERS[kind](path)
  except FolderError:
    raise
  except (ValueError, KeyError, TypeError, OSError) as e:
    raise FolderError(f"{path}: unreadable {kind} run ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
