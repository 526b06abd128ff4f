"""A sweep request as `microbench`'s flags spell it, and every check of it, in the library.

The command builds a `SweepSettings` from its flags and nothing more; `check` refuses what cannot run (one line,
`SettingsError`, the text the command prints after `microbench: error: `) and turns the rest into the
`sweep.SweepConfig` the sweep runs. A Python caller gets the same refusals as the command line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from microbench.bench import collectives, command_buffer, compile_cache, overlap, reduce_ops, sizes, sweep
from microbench.bench.program import DTYPES
from microbench.cluster import machine
from microbench.fabric import description as fabric_description
from microbench.fabric import link_peaks, tpu_kinds
from microbench.meshes import tpu_slice
from microbench.meshes.scopes import SCOPES
from microbench.meshes.topology import Topology
from microbench.output import run_folder


class SettingsError(ValueError):
  """A sweep request that can't run; the message is one line saying why and what is allowed."""


@dataclasses.dataclass(frozen=True)
class SweepSettings:
  """One field per flag of `microbench`, same name, same default (what meta.json's `flags` records)."""
  collectives: Sequence[str] = ("all",)
  op: Sequence[str] = ("sum",)
  inplace: str = "no"
  root: int = 0
  profile_points: Sequence[str] = ()  # point numbers as given (strings, as the flag's list)
  scopes: Sequence[str] = ("all",)
  min_bytes: str = "1K"
  max_bytes: str = "auto"
  step_factor: float = 4.0
  dtype: Sequence[str] = ("float32",)
  iters: int = 20
  sample_ms: float = 20.0
  warmup: int = 1
  samples: int = 10
  check: bool = True
  keep_going: bool = False
  nccl_debug: bool = False
  topology: str | None = None
  nodes_per_rack: int | None = None
  link_peaks: str | None = None
  fabric: str | None = None
  hang_timeout: float = 120.0
  target: str | None = None
  overlap: str | None = None
  command_buffer: str = "no"
  outdir: str | None = None  # default runs/<UTC timestamp>
  resume: str | None = None  # continue the run in this folder (the caller loads its recorded settings)
  inject_delay: str | None = None  # RANK:MS
  inject_crash: str | None = None  # RANK:POINT
  inject_hang: str | None = None   # RANK:POINT
  compilation_cache: str = compile_cache.OFF  # the command passes its flag (auto); off for API callers


# Recorded in meta.json's `flags` (in this order), and what a resumed run takes back from it.
RECORDED = ("collectives", "op", "inplace", "root", "profile_points", "scopes", "min_bytes", "max_bytes",
            "step_factor", "dtype", "iters", "sample_ms", "warmup", "samples", "check", "keep_going", "nccl_debug",
            "topology", "nodes_per_rack", "link_peaks", "fabric", "hang_timeout", "target", "overlap",
            "command_buffer")
# What only a run does (fault injection, traces and timing of calls): refused with a target, which runs nothing.
RUN_ONLY = ("inject_delay", "inject_crash", "inject_hang", "profile_points", "warmup", "samples", "sample_ms",
            "hang_timeout", "nccl_debug")


def _flag_form(value: Any) -> Any:
  return list(value) if isinstance(value, tuple) else value


def defaults() -> dict[str, Any]:
  """Every setting's default as its flag holds it (lists), `distributed` included: what a run's config text
  marks as set away from the default."""
  out = {f.name: _flag_form(f.default) for f in dataclasses.fields(SweepSettings)}
  return {**out, "distributed": False}


def recorded(s: SweepSettings, distributed: bool = False) -> dict[str, Any]:
  """meta.json's `flags`: the recorded settings, the output folder and whether the job was distributed."""
  names = RECORDED + ("outdir", "resume")
  return {**{n: _flag_form(getattr(s, n)) for n in names}, "distributed": distributed}


def choose(values: Sequence[str], allowed: tuple[str, ...], what: str, by_name: tuple[str, ...] = ()
           ) -> tuple[str, ...]:
  """`allowed` for 'all'; else the values, each in `allowed` or `by_name` (chosen only by name)."""
  if tuple(values) == ("all",):
    return allowed
  allowed_by_name = allowed + by_name
  bad = [v for v in values if v not in allowed_by_name]
  if bad or not values:
    raise SettingsError(f"unknown {what} {', '.join(bad) or '(none)'}: choose from {', '.join(allowed_by_name)}"
                        " or all")
  return tuple(dict.fromkeys(values))


