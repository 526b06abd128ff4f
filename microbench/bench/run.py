"""A whole `microbench` run: machine set-up, the sweep, its outputs and the exit status."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import signal
import sys
from typing import Any

from absl import app, flags

from microbench.meshes.scopes import plan_scopes
from microbench.meshes.topology import Topology, TopologyError
from microbench.bench import command_buffer, sizes, sweep, tpu_peaks
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
    raise app.UsageError(
        f"--max_bytes={sizes.format_size(cfg.max_bytes)} needs about {sizes.format_size(need)} per device but a "
        f"device has {have / 2**30:.1f} GiB; lower --max_bytes to at most {sizes.format_size(have // 4 // 2**20 * 2**20)}")


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


def execute(cfg: sweep.SweepConfig, topology: Topology | None, outdir: str, *, resumed: bool,
            nodes_per_rack: int | None, flag_values: dict[str, Any],
            cluster: distributed.Settings = distributed.Settings(), compilation_cache: str = compile_cache.OFF) -> int:
  """Runs (or, for a target, compiles) the sweep into `outdir`; returns the exit code. `compilation_cache`:
  --compilation_cache (compile_cache.resolve; off for API callers unless asked)."""
  target = None
  tpu = machine.is_tpu_target(cfg.target)
  if cfg.target:  # compile-only devices of a GPU kind: nothing runs, no processes to join
    try:
      topology, target, mesh, note = machine.resolve_target(cfg.target, topology, nodes_per_rack)
    except (TopologyError, gpu_compile.TargetError, gpu_compile.KindError, tpu_compile.TargetError,
            tpu_kinds.KindError) as e:
      raise app.UsageError(str(e)) from None
    cfg = dataclasses.replace(cfg, device_memory=target.memory_bytes,
                              memory_fraction=gpu_compile.TPU_MEM_FRACTION if tpu else None)
    capture_nccl = False  # nothing runs, no communicator starts
    emulated, hosts = False, [f"compile-only-host-{i}" for i in range(target.hosts)]
    import jax  # pylint: disable=g-import-not-at-top
  else:
    capture_nccl = nccl_debug.wanted(cfg.nccl_debug)
    if capture_nccl:  # before any communicator starts: NCCL reads its variables once
      nccl_debug.enable(outdir)
    distributed.initialize(cluster)
    emulated = machine.prepare_cpu_devices(topology, cluster.enabled)
    import jax  # pylint: disable=g-import-not-at-top
    try:
      topology, mesh, note = machine.resolve(topology, nodes_per_rack)
    except TopologyError as e:
      raise app.UsageError(str(e)) from None
    hosts = distributed.process_hosts()
  refused = None if target else command_buffer.refusal(cfg.command_buffer, mesh.devices.flat[0].platform)
  if refused:
    raise app.UsageError(refused)
  cache_dir, cache_note = compile_cache.resolve(compilation_cache, cfg.target, cfg.command_buffer)
  if cache_dir:
    try:
      compile_cache.enable(cache_dir)
    except OSError as e:  # an unwritable folder: the sweep compiles as without the cache
      cache_dir, cache_note = None, f"off: {cache_dir}: {e.strerror}"
  if cfg.max_bytes is None:  # --max_bytes=auto
    platform = mesh.devices.flat[0].platform
    cfg = dataclasses.replace(cfg, max_bytes=sizes.default_max_bytes(platform, cfg.min_bytes))
  if not target:  # a compile-only run reports each point's fit instead
    _check_memory(cfg)
  if cfg.profile_points:
    cfg = dataclasses.replace(cfg, profile_dir=outdir)
  plans = plan_scopes(topology, cfg.scopes)
  try:
    fab = fabric_description.parse(cfg.fabric) if cfg.fabric and cfg.fabric.strip().lower() != expected.OFF else None
    given = {**(fab.level_peaks() if fab else {}), **link_peaks.parse(cfg.link_peaks)}
    peaks = link_peaks.resolve(mesh.devices.flat[0].device_kind, given)
  except (link_peaks.LinkPeakError, fabric_description.FabricError) as e:
    raise app.UsageError(str(e)) from None
  models: dict[str, expected.ScopeModel] = {}
  # The fabric model's expectations describe GPU fabrics; a TPU pod's bound is the torus model's peak per scope.
  expects = not target and not tpu_peaks.is_tpu_mesh(mesh.axis_names)
  if expects:  # what the fabric model expects of each scope's points (nothing is measured for a target)
    found = expected.machine(cfg.fabric, mesh.devices.flat[0].device_kind, mesh.devices.flat[0].platform,
                             topology.gpus)
    models = {p.name: expected.scope_model(found.fabric, found.source, p.groups, topology.shape)
              for p in plans if not p.skip_reason}
  out = run_folder.RunOutputs(outdir, enabled=jax.process_index() == 0)
  previous = run_folder.read_results(outdir) if resumed else []
  done = sweep.finished_points(previous)
  old_meta = (run_folder.read_meta(outdir) or {}) if resumed else {}
  meta = {
      **machine.describe(mesh, hosts),
      "topology": topology.as_dict(), "topology_source": note, "cpu_devices_emulated": emulated,
      "flags": flag_values, "max_bytes": cfg.max_bytes, "started_at": old_meta.get("started_at", _now()),
      "resumed_at": old_meta.get("resumed_at", []) + ([_now()] if resumed else []),
      "scopes": {p.name: {"axes": list(p.axes), "group_size": p.group_size, "num_groups": p.num_groups,
                          "groups": p.groups.tolist(), "skipped": p.skip_reason} for p in plans},
      "status": "running",
      "link_peaks": link_peaks.describe(peaks),
      "fabric": fab.describe() if fab else None,
      "expected": {**found.describe(), "low_ratio": expected.LOW_RATIO,
                   "scopes": {name: m.describe() for name, m in models.items()}} if expects else None,
      "target": target.describe() if target else None,
      "compilation_cache": cache_note,
      "environment": environment.capture(hosts) if out.enabled else None,
  }
  out.write_meta(meta)
  out.config(flag_values, {k: flags.FLAGS[k].default for k in flag_values  # what differs first, then all
                           if k in flags.FLAGS and k not in ("outdir", "resume")})
  out.layout(cfg.collectives, [p.name for p in plans if not p.skip_reason])
  if target:
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
  out.print(f"# {note}")
  if expects:
    out.print(expected.summary_line(found))
  out.print(f"# mesh {dict(zip(mesh.axis_names, mesh.devices.shape))}; writing {os.path.abspath(outdir)}")
  if cache_dir:
    out.print(f"# compilation cache {cache_dir}: a program compiled by an earlier run is loaded (--compilation_cache)")
  if resumed:
    out.print(f"# resuming: {len(done)} point(s) already recorded are skipped")
  records: list[dict[str, Any]] = []
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
    sweep.run_sweep(cfg, mesh, peaks, plans, out, done, watchdog, records, models)
    status = "finished"
  except KeyboardInterrupt:
    out.print("\n# interrupted: every finished point is in results.jsonl; continue with --resume")
    return 130
  except sweep.JobFailed as e:
    status = "failed"
    meta["reason"] = str(e)
    out.print(f"\n# {e}; every finished point is in results.jsonl; continue with --resume={outdir}")
    return JOB_FAILED
  except sweep.PointFailed as e:
    status = "failed"
    meta["reason"] = str(e)
    out.print(f"\n# stopped: {e}\n# every point measured before it is in results.jsonl; --keep_going measures"
              f" the rest past failed points, --resume={outdir} tries the failed point again")
  finally:
    if capture_nccl and out.enabled:
      meta["nccl"] = _nccl_facts(outdir, meta, out)
    meta.update(status=status, finished_at=_now(), points_this_run=len(records))
    out.write_meta(meta)
    out.close()
    if out.enabled:
      _write_model(outdir, run_folder.latest(previous + records), out)
  everything = run_folder.latest(previous + records)
  if status == "finished" and not everything:  # every scope skipped, every point refused: nothing was checked
    why = "; ".join(f"{p.name}: {p.skip_reason}" for p in plans if p.skip_reason) or (
        "every collective refused every dtype or group size asked")
    print(f"microbench: error: nothing to measure or check ({why}); no point is recorded", file=sys.stderr)
    return 2
  out.print()
  if not target:
    out.print(table.summary(everything))
  wrong = sum((r.get("wrong") or 0) + (r.get("timed_wrong") or 0) for r in everything if r["status"] == "ok")
  errors = [r for r in everything if r["status"] == "error"]
  failed = [r for r in everything if r["status"] in ("failed", "skipped")]  # `skipped`: older runs' name
  compiled = [r for r in everything if r["status"] == "compiled"]
  if target:
    too_big = [r for r in compiled if r.get("fits") is False]
    usable = ("the whole" if tpu else f"the {gpu_compile.mem_fraction():.0%} of")
    why = "XLA:TPU's allocator has all of it" if tpu else "XLA_PYTHON_CLIENT_MEM_FRACTION"
    checked = "every one's HLO check passed" if not errors else f"{len(errors)} more failed their HLO check"
    out.print(f"# {len(compiled)} point(s) compiled for {target.kind.title}, {checked} on"
              f" {'XLA:TPU' if tpu else 'XLA:GPU'}'s HLO; {len(too_big)} do not fit {usable}"
              f" {target.memory_bytes / 2**30:.1f} GiB per device that JAX uses ({why})")
  else:
    out.print(f"# Out of bounds values : {wrong} {'FAILED' if wrong else 'OK'}")
  if failed:
    out.print(f"# {len(failed)} point(s) FAILED to compile or run:")
    for r in failed:
      out.print(f"#   {sweep.describe_point(r)}: {r.get('reason', '')}")
  if errors:
    out.print(f"# {len(errors)} point(s) failed their HLO check: {errors[0]['reason']}")
  return 1 if wrong or errors or failed else 0
