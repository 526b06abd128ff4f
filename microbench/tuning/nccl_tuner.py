"""NCCL's tuner table, written from one sweep measured under several NCCL settings (`microbench --nccl_env`).

NCCL's example tuner plugin (ext-tuner/example, plugins/tuner/example from 2.29) reads a CSV file
(NCCL_TUNER_CONFIG_FILE) of `collective,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,
numPipeOps,regBuff`, first matching line wins, bands inclusive at both ends. People derive it by hand from
nccl-tests sweeps, picking the fastest setting per size; a setting that is 2% faster in one run of a noisy
machine is then forced on every job. Here a setting goes in only where it beats NCCL's own choice (the run with
no setting) beyond noise, at every dtype and scope that share the band's (collective, nodes, ranks), and by more
than the tolerance: the interval is the report's (report/tables.py, simultaneous over the comparison's points).
A size NCCL's choice wins or ties is left without a line, so NCCL decides there.

The file's comments are lines of their own (the plugin reads `#` only in the first column); the header says
what the stock example plugin does with unmatched calls (it returns one channel for them: see docs/tuning.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from microbench.cluster import nccl_settings as ns
from microbench.output import run_folder
from microbench.report import runs as report_runs
from microbench.report import tables

HEADER = ("collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff")


class TunerError(ValueError):
  """Runs that cannot make a tuner table (no NCCL default measured, settings NCCL cannot take); one line."""


@dataclasses.dataclass(frozen=True)
class Arm:
  """One NCCL setting's runs of the sweep."""
  setting: ns.Setting
  runs: tuple[report_runs.SweepRun, ...]


def setting_of(meta: dict[str, Any]) -> ns.Setting:
  """The NCCL setting a run ran under, from the environment it recorded."""
  env = ((meta.get("environment") or {}).get("variables") or {})
  algo, proto, channels = env.get("NCCL_ALGO"), env.get("NCCL_PROTO"), env.get(ns.CHANNELS)
  for var, value, names in (("NCCL_ALGO", algo, ns.ALGORITHMS), ("NCCL_PROTO", proto, ns.PROTOCOLS)):
    if value and value.lower().replace("_", "") not in names:
      raise TunerError(f"{var}={value}: not one {var[5:].lower()} (a list, an exclusion or a per-collective form"
                       " is not one setting a tuner line can hold)")
  return ns.Setting(algo.lower().replace("_", "") if algo else None, proto.lower() if proto else None,
                    int(channels) if channels and channels.isdigit() else None)


def arms(paths: Sequence[str]) -> list[Arm]:
  """The runs by setting (a folder written by --nccl_env stands for its runs); NCCL's default first."""
  found: list[str] = []
  for p in paths:
    listing = os.path.join(p, run_folder.NCCL_SETTINGS)
    if os.path.exists(listing):
      with open(listing, encoding="utf-8") as f:
        found += [os.path.join(p, c["folder"]) for c in json.load(f)["settings"] if c.get("exit") == 0]
    else:
      found.append(p)
  sweeps, _ = report_runs.load(found)
  by: dict[ns.Setting, list[report_runs.SweepRun]] = {}
  for s in sweeps:
    by.setdefault(setting_of(s.meta), []).append(s)
  default = ns.Setting()
  if default not in by:
    raise TunerError("no run without NCCL_ALGO, NCCL_PROTO and NCCL_MAX_NCHANNELS among them: a setting's gain is"
                     " over NCCL's own choice, so measure that too (microbench --nccl_env includes it)")
  if len(by) < 2:
    raise TunerError("only NCCL's default was measured: give runs under other settings (microbench --nccl_env)")
  return [Arm(k, tuple(v)) for k, v in sorted(by.items(), key=lambda kv: kv[0] != default)]


def _usable(recs: Sequence[dict[str, Any]], meta: dict[str, Any]) -> list[dict[str, Any]]:
  checked = (meta.get("flags") or {}).get("check", True) is not False
  return [r for r in recs if checked and r.get("status") == "ok" and not r.get("wrong")
          and r.get("collective") in ns.FUNCTIONS]  # sum, out of place: what the plain NCCL call does


