"""`microbench`: nccl-tests-style collective sweeps over the machine's fabric levels.

Flags only: they become microbench.bench.settings.SweepSettings, which the library checks (its SettingsError is
the one-line `microbench: error: ...`) and runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

from absl import app, flags

from microbench.meshes import tpu_slice
from microbench.meshes.scopes import SCOPES
from microbench.bench import collectives, command_buffer, reduce_ops, run as bench_run, settings as bench_settings
from microbench.bench.program import DTYPES
from microbench.cli import absl_app, cluster_flags, store_flags
from microbench.fabric import link_peaks
from microbench.output import run_folder

FLAGS = flags.FLAGS

flags.DEFINE_list("collectives", ["all"], f"Collectives to run, or 'all': {', '.join(collectives.NAMES)}. By name"
                  f" only (not in 'all'): the ragged all-to-all per MoE send-size distribution,"
                  f" {', '.join(collectives.RAGGED)}.")
flags.DEFINE_list("scopes", ["all"], f"Scopes to run, or 'all': {', '.join(SCOPES)}; on a TPU target:"
                  f" {', '.join(tpu_slice.SCOPES)}.")
flags.DEFINE_list("op", ["sum"], "Reduction operator(s) of all_reduce and reduce_scatter (nccl-tests' -o), or 'all':"
                  f" {', '.join(reduce_ops.OPS)}. Other collectives have none.")
flags.DEFINE_enum("inplace", "no", ["no", "yes", "both"], "Run each collective in place (its input donated, its"
                  " output in the input's buffer, verified in the HLO: nccl-tests' in-place columns), out of place"
                  " (no), or both, recorded as <collective>_inplace beside it.")
flags.DEFINE_integer("root", 0, "The broadcast's source, a group rank (nccl-tests' -r); a scope whose groups are"
                     " smaller is skipped with the reason. Recorded as broadcast_root<R>.")
flags.DEFINE_string("overlap", None, "Measure each point beside independent compute (OSU's non-blocking overlap,"
                    " PARAM's comms-compute mode): the collective alone, a matmul alone and both in one loop, timed"
                    " interleaved, with OSU's overlap % and whether XLA scheduled the matmul between the collective's"
                    " start and done. auto: a [D, D] matmul sized to take as long as the collective; N: D = N"
                    " (PARAM's --mm-dim).")
flags.DEFINE_string("min_bytes", "1K", "Smallest message size S (8, 64K, 32M, 1G).")
flags.DEFINE_string("max_bytes", "auto", "Largest message size S; auto: 4M on CPU devices (past its caches a CPU"
                    " only copies memory, and 16M points cost half a sweep), 16M on GPUs (and --target).")
flags.DEFINE_float("step_factor", 4.0, "Multiply the size by this between points (> 1; nccl-tests' -f 2 doubles the"
                   " points and about the time).")
flags.DEFINE_list("dtype", ["float32"], f"Element type(s): {', '.join(DTYPES)}.")
flags.DEFINE_integer("iters", 20, "Operations in the long timed program (even; the short one runs 2, the"
                     " reported time is the difference per added operation); an upper bound when --sample_ms"
                     " is set. 1 = latency mode: every sample is one operation, dispatch included.")
flags.DEFINE_float("sample_ms", 20.0, "Use fewer operations in the long program (down to 6) for operations that"
                   " are already long, so one of its calls lasts about this long; 0 always uses --iters.")
flags.DEFINE_integer("warmup", 1, "Untimed calls per point before the timed ones: the long program's checked twin"
                     " (every repetition's output digested); with 0 it runs once after them.")
flags.DEFINE_integer("samples", 10, "Timed pairs of calls (short, long) per point, or single operations with"
                     " --iters=1: median, min, max over these.")
flags.DEFINE_float("hang_timeout", 120.0, "Watchdog floor in seconds: a device step that runs longer than this"
                   " and 10x its expected time ends the job (a hung collective), recorded as failed.")
flags.DEFINE_bool("keep_going", False, "A point whose program fails to compile or run is recorded and the sweep"
                  " goes on to the other points (make -k); the run still exits 1 and lists each failed point."
                  " Without it the sweep stops at the first failed point (exit 1), keeping every point before it.")
flags.DEFINE_bool("nccl_debug", False, "Capture NCCL's INFO log of every process into RUN/nccl/ (NCCL_DEBUG=INFO,"
                  " subsystems INIT,NET,GRAPH,TUNING; what you set yourself is kept) and put what NCCL did in"
                  " meta.json's `nccl`: version, network, NICs, channels, transports, algorithm per collective."
                  " Also on when NCCL_DEBUG is set.")
flags.DEFINE_multi_string("nccl_env", [], "Run the sweep once per NCCL setting, each in its own process, NCCL's"
                          " own choice first: VAR=v1,v2 per variable (NCCL_ALGO, NCCL_PROTO, NCCL_MAX_NCHANNELS; every"
                          " combination runs) or a preset (algorithms, protocols, ring-tree-protocols). Pairs NCCL"
                          " does not implement for a collective are refused or left out, said before anything"
                          " runs. Runs go to RUN/nccl_settings/<setting>; microbench-report RUN --nccl_tuner_conf"
                          " writes NCCL's tuner table from them.")
flags.DEFINE_enum("command_buffer", "no", list(command_buffer.SETTINGS), "XLA:GPU's command buffers (CUDA graphs,"
                  " nccl-tests' -G): yes records each point's programs, collectives and timed loop included, into"
                  " one (checked in the compiled program) and launches that; both times the point without and with"
                  " them (time_us and time_us_command_buffer, a cmdbuf(us) column). no (default): none at all,"
                  " every operation launched on its own, as nccl-tests without -G. GPUs and --target only.")
flags.DEFINE_bool("check", True, "Check every point's results exactly against known inputs (on the devices): the"
                  " check program's every element, the timed calls' outputs by digest.")
flags.DEFINE_string("compilation_cache", "auto", "JAX's persistent compilation cache: a rerun of a sweep loads its"
                    " programs instead of compiling them (never timed either way). auto: $MICROBENCH_COMPILATION_CACHE,"
                    " else ~/.cache/microbench/xla; a folder; none: off. Always off with --target, --command_buffer"
                    " or an --xla_dump_to in XLA_FLAGS, where a real compile is read.")
flags.DEFINE_string("topology", None, "Machine shape racks:R,nodes:N,gpus:G (nodes per rack, gpus per node)."
                    " Default: from the processes' hosts; a single CPU process emulates nodes:2,gpus:4.")
flags.DEFINE_string("link_peaks", None, "Link peak per fabric level in GB/s per direction per rank, or a link"
                    f" name ({', '.join(link_peaks.LINKS)}): e.g. scale_up:450,scale_out:ndr. Levels:"
                    f" {', '.join(link_peaks.LEVELS)}. Default: NVLink from the device kind; no NIC peak.")
flags.DEFINE_string("fabric", None, "The machine the points are read against: its links give the link peaks and"
                    " what the fabric model expects of each point (expected busbw, measured/expected, LOW):"
                    " leonardo, lumi, alps, jupiter, dgx, nvl72 (with :nic=GBPS,... overrides) or"
                    " testbed:racks=R,hosts_per_rack=H,host_rate=...,uplink_rate=...; none: no expectation."
                    " Default: detected from the GPU kind and GPUs per node (none on CPU); --link_peaks, where"
                    " given, wins per level.")
flags.DEFINE_list("profile_points", [], "Point numbers (as the table's progress counts them, from 1) to trace with"
                  " jax.profiler after they are measured: one call of each timed program into the run folder"
                  " (TensorBoard's Profile tab).")
flags.DEFINE_string("outdir", None, "Run folder. Default: runs/<UTC timestamp>.")
flags.DEFINE_string("resume", None, "Continue the interrupted run in this folder with its recorded flags,"
                    " skipping points already in its results.jsonl.")
flags.DEFINE_string("inject_delay", None, "Fault injection RANK:MS: process RANK adds MS per operation to every"
                    " timed call.")
flags.DEFINE_string("inject_crash", None, "Fault injection RANK:POINT: process RANK dies before point POINT+1.")
flags.DEFINE_string("inject_hang", None, "Fault injection RANK:POINT: process RANK hangs in point POINT+1's timed"
                    " runs, like a collective that never returns.")

SWEEP_FLAGS = bench_settings.RECORDED  # recorded in meta.json; a resumed run takes them back from there

# What only a run does (processes, fault injection, traces of timed calls): refused with --target.
RUN_ONLY_FLAGS = (*cluster_flags.JOB_FLAGS, *bench_settings.RUN_ONLY)  # a compile-only run times nothing


def settings_from_flags() -> bench_settings.SweepSettings:
  """The flags as the library's sweep settings, unchecked (bench_settings.check refuses what cannot run)."""
  values = {f.name: FLAGS[f.name].value for f in dataclasses.fields(bench_settings.SweepSettings)}
  return bench_settings.SweepSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" chatter on every start
  if FLAGS.resume:
    _load_resumed_flags(FLAGS.resume)
  cluster_flags.refuse_with_target(RUN_ONLY_FLAGS)  # the job's flags too, in one line
  s = settings_from_flags()
  if FLAGS.nccl_env:
    return _per_nccl_setting(s)
  try:
    cfg = bench_settings.check(s)
    topology = bench_settings.topology_of(s)
    outdir = bench_settings.outdir_of(s)
    cluster = cluster_flags.settings()
    code = bench_run.execute(cfg, topology, outdir, resumed=bool(s.resume), nodes_per_rack=s.nodes_per_rack,
                             flag_values=bench_settings.recorded(s, cluster.enabled), cluster=cluster,
                             compilation_cache=s.compilation_cache)
  except bench_settings.SettingsError as e:
    raise app.UsageError(str(e)) from None
  store_flags.record(outdir)
  if code == bench_run.JOB_FAILED:
    # A peer is gone: skip jax.distributed's shutdown barrier, which would only wait for it and abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


