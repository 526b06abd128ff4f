"""A whole `microbench` run: machine set-up, the sweep, its outputs and the exit status."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import signal
import sys
from typing import Any

from microbench.meshes.scopes import plan_scopes
from microbench.meshes.topology import Topology, TopologyError
from microbench.bench import command_buffer, settings, sizes, sweep, tpu_peaks
from microbench.cluster import distributed, environment, machine, nccl_debug
from microbench.fabric import description as fabric_description
from microbench.fabric import expected
from microbench.fabric import link_peaks
from microbench.cluster.watchdog import Watchdog
from microbench.output import run_folder, table
from microbench.report import alpha_beta, nccl_log
from microbench.fabric import tpu_kinds
from microbench.bench import compile_cache
from microbench.aot import gpu_compile, tpu_compile

# Per device a point holds the known inputs, the check's output, then the loop carry and the body's
# temporary (all-gather: its input shard too): about 4 S at the peak.
_DEVICE_BYTES_PER_S = 4
JOB_FAILED = 3  # exit status when another process of the job died


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _device_memory() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  limit = machine.device_memory(jax.local_devices()[0])
  if limit:
    return limit
  # CPU devices share host memory.
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return host // max(1, jax.local_device_count())


def _check_memory(cfg: sweep.SweepConfig) -> None:
  need = _DEVICE_BYTES_PER_S * cfg.max_bytes
  have = cfg.device_memory or _device_memory()
  if need > have:
    most = sizes.format_size(have // 4 // 2**20 * 2**20)
    raise settings.SettingsError(
        f"--max_bytes={sizes.format_size(cfg.max_bytes)} needs about {sizes.format_size(need)} per device but a "
        f"device has {have / 2**30:.1f} GiB; lower --max_bytes to at most {most}")


def _write_model(outdir: str, records: list[dict[str, Any]], out: run_folder.RunOutputs) -> None:
  """model.json: the alpha-beta fit of every series measured so far (also after an interruption), and with
  matplotlib (the `report` extra) the report's figures in the run's TensorBoard events (Images tab)."""
  try:
    alpha_beta.write_model(outdir, alpha_beta.fit_run(records))
  except Exception as e:  # pylint: disable=broad-except
    out.print(f"# no {alpha_beta.MODEL}: {type(e).__name__}: {e}")  # the measurements are already safe
  if importlib.util.find_spec("matplotlib") is None:
    return
  try:
    from microbench.report import build  # pylint: disable=g-import-not-at-top  (imports matplotlib)
    build.sweep_images(outdir, records)
  except Exception as e:  # pylint: disable=broad-except
    out.print(f"# no figures in the TensorBoard events: {type(e).__name__}: {e}")


def _raise_interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt


def _nccl_facts(outdir: str, meta: dict[str, Any], out: run_folder.RunOutputs) -> dict[str, Any]:
  """What NCCL did, from the captured logs, with a warning line for each thing a cluster user must know."""
  logs = nccl_debug.read_logs(outdir)
  facts = nccl_log.parse(logs)
  env = meta.get("environment") or {}
  variables = {k: v for k, v in (env.get("variables") or {}).items() if k.startswith("NCCL_")}
  facts.update(files=sorted(logs), warnings=nccl_log.warnings(
      facts, nccl_log.expected_network(env), captured=True, variables=variables))
  for line in facts["warnings"]:
    out.print(f"# NCCL: {line}")
  return facts


@dataclasses.dataclass
class _Devices:
  """Where the sweep runs: the mesh on the machine (or on a target's compile-only devices) and how it was found."""
  cfg: sweep.SweepConfig
  topology: Topology
  mesh: Any
  note: str
  hosts: list[str]
  emulated: bool
  target: Any = None  # the compile-only target (machine.resolve_target), None for a run
  capture_nccl: bool = False


def _target_devices(cfg: sweep.SweepConfig, topology: Topology | None, nodes_per_rack: int | None) -> _Devices:
  """Compile-only devices of a GPU or TPU kind: nothing runs, no processes to join."""
  try:
    topology, target, mesh, note = machine.resolve_target(cfg.target, topology, nodes_per_rack)
  except (TopologyError, gpu_compile.TargetError, gpu_compile.KindError, tpu_compile.TargetError,
          tpu_kinds.KindError) as e:
    raise settings.SettingsError(str(e)) from None
  tpu = machine.is_tpu_target(cfg.target)
  cfg = dataclasses.replace(cfg, device_memory=target.memory_bytes,
                            memory_fraction=gpu_compile.TPU_MEM_FRACTION if tpu else None)
  # nothing runs, no communicator starts: no NCCL log to capture
  return _Devices(cfg, topology, mesh, note, [f"compile-only-host-{i}" for i in range(target.hosts)], False, target)


def _run_devices(cfg: sweep.SweepConfig, topology: Topology | None, outdir: str, nodes_per_rack: int | None,
                 cluster: distributed.Settings) -> _Devices:
  """This job's devices: NCCL's log capture set up before any communicator, the processes joined, the mesh."""
  capture_nccl = nccl_debug.wanted(cfg.nccl_debug)
  if capture_nccl:  # before any communicator starts: NCCL reads its variables once
    nccl_debug.enable(outdir)
  distributed.initialize(cluster)
  emulated = machine.prepare_cpu_devices(topology, cluster.enabled)
  try:
    topology, mesh, note = machine.resolve(topology, nodes_per_rack)
  except TopologyError as e:
    raise settings.SettingsError(str(e)) from None
  return _Devices(cfg, topology, mesh, note, distributed.process_hosts(), emulated, capture_nccl=capture_nccl)


def _compilation_cache(compilation_cache: str, cfg: sweep.SweepConfig) -> tuple[str | None, str]:
  """(the cache folder in use or None, what meta.json records)."""
  cache_dir, cache_note = compile_cache.resolve(compilation_cache, cfg.target, cfg.command_buffer)
  if cache_dir:
    try:
      compile_cache.enable(cache_dir)
    except OSError as e:  # an unwritable folder: the sweep compiles as without the cache
      cache_dir, cache_note = None, f"off: {cache_dir}: {e.strerror}"
  return cache_dir, cache_note


def _sized(cfg: sweep.SweepConfig, dev: _Devices, outdir: str) -> sweep.SweepConfig:
  """--max_bytes=auto for the platform, refused when a run's points cannot fit; traces into the run folder."""
  if cfg.max_bytes is None:  # --max_bytes=auto
    platform = dev.mesh.devices.flat[0].platform
    cfg = dataclasses.replace(cfg, max_bytes=sizes.default_max_bytes(platform, cfg.min_bytes))
  if not dev.target:  # a compile-only run reports each point's fit instead
    _check_memory(cfg)
  if cfg.profile_points:
    cfg = dataclasses.replace(cfg, profile_dir=outdir)
  return cfg


@dataclasses.dataclass
class _Fabric:
  """The link peaks the points are read against and, on a GPU fabric, what the fabric model expects per scope."""
  fab: Any
  peaks: dict[str, link_peaks.LevelPeak]
  found: Any = None  # expected.machine(...) where the model applies
  models: dict[str, expected.ScopeModel] = dataclasses.field(default_factory=dict)


def _fabric(cfg: sweep.SweepConfig, dev: _Devices, plans: list) -> _Fabric:
  device = dev.mesh.devices.flat[0]
  try:
    fab = fabric_description.parse(cfg.fabric) if cfg.fabric and cfg.fabric.strip().lower() != expected.OFF else None
    given = {**(fab.level_peaks() if fab else {}), **link_peaks.parse(cfg.link_peaks)}
    peaks = link_peaks.resolve(device.device_kind, given)
  except (link_peaks.LinkPeakError, fabric_description.FabricError) as e:
    raise settings.SettingsError(str(e)) from None
  # The fabric model's expectations describe GPU fabrics; a TPU pod's bound is the torus model's peak per scope.
  if dev.target or tpu_peaks.is_tpu_mesh(dev.mesh.axis_names):  # nothing is measured for a target
    return _Fabric(fab, peaks)
  found = expected.machine(cfg.fabric, device.device_kind, device.platform, dev.topology.gpus)
  models = {p.name: expected.scope_model(found.fabric, found.source, p.groups, dev.topology.shape)
            for p in plans if not p.skip_reason}
  return _Fabric(fab, peaks, found, models)


def _meta(dev: _Devices, fabric: _Fabric, plans: list, flag_values: dict[str, Any], cache_note: str,
          old_meta: dict[str, Any], resumed: bool, enabled: bool) -> dict[str, Any]:
  """meta.json as the run starts (status running)."""
  found = fabric.found
  return {
      **machine.describe(dev.mesh, dev.hosts),
      "topology": dev.topology.as_dict(), "topology_source": dev.note, "cpu_devices_emulated": dev.emulated,
      "flags": flag_values, "max_bytes": dev.cfg.max_bytes, "started_at": old_meta.get("started_at", _now()),
      "resumed_at": old_meta.get("resumed_at", []) + ([_now()] if resumed else []),
      "scopes": {p.name: {"axes": list(p.axes), "group_size": p.group_size, "num_groups": p.num_groups,
                          "groups": p.groups.tolist(), "skipped": p.skip_reason} for p in plans},
      "status": "running",
      "link_peaks": link_peaks.describe(fabric.peaks),
      "fabric": fabric.fab.describe() if fabric.fab else None,
      "expected": {**found.describe(), "low_ratio": expected.LOW_RATIO,
                   "scopes": {name: m.describe() for name, m in fabric.models.items()}} if found else None,
      "target": dev.target.describe() if dev.target else None,
      "compilation_cache": cache_note,
      "environment": environment.capture(dev.hosts) if enabled else None,
  }


def _print_header(out: run_folder.RunOutputs, dev: _Devices, fabric: _Fabric, meta: dict[str, Any], outdir: str,
                  cache_dir: str | None, resumed: bool, done: set[tuple]) -> None:
  target, topology, mesh = dev.target, dev.topology, dev.mesh
  if target:
    tpu = machine.is_tpu_target(dev.cfg.target)
    compiler = "XLA:TPU" if tpu else "XLA:GPU"
    what = (f"{target.kind.title} slice {topology}" if tpu else
            f"{target.hosts} host(s) x {target.gpus_per_host} {target.kind.title}")
    out.print(f"# microbench: jax {meta['jax_version']}, compile only for {what} ({compiler},"
              f" --target={target.kind.name}): nothing runs, every program is compiled and its HLO checked")
  else:
    out.print(f"# microbench: jax {meta['jax_version']}, {meta['process_count']} process(es), "
              f"{meta['device_count']} x {meta['device_kind']} ({meta['platform']})")
  for line in environment.header(meta["environment"]) if out.enabled else []:
    out.print(line)
  out.print(f"# {dev.note}")
  if fabric.found:
    out.print(expected.summary_line(fabric.found))
  out.print(f"# mesh {dict(zip(mesh.axis_names, mesh.devices.shape))}; writing {os.path.abspath(outdir)}")
  if cache_dir:
    out.print(f"# compilation cache {cache_dir}: a program compiled by an earlier run is loaded (--compilation_cache)")
  if resumed:
    out.print(f"# resuming: {len(done)} point(s) already recorded are skipped")


def recorded_defaults(flag_values: dict[str, Any]) -> dict[str, Any]:
  """The defaults of the recorded settings (the folders aside): what the config text says differs from."""
  every = settings.defaults()
  return {k: every[k] for k in flag_values if k in every and k not in ("outdir", "resume")}


def start(s: settings.SweepSettings, cluster: distributed.Settings = distributed.Settings()) -> int:
  """The library's entry: `s` checked (settings.SettingsError, one line, before any device is touched), then
  run as the command runs it; returns the exit code. A resumed run's caller loads its recorded settings."""
  cfg = settings.check(s)
  topology = settings.topology_of(s)
  outdir = settings.outdir_of(s)
  return execute(cfg, topology, outdir, resumed=bool(s.resume), nodes_per_rack=s.nodes_per_rack,
                 flag_values=settings.recorded(s, cluster.enabled), cluster=cluster,
                 compilation_cache=s.compilation_cache)


def execute(cfg: sweep.SweepConfig, topology: Topology | None, outdir: str, *, resumed: bool,
            nodes_per_rack: int | None, flag_values: dict[str, Any],
            cluster: distributed.Settings = distributed.Settings(), compilation_cache: str = compile_cache.OFF,
            defaults: dict[str, Any] | None = None) -> int:
  """Runs (or, for a target, compiles) the sweep of a checked `cfg` into `outdir`; returns the exit code.
  `compilation_cache`: --compilation_cache (compile_cache.resolve; off for API callers unless asked).
  `defaults`: what `flag_values` are compared with in the config text (None: the settings' own defaults).
  What the devices refuse (a target, a topology, too large a size, a link peak) is a settings.SettingsError."""
  if cfg.target:
    dev = _target_devices(cfg, topology, nodes_per_rack)
  else:
    dev = _run_devices(cfg, topology, outdir, nodes_per_rack, cluster)
  import jax  # pylint: disable=g-import-not-at-top
  refused = None if dev.target else command_buffer.refusal(cfg.command_buffer, dev.mesh.devices.flat[0].platform)
  if refused:
    raise settings.SettingsError(refused)
  cache_dir, cache_note = _compilation_cache(compilation_cache, cfg)
  cfg = dev.cfg = _sized(dev.cfg, dev, outdir)
  plans = plan_scopes(dev.topology, cfg.scopes)
  fabric = _fabric(cfg, dev, plans)
  out = run_folder.RunOutputs(outdir, enabled=jax.process_index() == 0)
  previous = run_folder.read_results(outdir) if resumed else []
  done = sweep.finished_points(previous)
  old_meta = (run_folder.read_meta(outdir) or {}) if resumed else {}
  meta = _meta(dev, fabric, plans, flag_values, cache_note, old_meta, resumed, out.enabled)
  out.write_meta(meta)
  out.config(flag_values, recorded_defaults(flag_values) if defaults is None else defaults)  # what differs first
  out.layout(cfg.collectives, [p.name for p in plans if not p.skip_reason])
  _print_header(out, dev, fabric, meta, outdir, cache_dir, resumed, done)
  records: list[dict[str, Any]] = []
  status, code = _sweep(dev, fabric, plans, out, done, previous, records, meta, outdir)
  if status is None:
    return code
  return _outcome(dev, plans, out, status, run_folder.latest(previous + records))


def _sweep(dev: _Devices, fabric: _Fabric, plans: list, out: run_folder.RunOutputs, done: set[tuple],
           previous: list[dict[str, Any]], records: list[dict[str, Any]], meta: dict[str, Any], outdir: str
           ) -> tuple[str | None, int]:
  """The sweep under the watchdog, meta.json's status and model.json kept (also on Ctrl-C, SIGTERM, a lost peer,
  a failed point); (status, 0) to go on to the summary, or (None, exit code) when the run ends here."""
  import jax  # pylint: disable=g-import-not-at-top
  status = "interrupted"

  def on_hang(label: str, seconds: float, rec: dict[str, Any] | None) -> None:
    where = sweep.describe_point(rec) if rec else "the sweep"
    reason = (f"watchdog: the {label} of {where} did not finish within {seconds:.0f} s"
              " (a hung collective or a lost peer)")
    if rec:
      out.record({**rec, "status": "failed", "reason": reason, "finished_at": _now()})
    meta.update(status="failed", finished_at=_now(), points_this_run=len(records), reason=reason)
    out.write_meta(meta)
    out.print(f"\n# {reason}; every finished point is in results.jsonl; continue with --resume={outdir}")
    out.close()
    print(f"microbench: process {jax.process_index()}: {reason}", file=sys.stderr, flush=True)

  watchdog = Watchdog(on_hang, exit_code=JOB_FAILED)
  # A launcher or scheduler stops jobs with SIGTERM: end like Ctrl-C, with meta.json saying so.
  signal.signal(signal.SIGTERM, _raise_interrupt)
  try:
    sweep.run_sweep(dev.cfg, dev.mesh, fabric.peaks, plans, out, done, watchdog, records, fabric.models)
    status = "finished"
  except KeyboardInterrupt:
    out.print("\n# interrupted: every finished point is in results.jsonl; continue with --resume")
    return None, 130
  except sweep.JobFailed as e:
    status = "failed"
    meta["reason"] = str(e)
    out.print(f"\n# {e}; every finished point is in results.jsonl; continue with --resume={outdir}")
    return None, JOB_FAILED
  except sweep.PointFailed as e:
    status = "failed"
    meta["reason"] = str(e)
    out.print(f"\n# stopped: {e}\n# every point measured before it is in results.jsonl; --keep_going measures"
              f" the rest past failed points, --resume={outdir} tries the failed point again")
  finally:
    if dev.capture_nccl and out.enabled:
      meta["nccl"] = _nccl_facts(outdir, meta, out)
    meta.update(status=status, finished_at=_now(), points_this_run=len(records))
    out.write_meta(meta)
    out.close()
    if out.enabled:
      _write_model(outdir, run_folder.latest(previous + records), out)
  return status, 0


def _outcome(dev: _Devices, plans: list, out: run_folder.RunOutputs, status: str,
             everything: list[dict[str, Any]]) -> int:
  """The closing lines (the summary table, wrong values, failed points) and the exit code."""
  if status == "finished" and not everything:  # every scope skipped, every point refused: nothing was checked
    why = "; ".join(f"{p.name}: {p.skip_reason}" for p in plans if p.skip_reason) or (
        "every collective refused every dtype or group size asked")
    print(f"microbench: error: nothing to measure or check ({why}); no point is recorded", file=sys.stderr)
    return 2
  out.print()
  if not dev.target:
    out.print(table.summary(everything))
  wrong = sum((r.get("wrong") or 0) + (r.get("timed_wrong") or 0) for r in everything if r["status"] == "ok")
  errors = [r for r in everything if r["status"] == "error"]
  failed = [r for r in everything if r["status"] in ("failed", "skipped")]  # `skipped`: older runs' name
  if dev.target:
    _target_summary(dev, out, everything, errors)
  else:
    out.print(f"# Out of bounds values : {wrong} {'FAILED' if wrong else 'OK'}")
  if failed:
    out.print(f"# {len(failed)} point(s) FAILED to compile or run:")
    for r in failed:
      out.print(f"#   {sweep.describe_point(r)}: {r.get('reason', '')}")
  if errors:
    out.print(f"# {len(errors)} point(s) failed their HLO check: {errors[0]['reason']}")
  return 1 if wrong or errors or failed else 0


def _target_summary(dev: _Devices, out: run_folder.RunOutputs, everything: list[dict[str, Any]],
                    errors: list[dict[str, Any]]) -> None:
  target, tpu = dev.target, machine.is_tpu_target(dev.cfg.target)
  compiled = [r for r in everything if r["status"] == "compiled"]
  too_big = [r for r in compiled if r.get("fits") is False]
  usable = ("the whole" if tpu else f"the {gpu_compile.mem_fraction():.0%} of")
  why = "XLA:TPU's allocator has all of it" if tpu else "XLA_PYTHON_CLIENT_MEM_FRACTION"
  checked = "every one's HLO check passed" if not errors else f"{len(errors)} more failed their HLO check"
  out.print(f"# {len(compiled)} point(s) compiled for {target.kind.title}, {checked} on"
            f" {'XLA:TPU' if tpu else 'XLA:GPU'}'s HLO; {len(too_big)} do not fit {usable}"
            f" {target.memory_bytes / 2**30:.1f} GiB per device that JAX uses ({why})")