def nodes_ranks(rec: dict[str, Any], meta: dict[str, Any]) -> tuple[int, int]:
  """(nNodes, nRanks) of the point's communicator: the nodes one group spans and its size."""
  group = (run_folder.scope_groups(meta, rec["scope"]) or [[0]])[0]
  return run_folder.group_nodes(meta, group) or len(group), len(group)  # no topology: a rank per node


@dataclasses.dataclass(frozen=True)
class Result:
  """One setting against NCCL's default at one point (scope, dtype) of a band key: the gain (default time /
  setting time) and its interval."""
  setting: ns.Setting
  scope: str
  dtype: str
  gain: float
  lo: float
  hi: float


BandKey = tuple[str, int, int, int]  # NCCL function, nNodes, nRanks, bytes


def results(all_arms: Sequence[Arm]) -> dict[BandKey, list[Result]]:
  """Every setting's gain over NCCL's default at every point both measured."""
  default, meta = all_arms[0], all_arms[0].runs[0].meta
  out: dict[BandKey, list[Result]] = {}
  base = [_usable(r.records, r.meta) for r in default.runs]
  for arm in all_arms[1:]:
    rows = tables.ratio_rows(base, [_usable(r.records, r.meta) for r in arm.runs])["both"]
    for row in rows:
      (coll, scope, dtype, _, nbytes), ratio, lo, hi = tables.ratio_of(row)
      if lo is None or hi is None or not ratio:
        continue
      nodes, ranks = nodes_ranks({"scope": scope}, meta)
      out.setdefault((ns.FUNCTIONS[coll], nodes, ranks, nbytes), []).append(
          Result(arm.setting, scope, dtype, 1 / ratio, 1 / hi, 1 / lo))
  return out


@dataclasses.dataclass(frozen=True)
class Winner:
  setting: ns.Setting
  gain: float  # geometric mean over the point's scopes and dtypes
  lo: float  # the lowest lower bound among them
  hi: float


def winner(found: Sequence[Result], tolerance: float) -> tuple[Winner | None, Result | None]:
  """The setting faster than NCCL's default beyond noise and `tolerance` at every (scope, dtype) measured, the
  largest gain first; and, when none is, the best any setting did (for the report)."""
  by: dict[ns.Setting, list[Result]] = {}
  for r in found:
    by.setdefault(r.setting, []).append(r)
  best_seen = max(found, key=lambda r: r.gain, default=None)
  wins = []
  for setting, rs in by.items():
    if all(r.lo > 1 and r.gain > 1 + tolerance for r in rs):
      gain = math.exp(sum(math.log(r.gain) for r in rs) / len(rs))
      wins.append(Winner(setting, gain, min(r.lo for r in rs), max(r.hi for r in rs)))
  return (max(wins, key=lambda w: w.gain) if wins else None), best_seen


@dataclasses.dataclass(frozen=True)
class Band:
  """Consecutive measured sizes of one (function, nodes, ranks) with the same outcome: a winner, or NCCL's own."""
  function: str
  nodes: int
  ranks: int
  min_bytes: int
  max_bytes: int
  sizes: tuple[int, ...]
  winner: Winner | None
  best_seen: Result | None  # without a winner: the best any setting did (within noise or tolerance)


def bands(found: dict[BandKey, list[Result]], tolerance: float) -> list[Band]:
  """Per (function, nodes, ranks) the measured sizes split at the geometric middle between neighbours (the
  first band from 0, the last ending at the largest size measured: no evidence beyond it), merged where
  neighbours share their outcome."""
  groups: dict[tuple[str, int, int], list[int]] = {}
  for func, nodes, ranks, nbytes in found:
    groups.setdefault((func, nodes, ranks), []).append(nbytes)
  out = []
  for (func, nodes, ranks), sizes in sorted(groups.items()):
    sizes = sorted(sizes)
    upper = [int(math.sqrt(a * b)) for a, b in zip(sizes, sizes[1:])] + [sizes[-1]]
    lower = [0] + [u + 1 for u in upper[:-1]]
    for i, size in enumerate(sizes):
      w, seen = winner(found[(func, nodes, ranks, size)], tolerance)
      last = out[-1] if out and (out[-1].function, out[-1].nodes, out[-1].ranks) == (func, nodes, ranks) else None
      if last and _same(last.winner, w):
        out[-1] = dataclasses.replace(last, max_bytes=upper[i], sizes=(*last.sizes, size),
                                      winner=_merged(last.winner, w), best_seen=last.best_seen or seen)
      else:
        out.append(Band(func, nodes, ranks, lower[i], upper[i], (size,), w, seen))
  return out


