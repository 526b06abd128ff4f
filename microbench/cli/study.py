"""`microbench-study`: the multi-tenancy interference study (flags only; the work is in microbench.study).

  microbench-study plan   --machine=leonardo --patterns=A,E --out=plan/          # job mixes, one JSON each
  microbench-study run    --plan=plan/ --backend=testbed|local|slurm --out=res/   # baselines + concurrent runs
  microbench-study report --results=res/                                          # sigma, CIs, PNGs, Markdown
  microbench-study proxy  --strategy=fsdp --gpus=16 ...   # one proxy job (what `run` launches; one process per GPU)
  microbench-study schedule --strategy=fsdp --gpus=16 [--proxy_from=llama3-8b,fsdp]  # bytes per iteration
  microbench-study gpcnet --machine=testbed --canary=all_reduce:1M@0,2 --congestors=alltoall@1,3 --out=g/
                                    # GPCNeT: the canary alone, then beside congestors; impact factor + prediction
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

from absl import app, flags

from microbench.cli import absl_app, cluster_flags
from microbench.study import workloads  # JAX-free: the GPU names for --gpu's help

FLAGS = flags.FLAGS
NAME = "microbench-study"
MODES = ("plan", "predict", "place", "run", "report", "proxy", "schedule", "gpcnet")

# --- proxy / schedule
flags.DEFINE_string("strategy", "dp", "proxy/schedule: dp, fsdp, dp+pp, dp+pp+tp or dp+pp+ep.")
flags.DEFINE_string("model", None, "proxy/schedule: the proxy's model shape (default: the study's for the "
                    "strategy: vit-h, llama3-8b, minerva-7b, llama3-70b, mixtral-8x7b).")
flags.DEFINE_string("gpu", "A100", "GPU whose roofline times the emulated compute: "
                    f"{', '.join(workloads.GPUS)} (the GPU kinds' peaks; MI250X and GB300 as the seed study).")
flags.DEFINE_integer("gpus", None, "proxy/schedule: ranks in the job (proxy default: the process count). plan: "
                     "the design's GPUs (the artifact's -G; default: the machine's; spare nodes are room for the "
                     "placer).", lower_bound=1)
flags.DEFINE_string("proxy_from", None, "proxy/schedule: MODEL,STRATEGY (e.g. llama3-8b,fsdp or gpt2-tiny,dp): "
                    "take the collective schedule from the compiled HLO of microbench-train's step instead.")
flags.DEFINE_integer("batch", None, "proxy_from: global batch of the training step (default 16 per data rank).",
                     lower_bound=1)
flags.DEFINE_integer("seq_len", None, "proxy_from: tokens per example (default: the model's context).",
                     lower_bound=1)
flags.DEFINE_integer("layers", None, "proxy_from: override the model's depth.", lower_bound=1)
flags.DEFINE_integer("iters", None, "proxy: timed iterations (default: the study's runs per strategy).",
                     lower_bound=1)
flags.DEFINE_integer("warmup", None, "proxy: untimed first iterations (default: the study's, 1).", lower_bound=0)
flags.DEFINE_enum("compute", "sleep", ["sleep", "busy"], "Emulated compute: the host waits (sleep: no CPU used, "
                  "collectives overlap) or a calibrated device kernel runs (busy).")
flags.DEFINE_float("compute_scale", 1.0, "Multiply every emulated compute time (rehearsals: < 1).", lower_bound=0)
flags.DEFINE_float("bytes_scale", 1.0, "Multiply every message size (rehearsals on slow networks: < 1).",
                   lower_bound=0)
flags.DEFINE_enum("proxy_dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Element type of the proxy's"
                  " buffers.")
flags.DEFINE_string("out", None, "proxy: JSONL records (process 0). plan: plan folder. run: results folder.")
flags.DEFINE_string("label", "", "proxy: a label copied into the header record.")
flags.DEFINE_string("congestor", None, "proxy: run a congestor instead of a strategy: alltoall, incast, broadcast or"
                    " permutation (one round per iteration, --message_bytes per rank; --seed for permutation).")
flags.DEFINE_string("point", None, "proxy: run one collective point instead of a strategy: all_reduce, all_gather,"
                    " reduce_scatter or all_to_all of --message_bytes.")
flags.DEFINE_string("message_bytes", None, "proxy --congestor/--point: message size per rank (bytes, or 4M, 512K).")

# --- gpcnet
flags.DEFINE_string("canary", None, "gpcnet: STRATEGY[:MODEL]@NODES (dp@0,2) or OP:SIZE@NODES (all_reduce:1M@0,2).")
flags.DEFINE_multi_string("congestors", None, "gpcnet: KIND[:SIZE]@NODES (alltoall@1,3), repeatable, or "
                          "KIND[:SIZE],KIND... spread over the nodes left free; kinds: alltoall, incast, broadcast, "
                          "permutation.")
flags.DEFINE_float("congestor_seconds", 1.0, "gpcnet: size unsized congestors so one round alone lasts this long "
                   "on the described links.", lower_bound=1e-3)
flags.DEFINE_bool("measure", True, "gpcnet: run the canary and congestors (--nomeasure: the prediction only).")
flags.DEFINE_integer("resamples", 2000, "gpcnet: bootstrap resamples of the impact factors' intervals.",
                     lower_bound=100)

# --- plan
flags.DEFINE_string("machine", "testbed", "plan: leonardo, lumi, alps, jupiter, dgx, testbed or custom, with "
                    "options: leonardo:nodes=64; testbed:racks=4,hosts_per_rack=2,gpus_per_node=1,groups=1,"
                    "host_rate=400mbit,uplink_rate=100mbit; custom:gpus_per_node=4,nodes_per_l1=10,l1_per_group=18,"
                    "nodes=64,gpu=H100.")
flags.DEFINE_string("node_map", None, "plan: file of `hostname group l1` lines describing the allocation's nodes.")
flags.DEFINE_string("slurm_topology", None, "plan inside a SLURM allocation: `auto` reads `scontrol show "
                    "topology`, or a topology.conf path; the allocation's hosts (SLURM_JOB_NODELIST) and their "
                    "switches become the machine's nodes (leaf switch = L1, its parent = group).")
flags.DEFINE_list("patterns", ["A", "E"], "plan: allocation pattern families (A equal split, E stochastic tiers; "
                  "B geometric, C hierarchical, D power law).")
flags.DEFINE_float("rho_min", 0.8, "plan: lowest utilisation (share of the machine's GPUs allocated).")
flags.DEFINE_float("rho_max", 1.0, "plan: highest utilisation.")
flags.DEFINE_integer("rho_steps", 1, "plan: utilisations from rho_min to rho_max (1: rho_max only).", lower_bound=1)
flags.DEFINE_integer("size_divisor", 1, "plan: divide the study's job sizes by this for small machines.",
                     lower_bound=1)
flags.DEFINE_list("strategies", None, "plan: strategies to mix (default: all five).")
flags.DEFINE_integer("g_min", None, "plan: smallest job in GPUs (default: the study's max(8, 2 q1), scaled).",
                     lower_bound=1)
flags.DEFINE_integer("k_max", None, "plan: most jobs in a mix (default: GPUs / g_min).", lower_bound=2)
flags.DEFINE_integer("stochastic_patterns", 3, "plan: pattern-E mixes per utilisation.", lower_bound=0)
flags.DEFINE_integer("samples_per_bin", 4, "plan: strategy labellings per entropy bin and pattern.", lower_bound=1)
flags.DEFINE_integer("placement_samples_per_bin", 1, "plan: placement vectors per locality bin and labelling.",
                     lower_bound=1)
flags.DEFINE_integer("enum_threshold", 5000, "plan: enumerate labellings up to this many, else rejection-sample.",
                     lower_bound=1)
flags.DEFINE_float("placement_med_hi", 2.33, "plan: locality score between the medium and high bins (the "
                   "study's runs used 2.55 and 2.35).")
flags.DEFINE_integer("max_experiments", None, "plan: keep at most this many experiments (the 3x3 placement x "
                     "entropy grid is interleaved first, so a prefix covers it).", lower_bound=1)
flags.DEFINE_integer("seed", 42, "plan: seed of every random choice (same seed, same plan).")
flags.DEFINE_list("derive", None, "plan: STRATEGY=MODEL pairs (e.g. fsdp=llama3-8b,dp=vit-h14): that strategy's "
                  "jobs run proxies derived from microbench-train's step of MODEL (see --proxy_from).")
flags.DEFINE_multi_string("jobs", None, "plan: a hand-written mix instead of a generated one, one flag per job: "
                          "STRATEGY[:MODEL]@NODES, e.g. dp@0,2 (GPUs = nodes x GPUs per node).")

# --- run
flags.DEFINE_string("plan", None, "run: the plan folder written by `plan`.")
flags.DEFINE_list("fit_from", [], "predict: sweep run folders whose alpha-beta fits replace the machine's link rates"
                  " and hop latencies, level by level (microbench-report --fit_from does the same).")
flags.DEFINE_float("call_us", 0.0, "predict, gpcnet: a fixed cost per collective call on top of the fabric's"
                   " latencies (software: ~10 us for NCCL, ms for gloo on the emulated cluster).", lower_bound=0)
flags.DEFINE_enum("backend", "local", ["local", "testbed", "slurm"], "run: where jobs run: local processes, the "
                  "emulated cluster (root; built for the plan's testbed machine unless --testbed_id), or srun steps "
                  "inside the current SLURM allocation.")
flags.DEFINE_bool("resume", False, "run: continue the study in --out (same settings), skipping finished units.")
flags.DEFINE_integer("baseline_repeats", 1, "run: baseline runs per matching key.", lower_bound=1)
flags.DEFINE_integer("small_job_threshold", None, "run: jobs with fewer GPUs are small (respawned until every large "
                     "job has finished once); unset, as the artifact: every job is small, so a mix runs for the "
                     "whole --walltime; 1: every job is large (a mix ends once each job has run). The study used 512"
                     " on Leonardo.", lower_bound=0)
flags.DEFINE_float("walltime", 600, "run: seconds a unit may take before the kill sequence (run's default: 200, "
                   "the artifact's).", lower_bound=1)
flags.DEFINE_float("grace", 30, "run: seconds between SIGUSR1 and SIGKILL in the kill sequence.", lower_bound=0)
flags.DEFINE_integer("max_failures", 3, "run: failed runs in a row after which a job fails its unit.",
                     lower_bound=1)
flags.DEFINE_list("experiments", None, "run: only these experiment ids (default: all).")
flags.DEFINE_bool("baselines", True, "run: run the baselines (--nobaselines: concurrent runs only).")
flags.DEFINE_string("testbed_id", None, "run --backend=testbed: use this running testbed instead of building one.")
flags.DEFINE_string("srun_args", "", "run --backend=slurm: extra srun arguments (Alps: --mpi=cray_shasta "
                    "--accel-bind=g).")
flags.DEFINE_string("slurm_gpu_flag", "--gres=gpu:{n}", "run --backend=slurm: how a step asks for its GPUs per "
                    "node ({n}); empty: ask for none.")

# --- report
flags.DEFINE_string("results", None, "report: the results folder written by `run`.")
flags.DEFINE_string("report_dir", None, "report: where to write (default RESULTS/report).")
flags.DEFINE_integer("drop_first", 1, "report: timed iterations dropped at the start of every run (the study's "
                     "parser drops 1).", lower_bound=0)
flags.DEFINE_bool("plots", True, "report: write the PNGs (needs matplotlib, the `report` extra).")


def say(msg: str) -> None:
  print(f"{NAME}: {msg}", file=sys.stderr, flush=True)


def _schedule(gpus: int, devices=None):
  """The job's schedule (hand-written, derived from --proxy_from, a congestor or a point) and its unscaled
  version."""
  from microbench.study import congestors, predict, rank_programs, workloads  # pylint: disable=g-import-not-at-top
  if FLAGS.congestor or FLAGS.point:
    if FLAGS.congestor and FLAGS.point or FLAGS.proxy_from:
      raise app.UsageError("--congestor, --point and --proxy_from each choose the proxy's schedule: give one")
    if not FLAGS.message_bytes:
      raise app.UsageError("--congestor and --point need --message_bytes (e.g. 4M)")
    eb = predict.ELEMENT_BYTES[FLAGS.proxy_dtype]
    try:
      size = congestors.parse_size(FLAGS.message_bytes)
      job = (congestors.build(FLAGS.congestor, gpus, size, eb, FLAGS.seed) if FLAGS.congestor
             else congestors.point(FLAGS.point, gpus, size, eb))
    except congestors.CongestorError as e:
      raise app.UsageError(str(e)) from None
    return job, None
  try:
    if FLAGS.proxy_from:
      from microbench.study import step_collectives  # pylint: disable=g-import-not-at-top
      full = step_collectives.derive(FLAGS.proxy_from, gpus, gpu=_roofline_gpu(), batch=FLAGS.batch,
                                    seq_len=FLAGS.seq_len, layers=FLAGS.layers, devices=devices)
    else:
      full = rank_programs.build(FLAGS.strategy, gpus, FLAGS.gpu, FLAGS.model)
  except (workloads.WorkloadError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  return full.scaled(FLAGS.bytes_scale, FLAGS.compute_scale), full


def _roofline_gpu() -> str:
  """The GPU whose roofline times the compute: --gpu, or with --target (and no --gpu) the target's kind."""
  if FLAGS.target and not FLAGS["gpu"].present:
    return FLAGS.target.strip().upper()
  return FLAGS.gpu


