"""XLA:GPU's collective performance table, written from this toolkit's checked sweeps.

XLA:GPU's latency-hiding scheduler costs each collective inside one NVLink domain from a measured table
(`--xla_gpu_experimental_collective_perf_table_path`, an `xla.gpu.DeviceHloInstructionProfiles` text proto:
per device key, e.g. `sm_90`, entries of one HLO collective and its throughput in bytes/s) and everything across
nodes from its analytical speed-of-light model (`xla_sol_fit.py`). XLA's own generator is a C++ tool built
from XLA's sources; here the table comes from the sweeps a user already ran, checked.

What XLA (jaxlib 0.10) does with a table, which decides what is written and what is checked (docs/tuning.md):
- the key is `sm_<major><minor>` of the device (`sm_100_<last word of its name>` on sm_100), and a file
  without it, unreadable or missing is silently replaced by XLA's built-in table (for H100s);
- a table replaces the built-in one: a kind of collective it lacks has no time (XLA gives it a fixed 5000 us);
- the estimate is bytes / throughput of the nearest point (no interpolation); all-reduce, all-gather and
  all-to-all are looked up by (bytes, group size), reduce-scatter by its exact groups and element type;
- only collectives inside one NVLink partition read the table, so only such points are written;
- sizes of 2 GiB or more break the nearest-point search (a 32-bit truncation): left out;
- one entry XLA cannot rebuild as an HLO module (a shape of rank 2, groups uneven across nodes) drops the whole
  estimator to fixed costs, and an opcode it does not know aborts the compile: `check` refuses both.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from microbench.fabric import gpu_kinds
from microbench.output import run_folder
from microbench.report import runs as report_runs
from microbench.tuning import textproto

OPCODES = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
           "all_to_all": "all-to-all", "ppermute": "collective-permute"}
KINDS = tuple(OPCODES.values())  # the five XLA's interpolator knows; any other opcode aborts its compile
ELEMENT_TYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2), "float64": ("F64", 8),
                 "int32": ("S32", 4), "int8": ("S8", 1), "uint8": ("U8", 1), "int16": ("S16", 2),
                 "uint32": ("U32", 4), "int64": ("S64", 8), "float8_e4m3fn": ("F8E4M3FN", 1),
                 "float8_e5m2": ("F8E5M2", 1)}
MAX_BYTES = (1 << 31) - 1  # XLA's nearest-point search truncates sizes to 32 bits


class TableError(ValueError):
  """A table that cannot be written or that XLA would not use as meant; one line."""


def device_key(device_kind: str) -> str:
  """XLA's key for a GPU by the name it reports (`NVIDIA H100 80GB HBM3` -> `sm_90`): H100s and H200s share
  one. TableError for a device this toolkit has no compute capability for."""
  kind = gpu_kinds.lookup(device_kind)
  if kind is None or not kind.xla:
    known = ", ".join(sorted(k.device_kind for k in gpu_kinds.kinds().values() if k.xla))
    raise TableError(f"{device_kind!r} is no GPU this toolkit knows the compute capability of ({known}); pass"
                     " --xla_device_key=sm_XY to name XLA's key yourself")
  major, minor = kind.xla["compute_capability"]
  key = f"sm_{major}{minor}"
  return f"{key}_{device_kind.split()[-1]}" if (major, minor) == (10, 0) else key


def iota_form(groups: Sequence[Sequence[int]]) -> tuple[list[int], list[int]] | None:
  """(reshape dims, transpose perm) with iota(D).reshape(dims).transpose(perm).reshape(G, S) == groups (XLA's
  iota replica groups, `[G,S]<=[dims]T(perm)`), fewest dims first; None when the groups are not of that form."""
  want = np.asarray(groups)
  d = want.size
  if want.ndim != 2 or sorted(want.ravel().tolist()) != list(range(d)):
    return None
  for n in range(1, 4):
    for dims in _factorizations(d, n):
      for perm in itertools.permutations(range(n)):
        if np.array_equal(np.arange(d).reshape(dims).transpose(perm).reshape(want.shape), want):
          return list(dims), list(perm)
  return None


def _factorizations(d: int, n: int) -> list[tuple[int, ...]]:
  if n == 1:
    return [(d,)]
  out = []
  for f in range(2, d):
    if d % f == 0:
      out += [(f, *rest) for rest in _factorizations(d // f, n - 1) if all(r > 1 for r in rest)]
  return out


@dataclasses.dataclass
class Counts:
  """What went in and what was left out, and why (the report prints each)."""
  written: int = 0
  left_out: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def lines(self) -> list[str]:
    return [f"left out {n} point(s): {why}" for why, n in sorted(self.left_out.items())]


def _skip_reason(rec: dict[str, Any], meta: dict[str, Any], checked: bool) -> str | None:
  if rec.get("collective") not in OPCODES:
    return f"{rec.get('collective')}: not a collective XLA's table holds (or another operator/in place)"
  if rec.get("status") != "ok":
    return f"status {rec.get('status')} (failed or not run)"
  if not checked or rec.get("wrong") != 0 or rec.get("timed_wrong", 0) != 0:
    return "results not checked right (--check off, or wrong elements)"
  if rec.get("noisy"):
    return "NOISY (the time's spread is beyond the sweep's resolution)"
  if not (rec.get("time_us") or 0) > 0:
    return "no resolved time (a time by difference <= 0)"
  if rec.get("dtype") not in ELEMENT_TYPES:
    return f"dtype {rec.get('dtype')}: no XLA element type known"
  if rec["bytes"] > MAX_BYTES:
    return "2 GiB or more (XLA's nearest-point search truncates sizes to 32 bits)"
  if not _inside_one_node(rec, meta):
    return "groups across nodes (XLA reads its table inside one NVLink domain; the SoL options model these)"
  return None


def _inside_one_node(rec: dict[str, Any], meta: dict[str, Any]) -> bool:
  groups = run_folder.scope_groups(meta, rec["scope"])
  return bool(groups) and all(run_folder.group_nodes(meta, g) == 1 for g in groups)


def entry(rec: dict[str, Any], meta: dict[str, Any]) -> textproto.Message | None:
  """One table entry for a measured point (None when its groups have no iota form)."""
  op = OPCODES[rec["collective"]]
  etype, esize = ELEMENT_TYPES[rec["dtype"]]
  groups = run_folder.scope_groups(meta, rec["scope"])
  n = len(groups[0])
  elements = rec["bytes"] // esize // (n if op == "reduce-scatter" else 1)  # reduce-scatter: its output
  shape: textproto.Message = [("element_type", etype), ("dimensions", str(elements)),
                              ("layout", [("minor_to_major", "0")]), ("is_dynamic_dimension", "false")]
  ins: textproto.Message = [("name", textproto.quote(op)), ("opcode", textproto.quote(op)), ("shape", shape)]
  if op in ("all-gather", "reduce-scatter", "all-to-all"):
    ins.append(("dimensions", "0"))
  ins.append(("channel_id", "1"))
  if op == "collective-permute":
    ins += [("source_target_pairs", [("source", str(g[i])), ("target", str(g[(i + 1) % len(g)]))])
            for g in groups for i in range(len(g))]
  else:
    form = iota_form(groups)
    if form is None:
      return None
    if op != "all-to-all":
      ins.append(("use_global_device_ids", "true"))
    dims, perm = form
    ins.append(("iota_collective_device_list", [("num_replica_groups", str(len(groups))),
                                                ("num_devices_per_group", str(n)),
                                                *[("iota_reshape_dims", str(x)) for x in dims],
                                                *[("iota_transpose_perm", str(x)) for x in perm]]))
  throughput = int(rec["bytes"] / (rec["time_us"] * 1e-6))  # XLA's bytes transferred over the time
  return [("instruction", ins), ("network_throughput_bytes_per_sec", str(throughput))]


def identity(e: textproto.Message) -> str:
  """What makes two entries the same point (their throughput aside): a newer measurement replaces an older."""
  ins = textproto.first(e, "instruction", [])
  keep = [(k, v) for k, v in ins if k in ("opcode", "shape", "dimensions", "iota_collective_device_list",
                                          "source_target_pairs", "replica_groups")]
  return textproto.render(keep)


def from_runs(paths: Sequence[str], key: str | None = None) -> tuple[str, list[textproto.Message], Counts]:
  """`from_sweeps` of the sweeps under `paths`."""
  sweeps, _ = report_runs.load(list(paths))
  return from_sweeps(sweeps, key)


def from_sweeps(sweeps: Sequence[report_runs.SweepRun], key: str | None = None
                ) -> tuple[str, list[textproto.Message], Counts]:
  """(device key, entries, counts) from the sweeps: one entry per checked, steady point inside one node; the key
  from the runs' device (all one key) unless given."""
  if not sweeps:
    raise TableError("no collective sweep among the runs given")
  keys = {key or _run_key(s.meta) for s in sweeps}
  if len(keys) > 1:
    raise TableError(f"the runs are of different devices ({', '.join(sorted(keys))}): one table per key; give"
                     " one device's runs")
  counts, out = Counts(), {}
  for s in sweeps:
    checked = (s.meta.get("flags") or {}).get("check", True) is not False
    for rec in s.records:
      why = _skip_reason(rec, s.meta, checked)
      e = None if why else entry(rec, s.meta)
      if why or e is None:
        counts.left_out[why or "groups with no iota form"] += 1
        continue
      out[identity(e)] = e  # a later run's measurement of the same point wins
  counts.written = len(out)
  return keys.pop(), list(out.values()), counts