def _same(a: Winner | None, b: Winner | None) -> bool:
  return (a is None and b is None) or (a is not None and b is not None and a.setting == b.setting)


def _merged(a: Winner | None, b: Winner | None) -> Winner | None:
  if a is None or b is None:
    return None
  return Winner(a.setting, min(a.gain, b.gain), min(a.lo, b.lo), max(a.hi, b.hi))


def _size(n: int) -> str:
  for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
    if n >= 1 << shift and n % (1 << shift) == 0:
      return f"{n >> shift}{unit}"
  return str(n)


def describe(b: Band) -> str:
  where = f"{b.function} {_size(b.min_bytes)}-{_size(b.max_bytes)} B, {b.nodes} node(s), {b.ranks} ranks"
  if b.winner:
    w = b.winner
    return (f"{where}: {w.setting.label} {w.gain:.2f}x [{w.lo:.2f}, {w.hi:.2f}] over NCCL's own choice"
            f" ({len(b.sizes)} size(s) measured)")
  seen = (f"; best {b.best_seen.setting.label} {b.best_seen.gain:.2f}x [{b.best_seen.lo:.2f},"
          f" {b.best_seen.hi:.2f}]" if b.best_seen else "")
  return f"{where}: NCCL's own choice (no setting faster beyond noise and tolerance{seen})"


def line(b: Band) -> str | None:
  """The tuner's CSV line for a band with a winner (None when its setting names no algorithm or protocol:
  a tuner line must name both)."""
  s = b.winner.setting if b.winner else None
  if s is None or not s.algorithm or not s.protocol:
    return None
  return (f"{b.function},{b.min_bytes},{b.max_bytes},{ns.TUNER_ALGORITHM[s.algorithm]},{s.protocol},"
          f"{s.channels or -1},{b.nodes},{b.ranks},-1,-1")


def render(all_bands: Sequence[Band], tolerance: float, sources: Sequence[str]) -> tuple[str, list[str]]:
  """The config file's text, and one line per band whose winner cannot be written (why)."""
  text = [f"# NCCL tuner configuration written by microbench-report --nccl_tuner_conf from {len(sources)} run(s):",
          *[f"#   {p}" for p in sources],
          f"# Format: {HEADER}",
          f"# A line only where its setting beat NCCL's own choice beyond noise (simultaneous 95% intervals) and by"
          f" more than {tolerance:.0%}",
          "# at every dtype and scope measured; elsewhere no line, so NCCL decides. Bands end at the largest size"
          " measured.",
          "# The stock example plugin (NCCL 2.27.5 to 2.30) returns 1 channel for a line with channels -1 and for a"
          " call no line",
          "# matches: build it with `*nChannels = 0` in plugin.c, or those calls run on one channel"
          " (docs/tuning.md)."]
  unwritten = []
  for b in all_bands:
    if not b.winner:
      continue
    rule = line(b)
    if rule is None:
      unwritten.append(f"{describe(b)}: not written, a tuner line names an algorithm and a protocol; measure with"
                       " both NCCL_ALGO and NCCL_PROTO")
      continue
    s = b.winner.setting
    if s.protocol not in ns.VALID[b.function].get(s.algorithm, ()):
      unwritten.append(f"{describe(b)}: not written, NCCL has no {s.label} {b.function} (it ran something else"
                       " under that name)")
      continue
    text += [f"# {describe(b)}", rule]
  return "\n".join(text) + "\n", unwritten


def recorded_overrides(all_arms: Sequence[Arm]) -> list[str]:
  """NCCL variables the runs were measured with (beyond their own setting) that decide before a tuner."""
  out = set()
  for arm in all_arms:
    own = set(arm.setting.env())
    for run in arm.runs:
      env = ((run.meta.get("environment") or {}).get("variables") or {})
      out.update(f"the runs were measured with {k}={v} set ({why}): the gains hold with it, the tuner decides"
                 " only below it" for k, why in ns.OVERRIDING.items() if k in env and k not in own
                 for v in (env[k],))
  return sorted(out)


def write(path: str, text: str) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)