def _proxy() -> int:
  from microbench.cluster import distributed  # pylint: disable=g-import-not-at-top
  from microbench.study import workloads  # pylint: disable=g-import-not-at-top
  try:
    st = workloads.strategy(FLAGS.strategy)
  except workloads.WorkloadError as e:
    raise app.UsageError(str(e)) from None
  out = open(FLAGS.out, "a", encoding="utf-8") if FLAGS.out else None  # pylint: disable=consider-using-with

  def stop(signum, frame):  # the study's kill sequence: SIGUSR1 ends a job at once, records already flushed
    del signum, frame
    if out:
      out.flush()
    os._exit(0)  # pylint: disable=protected-access
  signal.signal(signal.SIGUSR1, stop)
  distributed.initialize(cluster_flags.settings())
  import jax  # pylint: disable=g-import-not-at-top
  from microbench.study import proxy  # pylint: disable=g-import-not-at-top
  job, full = _schedule(FLAGS.gpus or jax.process_count())
  try:
    iters = FLAGS.iters or (10 ** 9 if FLAGS.congestor else st.runs)  # a congestor loops until stopped
    proxy.run(job, iters=iters, warmup=st.warmup if FLAGS.warmup is None else FLAGS.warmup,
              out=out, compute=FLAGS.compute, dtype=FLAGS.proxy_dtype, label=FLAGS.label, full=full,
              say=lambda m: say(m))
  except proxy.ProxyError as e:
    raise app.UsageError(str(e)) from None
  finally:
    if out:
      out.close()
  return 0