def _per_nccl_setting(s: bench_settings.SweepSettings) -> int:
  """--nccl_env: the sweep once per setting, each its own process (bench/nccl_runs.py)."""
  from microbench.bench import nccl_runs  # pylint: disable=g-import-not-at-top
  from microbench.cluster import nccl_settings  # pylint: disable=g-import-not-at-top
  for flag, given in (("target", s.target), ("resume", s.resume), ("distributed", cluster_flags.settings().enabled)):
    if given:
      raise app.UsageError(f"--nccl_env with --{flag}: " + (
          "compile only, NCCL never runs" if flag == "target" else "resume one setting's folder on its own"
          if flag == "resume" else "in a multi-process job run one job per setting (NCCL_ALGO=... set) and give"
          " their folders to microbench-report --nccl_tuner_conf"))
  try:
    cfg = bench_settings.check(s)
    settings, notes = nccl_settings.combinations(nccl_settings.parse(FLAGS.nccl_env), cfg.collectives)
  except (bench_settings.SettingsError, nccl_settings.NcclSettingError) as e:
    raise app.UsageError(str(e)) from None
  replaced = [f"{k}={os.environ[k]} in the environment: each setting's run has its own (NCCL's own choice none)"
              for k in nccl_settings.VARIABLES if k in os.environ]
  for line in notes + replaced + nccl_settings.overriding(os.environ, nccl_settings.VARIABLES):
    print(f"microbench: {line}")
  return nccl_runs.run_all(sys.argv[1:], settings, bench_settings.outdir_of(s))


def _load_resumed_flags(outdir: str) -> None:
  """A resumed run repeats the interrupted run's sweep: its flags come from that run's meta.json."""
  meta = run_folder.read_meta(outdir)
  if meta is None:
    raise app.UsageError(f"--resume={outdir}: no {run_folder.META} there; pass the folder of an earlier run"
                         " (on a multi-host job, a folder every process sees)")
  for name in SWEEP_FLAGS:
    if name in meta.get("flags", {}):
      FLAGS[name].value = meta["flags"][name]


def run() -> None:
  """Console-script entry point."""
  absl_app.run(main, "microbench", [__name__, cluster_flags.__name__, store_flags.__name__])