def with_ops(names: tuple[str, ...], ops: tuple[str, ...], dtypes: tuple[str, ...], explicit: bool,
             inplace: str = "no", root: int = 0) -> tuple[str, ...]:
  """Each reduction once per operator (all_reduce, all_reduce_max, ...), the others once; the broadcast from
  `root`; each out of place, in place (<name>_inplace) or both (`inplace`). A collective the user named that can
  run in none of the asked dtypes (or not in place) is refused (one line); with 'all' such pairs are skipped by
  the sweep, which says so."""
  out = []
  modes = {"no": (False,), "yes": (True,), "both": (False, True)}[inplace]
  for name in names:
    for op in ops:
      base = collectives.with_root(collectives.with_op(name, op).name, root).name
      for in_place in modes:
        coll = collectives.with_inplace(base) if in_place else collectives.get(base)
        if coll.name in out:
          continue
        reasons = [coll.refuses(d) for d in dtypes]
        if explicit and all(reasons) and len(modes) == 1:  # with both, the other form still runs: skipped, said
          raise SettingsError(reasons[0])
        out.append(coll.name)
  return tuple(out)


def rank_value(text: str | None, name: str, scale: float) -> tuple[int, float] | None:
  """RANK:NUMBER (fault injection), the number times `scale`; None when not given."""
  if not text:
    return None
  try:
    rank, value = text.split(":")
    return int(rank), float(value) * scale
  except ValueError:
    raise SettingsError(f"--{name}={text!r}: expected RANK:NUMBER, e.g. 1:50") from None


def target_refusal(given: Sequence[str], target: str) -> str:
  """The line refusing settings that only a run uses, with a compile-only target."""
  one = len(given) == 1
  return (f"{', '.join('--' + n for n in given)} {'does' if one else 'do'} nothing with --target={target}"
          f" (compile only: no process runs, nothing is timed); drop {'it' if one else 'them'}, or drop --target"
          " to run")


def _check_run_only(s: SweepSettings) -> None:
  if not s.target:
    return
  fields = {f.name: f.default for f in dataclasses.fields(SweepSettings)}
  given = [n for n in RUN_ONLY if _flag_form(getattr(s, n)) != _flag_form(fields[n])]
  if given:
    raise SettingsError(target_refusal(given, s.target))


def _check_sizes(s: SweepSettings) -> tuple[int, int | None]:
  """(min, max) bytes; max None for auto (the run picks it per platform)."""
  try:
    lo = sizes.parse_size(s.min_bytes)
    hi = None if s.max_bytes == "auto" else sizes.parse_size(s.max_bytes)
  except ValueError as e:
    raise SettingsError(str(e)) from None
  if lo < 1 or hi is not None and hi < 1:
    raise SettingsError("--min_bytes and --max_bytes must be positive")
  if hi is not None and lo > hi:
    raise SettingsError(f"--min_bytes={s.min_bytes} is larger than --max_bytes={s.max_bytes}")
  if s.step_factor <= 1 and (hi is None or lo < hi):
    raise SettingsError(f"--step_factor={s.step_factor} must be > 1")
  if s.step_factor < run_folder.MIN_STEP_FACTOR and (hi is None or lo < hi):
    raise SettingsError(f"--step_factor={s.step_factor} puts neighbouring sizes on one TensorBoard step"
                        f" (step = round(10 x log2(bytes))): use >= {run_folder.MIN_STEP_FACTOR:.4f}")
  return lo, hi


def _check_timing(s: SweepSettings) -> None:
  for name in ("iters", "samples"):
    if getattr(s, name) < 1:
      raise SettingsError(f"--{name}={getattr(s, name)} must be >= 1")
  if 1 < s.iters < 6:
    raise SettingsError(f"--iters={s.iters}: use 1 (latency mode: one operation per sample) or >= 6 (the"
                        " long timed program; the short one runs 2)")
  if s.hang_timeout <= 0:
    raise SettingsError(f"--hang_timeout={s.hang_timeout} must be > 0")
  if s.sample_ms < 0:
    raise SettingsError(f"--sample_ms={s.sample_ms} must be >= 0")
  if s.warmup < 0:
    raise SettingsError(f"--warmup={s.warmup} must be >= 0")


def check_peaks(link_peaks_text: str | None, fabric: str | None) -> None:
  """--link_peaks and --fabric parse (one line when not)."""
  try:
    link_peaks.parse(link_peaks_text)
    if fabric and fabric.strip().lower() != "none":
      fabric_description.parse(fabric)
  except (link_peaks.LinkPeakError, fabric_description.FabricError) as e:
    raise SettingsError(str(e)) from None