def _target_devices(kind: str, gpus: int) -> list:
  """`gpus` compile-only devices of GPU kind `kind`, in hosts of the kind's usual node size; for a TPU kind,
  `gpus` chips as the most cube-like slice its hosts tile (64 v5p chips: 4x4x4), in the pod's mesh order."""
  from microbench.fabric import gpu_kinds  # pylint: disable=g-import-not-at-top
  from microbench.aot import gpu_compile  # pylint: disable=g-import-not-at-top
  from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
  if machine.is_tpu_target(kind):
    from microbench.meshes import tpu_slice  # pylint: disable=g-import-not-at-top
    from microbench.fabric import tpu_kinds  # pylint: disable=g-import-not-at-top
    from microbench.aot import tpu_compile  # pylint: disable=g-import-not-at-top
    try:
      target = tpu_compile.make_target(kind, tpu_compile.slice_for(tpu_kinds.target(kind), gpus))
      return tpu_slice.slices_from_devices(target.devices)[1]
    except (tpu_compile.TargetError, tpu_kinds.KindError, tpu_slice.SliceError) as e:
      raise app.UsageError(str(e)) from None
  try:
    per_host = min(gpus, gpu_kinds.target(kind).gpus_per_node)
    if gpus % per_host:
      raise app.UsageError(f"--gpus={gpus} is not a whole number of {kind} nodes of {per_host} GPUs")
    return list(gpu_compile.make_target(kind, gpus // per_host, per_host).devices)
  except (gpu_compile.TargetError, gpu_compile.KindError) as e:
    raise app.UsageError(str(e)) from None


def _schedule_report() -> int:
  """Bytes per iteration of a proxy (and, with --proxy_from, of the hand-written one for the same strategy,
  with the difference), without running anything; --proxy_from compiles the step on virtual CPU devices, or
  with --target for that GPU kind's compile-only devices (XLA:GPU's HLO: what the GPUs would move)."""
  from microbench.study import rank_programs, workloads  # pylint: disable=g-import-not-at-top
  gpus = FLAGS.gpus or 8
  devices = None
  if FLAGS.target:
    if not FLAGS.proxy_from:
      raise app.UsageError("--target compiles the training step of --proxy_from=MODEL,STRATEGY for the GPU kind;"
                           " a hand-written proxy has nothing to compile")
    if FLAGS["gpu"].present and FLAGS.gpu.strip().lower() != FLAGS.target.strip().lower():
      raise app.UsageError(f"--gpu={FLAGS.gpu} contradicts --target={FLAGS.target}: the roofline times the"
                           " target's own GPU; drop --gpu (or give the same kind)")
    devices = _target_devices(FLAGS.target, gpus)
  elif FLAGS.proxy_from:
    from microbench.meshes.topology import Topology  # pylint: disable=g-import-not-at-top
    from microbench.cluster import machine  # pylint: disable=g-import-not-at-top
    machine.prepare_cpu_devices(Topology(1, 1, gpus), False)
    import jax  # pylint: disable=g-import-not-at-top
    if len(jax.devices()) < gpus:
      raise app.UsageError(f"--gpus={gpus} but only {len(jax.devices())} devices here (JAX_NUM_CPU_DEVICES)")
    devices = jax.devices()[:gpus]
  job, full = _schedule(gpus, devices)
  full = full or job  # a congestor or point has no full-scale version: it is what runs

  def describe(job) -> dict:
    rows = []
    for r in sorted({0, gpus - 1}):
      per = rank_programs.bytes_per_iteration(job, r)
      rows.append({"rank": r, "bytes_per_iteration": per, "total_bytes": sum(per.values()),
                   "compute_s": rank_programs.compute_seconds(job, r)})
    return {"schedule": job.name, "gpus": gpus, "meta": job.meta, "ranks": rows}
  out = {"proxy": describe(full)}
  if FLAGS.proxy_from:
    from microbench.study import step_collectives  # pylint: disable=g-import-not-at-top
    strategy = step_collectives.parse_proxy_from(FLAGS.proxy_from)[2]
    try:
      hand = rank_programs.build(strategy, gpus, FLAGS.gpu, FLAGS.model)
    except workloads.WorkloadError as e:
      raise app.UsageError(str(e)) from None
    out["hand_written"] = describe(hand)
    out["comparison"] = step_collectives.compare(hand, full)
    out["comparison"]["derived"].pop("meta")
  print(json.dumps(out, indent=1, default=str))
  return 0


def _plan() -> int:
  from microbench.study import generator, machines, workloads  # pylint: disable=g-import-not-at-top
  if not FLAGS.out:
    raise app.UsageError("--out=FOLDER is required (the plan's folder)")
  try:
    machine = machines.parse(FLAGS.machine, FLAGS.node_map, _allocation_layout() if FLAGS.slurm_topology else None)
    settings = generator.Settings(
        machine, patterns=tuple(p.strip().upper() for p in FLAGS.patterns), rho_min=FLAGS.rho_min,
        rho_max=FLAGS.rho_max, rho_steps=FLAGS.rho_steps, size_divisor=FLAGS.size_divisor,
        strategies=tuple(FLAGS.strategies or workloads.STRATEGIES), g_min=FLAGS.g_min, k_max=FLAGS.k_max,
        n_stochastic=FLAGS.stochastic_patterns, n_per_bin=FLAGS.samples_per_bin,
        n_placement_per_bin=FLAGS.placement_samples_per_bin, enum_threshold=FLAGS.enum_threshold,
        placement_cuts=(1.67, FLAGS.placement_med_hi), max_experiments=FLAGS.max_experiments, seed=FLAGS.seed,
        gpus=FLAGS.gpus)
    if FLAGS.jobs:
      experiments, dropped = [generator.manual(machine, [_job_spec(j) for j in FLAGS.jobs])], {}
    else:
      experiments, dropped = generator.generate(settings)
  except (machines.MachineError, generator.PlanError, workloads.WorkloadError) as e:
    raise app.UsageError(str(e)) from None
  if not experiments:
    say(f"no experiment fits this machine and these settings (dropped: {dropped}); nothing written")
    return 1
  if FLAGS.derive:
    _use_derived(experiments)
  path = generator.write(FLAGS.out, settings, experiments, dropped, " ".join(sys.argv))
  say(f"{len(experiments)} experiment(s) for {machine.name} ({machine.total_gpus} GPUs) -> {path}")
  for e in experiments:
    jobs = " ".join(f"{j['strategy']}x{j['gpus']}@{j['placement_class']}" for j in e["jobs"])
    print(f"{e['id']}  {e['pattern']['id']:7s} H={e['entropy_bin']:6s} P={e['placement_bin']:6s}  {jobs}")
  tiers = {t: n for t, n in json.load(open(path, encoding="utf-8"))["placement"]["tiers"].items() if n}
  if tiers:
    say(f"placer tiers (experiments): {tiers}; every job records requested_class, placement_class (what its"
        " nodes form) and fallback")
  return 0


def _allocation_layout() -> tuple:
  """The current SLURM allocation's hosts, in order, with their switches (--slurm_topology)."""
  from microbench.study import machines  # pylint: disable=g-import-not-at-top
  nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
  if not nodelist:
    raise machines.MachineError("--slurm_topology plans inside an allocation, but SLURM_JOB_NODELIST is not set")
  try:
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           check=True).stdout.split()
    if FLAGS.slurm_topology == "auto":
      text = subprocess.run(["scontrol", "show", "topology"], capture_output=True, text=True, check=True).stdout
    else:
      with open(FLAGS.slurm_topology, encoding="utf-8") as f:
        text = f.read()
  except (OSError, subprocess.CalledProcessError) as e:
    raise machines.MachineError(f"cannot read the allocation's topology: {e}") from None
  return machines.allocation_layout(hosts, machines.read_slurm_topology(text))


def _place() -> int:
  """Candidate placements of --jobs=STRATEGY:GPUS ... ranked by predicted worst, then mean sigma; with --out,
  the first- and last-ranked written as plans (OUT/first, OUT/last) for `run` to measure."""
  from microbench.study import generator, machines, ranking, workloads  # pylint: disable=g-import-not-at-top
  if not FLAGS.jobs:
    raise app.UsageError("--jobs=STRATEGY:GPUS is required, once per job, e.g. --jobs=dp:2 --jobs=fsdp:4")
  jobs = []
  for text in FLAGS.jobs:
    strategy, _, gpus = text.partition(":")
    if not gpus.isdigit() or int(gpus) < 1 or "@" in text:
      raise app.UsageError(f"--jobs={text!r}: place wants STRATEGY:GPUS (e.g. dp:2); the nodes are its answer")
    jobs.append((strategy, int(gpus)))
  try:
    machine = machines.parse(FLAGS.machine, FLAGS.node_map)
    for strategy, _ in jobs:
      workloads.strategy(strategy)
    ranked = ranking.rank(machine, jobs, FLAGS.bytes_scale, FLAGS.compute_scale)
  except (machines.MachineError, workloads.WorkloadError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  print("| rank | worst sigma | mean sigma | jobs (class: nodes) | dominant links |")
  print("|---|---|---|---|---|")
  for i, e in enumerate(ranked, 1):
    desc = "; ".join(f"{j['strategy']}x{j['gpus']} {j['placement_class']}: {','.join(map(str, j['nodes']))}"
                     for j in e["jobs"])
    print(f"| {i} | {e['worst_sigma']:.3f} | {e['mean_sigma']:.3f} | {desc} |"
          f" {', '.join(x or '-' for x in e['links'])} |")
  if FLAGS.out:
    settings = generator.Settings(machine)
    for name, e in (("first", ranked[0]), ("last", ranked[-1])):
      generator.write(os.path.join(FLAGS.out, name), settings, [dict(_as_experiment(machine, e), id="e000")], {},
                      " ".join(sys.argv))
    say(f"first- and last-ranked placements written as plans to {FLAGS.out}/first and {FLAGS.out}/last")
  return 0


def _as_experiment(machine, e: dict) -> dict:
  """A ranked candidate in the plan's experiment format (a hand-written mix on its nodes)."""
  from microbench.study import generator  # pylint: disable=g-import-not-at-top
  exp = generator.manual(machine, [(j["strategy"], j["model"], j["nodes"]) for j in e["jobs"]])
  exp["pattern"] = dict(exp["pattern"], id="placed")
  return exp


def _use_derived(experiments: list[dict]) -> None:
  """--derive: jobs of the named strategies get `proxy_from` (their model becomes the training model's)."""
  from microbench.study import step_collectives  # pylint: disable=g-import-not-at-top
  from microbench.models import ModelError, get_model  # pylint: disable=g-import-not-at-top
  mapping = {}
  for item in FLAGS.derive:
    strategy, eq, model = item.partition("=")
    try:
      family, size, strategy = step_collectives.parse_proxy_from(f"{model},{strategy}")
      get_model(family, size)
    except (ValueError, ModelError) as e:
      raise app.UsageError(f"--derive={item}: {e}" if eq else f"--derive={item}: want STRATEGY=MODEL") from None
    mapping[strategy] = model
  for e in experiments:
    for job in e["jobs"]:
      if job["strategy"] in mapping:
        try:
          step_collectives.training_parallelism(job["strategy"], job["gpus"])
        except ValueError as err:
          raise app.UsageError(str(err)) from None
        job["model"] = mapping[job["strategy"]]
        job["proxy_from"] = f"{mapping[job['strategy']]},{job['strategy']}"


def _job_spec(text: str) -> tuple[str, str | None, list[int]]:
  head, at, nodes = text.partition("@")
  strategy, _, model = head.partition(":")
  node_list: list[int] = []
  try:
    for part in filter(None, (p.strip() for p in nodes.split(","))):
      lo, dash, hi = part.partition("-")
      node_list += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
  except ValueError:
    node_list = []
  if not at or not node_list:
    raise app.UsageError(f"--jobs={text!r}: want STRATEGY[:MODEL]@NODES, e.g. dp@0,2 or fsdp:llama3-8b@0-3")
  return strategy, model or None, node_list


def _on_backend(machine, work, interrupted: str, errors: tuple = ()) -> tuple[int, object]:
  """(exit code, work(backend)) on the --backend for `machine`, opened and then closed whatever happens; a
  backend's failure is one line and exit 1, an interrupt exit 128 + signal (`interrupted` says what resumes)."""
  from microbench.cluster import launch  # pylint: disable=g-import-not-at-top
  from microbench.cluster import testbed as tbm  # pylint: disable=g-import-not-at-top
  from microbench.study import backends  # pylint: disable=g-import-not-at-top
  try:
    backend = backends.make(FLAGS.backend, machine, testbed_id=FLAGS.testbed_id, srun_args=FLAGS.srun_args,
                            gpu_flag=FLAGS.slurm_gpu_flag, say=say)
  except backends.BackendError as e:
    raise app.UsageError(str(e)) from None
  launch.install_signal_handlers()
  try:
    backend.open()
    return 0, work(backend)
  except (backends.BackendError, tbm.TestbedError, *errors) as e:
    say(f"error: {e}")
    return 1, None
  except launch.Interrupted as e:
    say(f"interrupted ({e}){interrupted}")
    return 128 + e.signum, None
  finally:
    backend.close()


def _run() -> int:
  from microbench.study import run_plan  # pylint: disable=g-import-not-at-top
  if not FLAGS.plan or not FLAGS.out:
    raise app.UsageError("--plan=PLAN_FOLDER and --out=RESULTS_FOLDER are required")
  s = run_plan.RunSettings(
      plan_dir=FLAGS.plan, out_dir=FLAGS.out, backend=FLAGS.backend, compute=FLAGS.compute,
      compute_scale=FLAGS.compute_scale, bytes_scale=FLAGS.bytes_scale, iters=FLAGS.iters, warmup=FLAGS.warmup,
      baseline_repeats=FLAGS.baseline_repeats,
      small_job_threshold=run_plan.ALL_SMALL if FLAGS.small_job_threshold is None else FLAGS.small_job_threshold,
      walltime=FLAGS.walltime if FLAGS["walltime"].present else 200.0, grace=FLAGS.grace,
      max_failures=FLAGS.max_failures, dtype=FLAGS.proxy_dtype,
      experiments=tuple(FLAGS.experiments or ()), baselines=FLAGS.baselines)
  try:
    _, experiments, machine = run_plan.prepare(s, FLAGS.resume)
    unknown = set(s.experiments) - {e["id"] for e in experiments}
    if unknown:
      raise app.UsageError(f"--experiments: {', '.join(sorted(unknown))} not in the plan")
  except run_plan.RunError as e:
    raise app.UsageError(str(e)) from None
  rc, records = _on_backend(machine, lambda backend: run_plan.run(s, backend, machine, experiments, say=say),
                            f"; `run --resume --out={FLAGS.out} --plan={FLAGS.plan}` continues")
  if rc:
    return rc
  failed = [r["unit"] for r in records if r["status"] != "done"]
  if failed:
    say(f"{len(failed)} unit(s) failed: {', '.join(failed)}; `run --resume` runs them again")
  say(f"results in {FLAGS.out}; `{NAME} report --results={FLAGS.out}` summarises them")
  return 1 if failed else 0


def _predict() -> int:
  from microbench.study import machines, predict, run_plan  # pylint: disable=g-import-not-at-top
  if not FLAGS.plan or not FLAGS.out:
    raise app.UsageError("--plan=PLAN_FOLDER and --out=RESULTS_FOLDER are required (the folder `run` fills)")
  try:
    pred = predict.predict(FLAGS.plan, FLAGS.bytes_scale, FLAGS.compute_scale, FLAGS.proxy_dtype,
                           call_us=FLAGS.call_us, fit_from=FLAGS.fit_from, say=say)
  except (run_plan.RunError, machines.MachineError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  path = predict.write(FLAGS.out, pred)
  print("\n".join(predict.table(pred)))
  for line in predict.key_notes(pred):
    say(line)
  say(f"predicted sigma for {len(pred['keys'])} key(s) -> {path}; `run --out={FLAGS.out}` measures them")
  return 0


def _gpcnet() -> int:
  """GPCNeT's congestion impact factor: the flow model's prediction first (written before anything runs), then
  the canary alone and beside the congestors on --backend; OUT/report.md and OUT/gpcnet.json."""
  from microbench.study import gpcnet, machines  # pylint: disable=g-import-not-at-top
  if not FLAGS.canary or not FLAGS.congestors or not FLAGS.out:
    raise app.UsageError("--canary=SPEC, --congestors=KIND[@NODES] and --out=FOLDER are required, e.g. "
                         "--canary=all_reduce:1M@0,2 --congestors=alltoall@1,3")
  s = gpcnet.Settings(out_dir=FLAGS.out, iters=FLAGS.iters or 40, warmup=1 if FLAGS.warmup is None else FLAGS.warmup,
                      dtype=FLAGS.proxy_dtype, compute=FLAGS.compute, bytes_scale=FLAGS.bytes_scale,
                      compute_scale=FLAGS.compute_scale, congestor_seconds=FLAGS.congestor_seconds,
                      seed=FLAGS.seed, call_us=FLAGS.call_us, grace=FLAGS.grace, walltime=FLAGS.walltime,
                      resamples=FLAGS.resamples, backend=FLAGS.backend if FLAGS.measure else "")
  try:
    machine = machines.parse(FLAGS.machine, FLAGS.node_map)
    canary = gpcnet.parse_canary(FLAGS.canary, machine)
    congs = gpcnet.size_congestors(machine, gpcnet.parse_congestors(FLAGS.congestors, machine, canary), s)
    predicted = gpcnet.prediction(machine, canary, congs, s)
  except (gpcnet.GpcnetError, machines.MachineError) as e:
    raise app.UsageError(str(e)) from None
  command_line = " ".join(["microbench-study"] + sys.argv[1:])
  say(f"predicted CIF {predicted['cif']:.3f} (canary {predicted['alone_s'] * 1e3:.2f} ms alone, "
      f"{predicted['beside_s'] * 1e3:.2f} ms beside); shared links: {', '.join(predicted['shared_links']) or 'none'}")
  gpcnet.write(FLAGS.out, gpcnet.result(machine, canary, congs, s, predicted, None, command_line))
  if not FLAGS.measure:
    print(gpcnet.markdown(gpcnet.result(machine, canary, congs, s, predicted, None, command_line)))
    return 0
  rc, measured = _on_backend(machine, lambda backend: gpcnet.measure(machine, canary, congs, s, backend, say=say),
                             "", errors=(gpcnet.GpcnetError,))
  if rc:
    return rc
  try:
    res = gpcnet.result(machine, canary, congs, s, predicted, measured, command_line)
  except ValueError as e:
    say(f"error: {e} (see {FLAGS.out}/logs)")
    return 1
  print(gpcnet.write(FLAGS.out, res))
  return 0


def _report() -> int:
  from microbench.study import run_plan, sigma_report  # pylint: disable=g-import-not-at-top
  if not FLAGS.results:
    raise app.UsageError("--results=RESULTS_FOLDER is required")
  if not os.path.exists(os.path.join(FLAGS.results, run_plan.UNITS_FILE)):
    raise app.UsageError(f"{FLAGS.results} holds no finished unit (no units.jsonl): run the study first")
  out = sigma_report.build(FLAGS.results, FLAGS.report_dir, FLAGS.drop_first, FLAGS.plots, say=say)
  print(out["markdown"])
  return 0


def main(argv: list[str]) -> int:
  args = argv[1:]
  mode = args.pop(0) if args and args[0] in MODES else None
  if mode is None or args:
    raise app.UsageError(f"want one mode of {', '.join(MODES)} (got {argv[1:] or 'none'}); see --help")
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  return {"plan": _plan, "run": _run, "report": _report, "proxy": _proxy, "schedule": _schedule_report,
          "predict": _predict, "place": _place, "gpcnet": _gpcnet}[mode]()


def run() -> None:
  """Console-script entry point."""
  absl_app.run(main, NAME, [__name__, cluster_flags.__name__])


if __name__ == "__main__":
  run()
