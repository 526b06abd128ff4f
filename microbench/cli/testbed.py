"""`microbench-testbed`: an emulated cluster on one machine, hosts are network namespaces behind tc-shaped
links (flags and modes only; the work is in microbench.cluster.testbed and .testbed_jobs).

One-shot (build, run one job with process i in host i, remove everything):
  microbench-testbed --hosts=2 --host_rate=200mbit [--host_delay=1ms] -- python -m microbench ...
  microbench-testbed --hosts=4 --racks=2 --host_rate=200mbit --fault=h3:rate=0.25 -- microbench-doctor ...
  microbench-testbed --hosts=4 --racks=2 --host_rate=400mbit --uplink_rate=100mbit -- <command ...>
Long-lived, for several concurrent jobs (multi-tenancy):
  microbench-testbed up --hosts=4 --host_rate=200mbit [--id=tbNAME]      # prints the id and state file
  microbench-testbed run --id=tbNAME --hosts=0,1 --hosts=0-3 -- <command>  # 2 jobs, sharing hosts 0,1
  microbench-testbed down --id=tbNAME                                    # or --state=PATH, or --all

Each job gets its own coordinator (on its first host's address, a free port) and every process gets
`--distributed --coordinator_address=... --num_processes=N --process_id=I` appended (unless
--pass_flags=false), plus MICROBENCH_* env vars, JAX_NUM_CPU_DEVICES and MICROBENCH_HOSTNAME=<ns name>.
Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN); see microbench/cluster/testbed.py for the topology.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile

from absl import app, flags

from microbench.cli import absl_app
from microbench.cluster import launch, testbed_jobs
from microbench.cluster import testbed as tbm
from microbench.fabric import rates

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("hosts", None,
                          "One-shot / up: the number of hosts. run: the hosts of one job, e.g. 0,1 or 0-3; "
                          "repeat the flag for several concurrent jobs (default: one job on all hosts).")
flags.DEFINE_integer("racks", 1, "Racks, each with its own switch; hosts are split evenly, in order.", lower_bound=1)
flags.DEFINE_string("host_rate", "", "Host link rate in tc units (200mbit, 1gbit); empty: unshaped.")
flags.DEFINE_string("host_delay", "", "Host link one-way delay per link (500us, 1ms); needs sch_netem.")
flags.DEFINE_string("uplink_rate", "", "Rack-to-core uplink rate (racks > 1); empty: unshaped.")
flags.DEFINE_string("uplink_delay", "", "Rack-to-core uplink one-way delay; needs sch_netem.")
flags.DEFINE_enum("queue", "fifo", rates.QUEUES, "Each shaped link's queue: fifo (tbf's 50 ms drop-tail queue, "
                  "which TCP fills) or fair (a queue per host pair served in turn, as a switch port arbitrating "
                  "between flows; at most 64 hosts).")
flags.DEFINE_multi_string("fault", [], "A link fault to plant (repeatable): PART:KEY=VALUE[,KEY=VALUE], PART h<i> "
                          "(host i's link) or uplink<r> (rack r's uplink), keys rate (a fraction like 0.25, or a "
                          "tc rate like 50mbit), loss (a percentage like 2%), delay (like 5ms; needs sch_netem); "
                          "both directions. E.g. --fault=h3:rate=0.25 --fault=uplink1:loss=2%.")
flags.DEFINE_integer("devices_per_process", 1, "CPU devices per process (JAX_NUM_CPU_DEVICES).", lower_bound=1)
flags.DEFINE_string("id", None, "Testbed id (tb + up to 12 of [0-9a-z]). up: default random; run/down: which one.")
flags.DEFINE_string("state", None, "State file (default /tmp/microbench-testbed-<id>.json).")
flags.DEFINE_bool("all", False, "down: remove every testbed on this machine (state files and tb*-sw/h* namespaces).")
flags.DEFINE_float("timeout", 0, "Seconds before all jobs are stopped (exit 124). 0: no limit.", lower_bound=0)
flags.DEFINE_float("grace", 2, "Seconds between SIGTERM and SIGKILL when stopping ranks.", lower_bound=0)
flags.DEFINE_bool("pass_flags", True, "Append the --distributed ... flags to the command (else env only).")
flags.DEFINE_string("report", None, "run / one-shot: write each job's hosts, exit status and log dir to this JSON.")
# --log_dir (absl.logging's flag, reused): per-job log dirs job<J>/rank<I>.log; default a new temp dir.

_COMMAND: list[str] = []
MODES = ("up", "run", "down")


NAME = "microbench-testbed"


def say(msg: str) -> None:
  print(f"{NAME}: {msg}", file=sys.stderr, flush=True)


def _shape_kwargs() -> dict:
  try:
    return dict(host_rate=rates.parse_rate(FLAGS.host_rate), host_delay_us=rates.parse_delay(FLAGS.host_delay),
                uplink_rate=rates.parse_rate(FLAGS.uplink_rate),
                uplink_delay_us=rates.parse_delay(FLAGS.uplink_delay), queue=FLAGS.queue,
                faults=tuple(FLAGS.fault))
  except ValueError as e:
    raise app.UsageError(str(e)) from e


def _host_count() -> int:
  if not FLAGS.hosts or len(FLAGS.hosts) != 1 or not FLAGS.hosts[0].isdigit():
    raise app.UsageError("--hosts=H (one number of hosts) is required")
  return int(FLAGS.hosts[0])


def _new_testbed() -> tbm.Testbed:
  kwargs = dict(hosts=_host_count(), racks=FLAGS.racks, **_shape_kwargs())
  try:
    if FLAGS.id:
      if any(ns.startswith(FLAGS.id + "-") for ns in tbm.list_netns()):
        raise app.UsageError(f"testbed {FLAGS.id} already exists; `down --id={FLAGS.id}` first")
      return tbm.Testbed(prefix=FLAGS.id, state_path=FLAGS.state or "", **kwargs)
    bed = tbm.Testbed.new(**kwargs)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if FLAGS.state:
    bed.state_path = FLAGS.state
  return bed


def _existing_state() -> str:
  if FLAGS.state:
    return FLAGS.state
  if FLAGS.id:
    return tbm.state_path_for(FLAGS.id)
  states = tbm.find_states()
  if len(states) != 1:
    raise app.UsageError(f"{len(states)} testbeds found ({', '.join(states) or 'none'}): pass --id or --state")
  return states[0]


def _run_jobs(bed: tbm.Testbed, host_lists: list[list[int]]) -> int:
  """Runs one job per host list, concurrently; prints and returns the first failed job's exit status."""
  log_root = FLAGS.log_dir or tempfile.mkdtemp(prefix=f"microbench-{bed.prefix}-")
  try:  # only the log folder is guarded: an OSError while the jobs run is not the user's input
    os.makedirs(log_root, exist_ok=True)
  except OSError as e:
    raise app.UsageError(f"cannot create the log dir {log_root}: {e.strerror}") from None
  reports = testbed_jobs.run_jobs(bed, host_lists, _COMMAND, log_root=log_root,
                                  devices_per_process=FLAGS.devices_per_process, pass_flags=FLAGS.pass_flags,
                                  timeout=FLAGS.timeout or None, grace=FLAGS.grace, say=say)
  if FLAGS.report:
    try:
      with open(FLAGS.report, "w", encoding="utf-8") as f:
        json.dump(dict(testbed=bed.prefix, command=_COMMAND, jobs=[dataclasses.asdict(r) for r in reports]), f,
                  indent=1)
    except OSError as e:
      raise app.UsageError(f"cannot write --report={FLAGS.report}: {e.strerror}") from None
  return next((r.returncode for r in reports if r.returncode), 0)