def _run_key(meta: dict[str, Any]) -> str:
  if meta.get("platform") != "gpu":
    raise TableError(f"the run's devices are {meta.get('platform') or 'unknown'}, not GPUs: XLA:GPU's table is"
                     " keyed by a GPU's compute capability; pass --xla_device_key=sm_90 (for example) to write a"
                     " rehearsal table from it, labelled as such")
  return device_key(str(meta.get("device_kind")))


def merge(existing_text: str | None, key: str, entries: list[textproto.Message]) -> tuple[str, int, int]:
  """The table with `entries` under `key`: other keys and other entries kept as they were, an entry of the same
  point replaced. Returns (text, kept, replaced)."""
  table = textproto.parse(existing_text) if existing_text else []
  new = {identity(e): e for e in entries}
  kept = replaced = 0
  for name, item in table:
    if name == "entries" and isinstance(item, list) and textproto.unquote(textproto.first(item, "key", "")) == key:
      value = textproto.first(item, "value", [])
      old = [e for n, e in value if n == "entries"]
      stay = [e for e in old if identity(e) not in new]
      replaced += len(old) - len(stay)
      kept += len(stay)
      value[:] = [(n, v) for n, v in value if n != "entries"] + [("entries", e) for e in stay + list(new.values())]
      break
  else:
    table.append(("entries", [("key", textproto.quote(key)),
                              ("value", [("entries", e) for e in new.values()])]))
  return textproto.render(table) + "\n", kept, replaced


def write(path: str, key: str, entries: list[textproto.Message]) -> tuple[int, int]:
  """Writes (merging into the file when it exists) atomically; (kept, replaced)."""
  existing = open(path, encoding="utf-8").read() if os.path.exists(path) else None
  try:
    text, kept, replaced = merge(existing, key, entries)
  except textproto.TextProtoError as e:
    raise TableError(f"{path}: not a text-format table to merge into ({e})") from None
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)
  return kept, replaced
