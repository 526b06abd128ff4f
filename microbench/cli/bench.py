"""`microbench`: nccl-tests-style collective sweeps over the machine's fabric levels.

Flags only; the work is in microbench.bench.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags

from microbench.meshes import tpu_slice
from microbench.meshes.scopes import SCOPES
from microbench.bench import collectives, command_buffer, overlap, reduce_ops, run as bench_run, sizes, sweep
from microbench.bench.program import DTYPES
from microbench.cli import absl_app, cluster_flags
from microbench.cluster import machine
from microbench.fabric import description as fabric_description
from microbench.fabric import link_peaks
from microbench.fabric import tpu_kinds
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

SWEEP_FLAGS = ("collectives", "op", "inplace", "root", "profile_points", "scopes", "min_bytes", "max_bytes", "step_factor", "dtype", "iters", "sample_ms",
               "warmup", "samples", "check", "keep_going", "nccl_debug", "topology", "nodes_per_rack", "link_peaks", "fabric", "hang_timeout", "target", "overlap",
               "command_buffer")


def _choose(values: list[str], allowed: tuple[str, ...], what: str, by_name: tuple[str, ...] = ()) -> tuple[str, ...]:
  """`allowed` for 'all'; else the values, each in `allowed` or `by_name` (chosen only by name)."""
  if values == ["all"]:
    return allowed
  allowed_by_name = allowed + by_name
  bad = [v for v in values if v not in allowed_by_name]
  if bad or not values:
    raise app.UsageError(f"unknown {what} {', '.join(bad) or '(none)'}: choose from {', '.join(allowed_by_name)}"
                         " or all")
  return tuple(dict.fromkeys(values))


def _with_ops(names: tuple[str, ...], ops: tuple[str, ...], dtypes: tuple[str, ...], explicit: bool,
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
          raise app.UsageError(reasons[0])
        out.append(coll.name)
  return tuple(out)


def _rank_value(text: str | None, flag: str, scale: float) -> tuple[int, float] | None:
  if not text:
    return None
  try:
    rank, value = text.split(":")
    return int(rank), float(value) * scale
  except ValueError:
    raise app.UsageError(f"--{flag}={text!r}: expected RANK:NUMBER, e.g. 1:50") from None


# What only a run does (processes, fault injection, traces of timed calls): refused with --target.
RUN_ONLY_FLAGS = (*cluster_flags.JOB_FLAGS, "inject_delay", "inject_crash", "inject_hang", "profile_points", "warmup",
                  "samples", "sample_ms", "hang_timeout", "nccl_debug")  # timing and fault flags: a compile-only run times nothing


def config_from_flags() -> sweep.SweepConfig:
  cluster_flags.refuse_with_target(RUN_ONLY_FLAGS)
  try:
    lo = sizes.parse_size(FLAGS.min_bytes)
    hi = None if FLAGS.max_bytes == "auto" else sizes.parse_size(FLAGS.max_bytes)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if lo < 1 or hi is not None and hi < 1:
    raise app.UsageError("--min_bytes and --max_bytes must be positive")
  if hi is not None and lo > hi:
    raise app.UsageError(f"--min_bytes={FLAGS.min_bytes} is larger than --max_bytes={FLAGS.max_bytes}")
  if FLAGS.step_factor <= 1 and (hi is None or lo < hi):
    raise app.UsageError(f"--step_factor={FLAGS.step_factor} must be > 1")
  if FLAGS.step_factor < run_folder.MIN_STEP_FACTOR and (hi is None or lo < hi):
    raise app.UsageError(f"--step_factor={FLAGS.step_factor} puts neighbouring sizes on one TensorBoard step"
                         f" (step = round(10 x log2(bytes))): use >= {run_folder.MIN_STEP_FACTOR:.4f}")
  for name in ("iters", "samples"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name}={getattr(FLAGS, name)} must be >= 1")
  if 1 < FLAGS.iters < 6:
    raise app.UsageError(f"--iters={FLAGS.iters}: use 1 (latency mode: one operation per sample) or >= 6 (the"
                         " long timed program; the short one runs 2)")
  if FLAGS.hang_timeout <= 0:
    raise app.UsageError(f"--hang_timeout={FLAGS.hang_timeout} must be > 0")
  if FLAGS.sample_ms < 0:
    raise app.UsageError(f"--sample_ms={FLAGS.sample_ms} must be >= 0")
  if FLAGS.warmup < 0:
    raise app.UsageError(f"--warmup={FLAGS.warmup} must be >= 0")
  crash = _rank_value(FLAGS.inject_crash, "inject_crash", 1)
  try:
    link_peaks.parse(FLAGS.link_peaks)
    if FLAGS.fabric and FLAGS.fabric.strip().lower() != "none":
      fabric_description.parse(FLAGS.fabric)
  except (link_peaks.LinkPeakError, fabric_description.FabricError) as e:
    raise app.UsageError(str(e)) from None
  hang = _rank_value(FLAGS.inject_hang, "inject_hang", 1)
  dtypes = _choose(FLAGS.dtype, tuple(DTYPES), "dtype")
  try:
    profile = tuple(int(v) for v in FLAGS.profile_points)
  except ValueError:
    raise app.UsageError(f"--profile_points={','.join(FLAGS.profile_points)}: give point numbers, e.g. 1,5") from None
  if any(v < 1 for v in profile):
    raise app.UsageError(f"--profile_points={','.join(FLAGS.profile_points)}: points are numbered from 1")
  if profile and FLAGS.iters == 1:
    raise app.UsageError("--profile_points traces the timed programs: not in latency mode (--iters=1)")
  if FLAGS.root < 0:
    raise app.UsageError(f"--root={FLAGS.root}: the broadcast's source is a group rank, >= 0")
  try:
    overlap_spec = overlap.parse_spec(FLAGS.overlap)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if overlap_spec and FLAGS.command_buffer != "no":
    raise app.UsageError(f"--command_buffer={FLAGS.command_buffer} with --overlap: the overlap arms are compiled"
                         " without command buffers; measure them apart")
  if overlap_spec and FLAGS.iters == 1:
    raise app.UsageError("--overlap times its three arms by difference: not in latency mode (--iters=1)")
  tpu = machine.is_tpu_target(FLAGS.target)
  if tpu and (overlap_spec or FLAGS.command_buffer != "no"):
    raise app.UsageError(f"--{'overlap' if overlap_spec else 'command_buffer'} reads XLA:GPU's schedule and thunks;"
                         f" a TPU --target={FLAGS.target} compiles with XLA:TPU: drop it")
  for name in FLAGS.collectives:
    if refused := command_buffer.refuses_collective(FLAGS.command_buffer, name):
      raise app.UsageError(refused)
  return sweep.SweepConfig(
      collectives=_with_ops(_choose(FLAGS.collectives, collectives.NAMES, "collective", collectives.RAGGED),
                            _choose(FLAGS.op, reduce_ops.OPS, "reduction operator"), dtypes,
                            explicit=FLAGS.collectives != ["all"], inplace=FLAGS.inplace, root=FLAGS.root),
      scopes=_choose(FLAGS.scopes, tpu_slice.SCOPES, "TPU scope") if tpu else _choose(FLAGS.scopes, SCOPES, "scope"),
      dtypes=dtypes,
      min_bytes=lo, max_bytes=hi, step_factor=FLAGS.step_factor,
      iters=FLAGS.iters, warmup=FLAGS.warmup, samples=FLAGS.samples, check=FLAGS.check,
      sample_s=FLAGS.sample_ms * 1e-3, hang_timeout=FLAGS.hang_timeout,
      inject_delay=_rank_value(FLAGS.inject_delay, "inject_delay", 1e-3),
      inject_crash=(crash[0], int(crash[1])) if crash else None, link_peaks=FLAGS.link_peaks, fabric=FLAGS.fabric,
      inject_hang=(hang[0], int(hang[1])) if hang else None, target=FLAGS.target, profile_points=profile,
      keep_going=FLAGS.keep_going, nccl_debug=FLAGS.nccl_debug, overlap=overlap_spec,
      command_buffer=FLAGS.command_buffer)


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" chatter on every start
  if FLAGS.resume:
    _load_resumed_flags(FLAGS.resume)
  cfg = config_from_flags()
  try:
    topology = machine.parse_target_topology(FLAGS.target, FLAGS.topology)
  except (machine.TopologyError, tpu_kinds.KindError) as e:
    raise app.UsageError(str(e)) from None
  outdir = FLAGS.resume or FLAGS.outdir or os.path.join("runs", run_folder.default_name())
  if not FLAGS.resume and run_folder.read_meta(outdir) is not None:
    raise app.UsageError(f"--outdir={outdir} already holds a run: choose a new folder, or continue that run"
                         f" with --resume={outdir}")
  flag_values = {name: FLAGS[name].value for name in SWEEP_FLAGS + ("outdir", "resume", "distributed")}
  code = bench_run.execute(cfg, topology, outdir, resumed=bool(FLAGS.resume), nodes_per_rack=FLAGS.nodes_per_rack,
                           flag_values=flag_values, cluster=cluster_flags.settings(),
                           compilation_cache=FLAGS.compilation_cache)
  if code == bench_run.JOB_FAILED:
    # A peer is gone: skip jax.distributed's shutdown barrier, which would only wait for it and abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


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
  absl_app.run(main, "microbench", [__name__, cluster_flags.__name__])