def _check_profile(s: SweepSettings) -> tuple[int, ...]:
  try:
    profile = tuple(int(v) for v in s.profile_points)
  except ValueError:
    raise SettingsError(f"--profile_points={','.join(s.profile_points)}: give point numbers, e.g. 1,5") from None
  if any(v < 1 for v in profile):
    raise SettingsError(f"--profile_points={','.join(s.profile_points)}: points are numbered from 1")
  if profile and s.iters == 1:
    raise SettingsError("--profile_points traces the timed programs: not in latency mode (--iters=1)")
  if s.root < 0:
    raise SettingsError(f"--root={s.root}: the broadcast's source is a group rank, >= 0")
  return profile


def _check_overlap(s: SweepSettings) -> int | str | None:
  """The --overlap spec, refused with command buffers, in latency mode and on a TPU target."""
  try:
    spec = overlap.parse_spec(s.overlap)
  except ValueError as e:
    raise SettingsError(str(e)) from None
  if spec and s.command_buffer != "no":
    raise SettingsError(f"--command_buffer={s.command_buffer} with --overlap: the overlap arms are compiled"
                        " without command buffers; measure them apart")
  if spec and s.iters == 1:
    raise SettingsError("--overlap times its three arms by difference: not in latency mode (--iters=1)")
  if machine.is_tpu_target(s.target) and (spec or s.command_buffer != "no"):
    raise SettingsError(f"--{'overlap' if spec else 'command_buffer'} reads XLA:GPU's schedule and thunks;"
                        f" a TPU --target={s.target} compiles with XLA:TPU: drop it")
  for name in s.collectives:
    if refused := command_buffer.refuses_collective(s.command_buffer, name):
      raise SettingsError(refused)
  return spec


def check(s: SweepSettings) -> sweep.SweepConfig:
  """Every check that needs no device, in the command's order; returns the sweep's configuration."""
  _check_run_only(s)
  lo, hi = _check_sizes(s)
  _check_timing(s)
  crash = rank_value(s.inject_crash, "inject_crash", 1)
  check_peaks(s.link_peaks, s.fabric)
  hang = rank_value(s.inject_hang, "inject_hang", 1)
  dtypes = choose(s.dtype, tuple(DTYPES), "dtype")
  profile = _check_profile(s)
  overlap_spec = _check_overlap(s)
  names = with_ops(choose(s.collectives, collectives.NAMES, "collective", collectives.RAGGED),
                   choose(s.op, reduce_ops.OPS, "reduction operator"), dtypes,
                   explicit=tuple(s.collectives) != ("all",), inplace=s.inplace, root=s.root)
  tpu = machine.is_tpu_target(s.target)
  return sweep.SweepConfig(
      collectives=names,
      scopes=choose(s.scopes, tpu_slice.SCOPES, "TPU scope") if tpu else choose(s.scopes, SCOPES, "scope"),
      dtypes=dtypes, min_bytes=lo, max_bytes=hi, step_factor=s.step_factor,
      iters=s.iters, warmup=s.warmup, samples=s.samples, check=s.check,
      sample_s=s.sample_ms * 1e-3, hang_timeout=s.hang_timeout,
      inject_delay=rank_value(s.inject_delay, "inject_delay", 1e-3),
      inject_crash=(crash[0], int(crash[1])) if crash else None, link_peaks=s.link_peaks, fabric=s.fabric,
      inject_hang=(hang[0], int(hang[1])) if hang else None, target=s.target, profile_points=profile,
      keep_going=s.keep_going, nccl_debug=s.nccl_debug, overlap=overlap_spec,
      command_buffer=s.command_buffer)


def topology_of(s: SweepSettings) -> Topology | None:
  """--topology as the target reads it (None when not given)."""
  try:
    return machine.parse_target_topology(s.target, s.topology)
  except (machine.TopologyError, tpu_kinds.KindError) as e:
    raise SettingsError(str(e)) from None


def outdir_of(s: SweepSettings) -> str:
  """The run folder: the resumed one, the one asked for, or a new runs/<UTC timestamp>; a new run never
  writes into a folder that holds one."""
  outdir = s.resume or s.outdir or os.path.join("runs", run_folder.default_name())
  if not s.resume and run_folder.read_meta(outdir) is not None:
    raise SettingsError(f"--outdir={outdir} already holds a run: choose a new folder, or continue that run"
                        f" with --resume={outdir}")
  return outdir