def _need_command() -> None:
  if not _COMMAND:
    raise app.UsageError("no command: put it after --, e.g. microbench-testbed --hosts=2 -- python job.py")
  if shutil.which(_COMMAND[0]) is None:
    raise app.UsageError(f"command not found: {_COMMAND[0]}")


def _oneshot() -> int:
  _need_command()
  bed = _new_testbed()
  launch.install_signal_handlers()
  try:
    bed.up()
    say(bed.describe())
    return _run_jobs(bed, [list(range(bed.hosts))])
  except launch.Interrupted as e:
    say(f"interrupted ({e}); stopped all ranks")
    return 128 + e.signum
  finally:
    bed.down()
    say(f"removed testbed {bed.prefix}")


def _up() -> int:
  if _COMMAND:
    raise app.UsageError("`up` takes no command; use `run` afterwards")
  bed = _new_testbed()
  launch.install_signal_handlers()
  try:
    bed.up()
  except launch.Interrupted as e:
    say(f"interrupted ({e}); removed the partial testbed")
    return 128 + e.signum
  say(bed.describe())
  say(f"state {bed.state_path}; hosts {', '.join(f'{i}={bed.addr(i)}' for i in range(bed.hosts))}")
  print(bed.prefix)
  return 0


def _run() -> int:
  _need_command()
  bed = tbm.Testbed.load(_existing_state())
  bed.check_alive()
  try:
    host_lists = [testbed_jobs.parse_host_list(spec, bed.hosts) for spec in FLAGS.hosts] if FLAGS.hosts else [
        list(range(bed.hosts))]
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  launch.install_signal_handlers()
  try:
    return _run_jobs(bed, host_lists)
  except launch.Interrupted as e:
    say(f"interrupted ({e}); stopped all ranks (the testbed stays up)")
    return 128 + e.signum


def _down() -> int:
  if _COMMAND:
    raise app.UsageError("`down` takes no command")
  launch.install_signal_handlers()
  if FLAGS.all:
    prefixes = tbm.all_prefixes()
    for prefix in prefixes:
      tbm.Testbed(prefix=prefix, hosts=1).down()
    say(f"removed {len(prefixes)} testbed(s){': ' + ', '.join(prefixes) if prefixes else ''}")
    return 0
  path = _existing_state()
  if os.path.exists(path):
    bed = tbm.Testbed.load(path)
  elif FLAGS.id:
    bed = tbm.Testbed(prefix=FLAGS.id, hosts=1, state_path=path)  # No state: remove by prefix alone.
  else:
    raise app.UsageError(f"no state file {path}; pass --id to remove by name")
  removed = bed.down()
  say(f"removed testbed {bed.prefix} ({len(removed)} namespace(s))")
  return 0


def main(argv: list[str]) -> int:
  args = argv[1:]
  mode = args.pop(0) if args and args[0] in MODES else None
  if args:
    raise app.UsageError(f"unexpected arguments {args}; modes are {'/'.join(MODES)}; put the command after --")
  if FLAGS.fault and mode in ("run", "down"):
    raise app.UsageError(f"--fault is planted when the testbed is built (up, or the one-shot form), not by {mode}")
  problem = tbm.permission_problem()
  if problem:
    say(problem)
    return 1
  try:
    return {None: _oneshot, "up": _up, "run": _run, "down": _down}[mode]()
  except tbm.TestbedError as e:
    say(f"error: {e}")
    return 1


def run() -> None:
  """Console-script entry point."""
  absl_app.run_with_command(main, _COMMAND, NAME, __name__)


if __name__ == "__main__":
  run()
