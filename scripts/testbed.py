#!/usr/bin/env python3
"""An emulated cluster on one machine: hosts are network namespaces behind tc-shaped links.

One-shot (build, run one job with process i in host i, remove everything):
  scripts/testbed.py --hosts=2 --host_rate=200mbit [--host_delay=1ms] -- python -m microbench ...
  scripts/testbed.py --hosts=4 --racks=2 --host_rate=400mbit --uplink_rate=100mbit -- <command ...>
Long-lived, for several concurrent jobs (multi-tenancy):
  scripts/testbed.py up --hosts=4 --host_rate=200mbit [--id=tbNAME]      # prints the id and state file
  scripts/testbed.py run --id=tbNAME --hosts=0,1 --hosts=0-3 -- <command>  # 2 jobs, sharing hosts 0,1
  scripts/testbed.py down --id=tbNAME                                    # or --state=PATH, or --all

Each job gets its own coordinator (on its first host's address, a free port) and every process gets
`--distributed --coordinator_address=... --num_processes=N --process_id=I` appended (unless
--pass_flags=false), plus MICROBENCH_* env vars, JAX_NUM_CPU_DEVICES and MICROBENCH_HOSTNAME=<ns name>.
Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN); see microbench/testbed.py for the topology.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=g-import-not-at-top

from microbench import launch  # pylint: disable=g-import-not-at-top
from microbench import testbed as tbm  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("hosts", None,
                          "One-shot / up: the number of hosts. run: the hosts of one job, e.g. 0,1 or 0-3; "
                          "repeat the flag for several concurrent jobs (default: one job on all hosts).")
flags.DEFINE_integer("racks", 1, "Racks, each with its own switch; hosts are split evenly, in order.", lower_bound=1)
flags.DEFINE_string("host_rate", "", "Host link rate in tc units (200mbit, 1gbit); empty: unshaped.")
flags.DEFINE_string("host_delay", "", "Host link one-way delay per link (500us, 1ms); needs sch_netem.")
flags.DEFINE_string("uplink_rate", "", "Rack-to-core uplink rate (racks > 1); empty: unshaped.")
flags.DEFINE_string("uplink_delay", "", "Rack-to-core uplink one-way delay; needs sch_netem.")
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


def say(msg: str) -> None:
  print(f"testbed: {msg}", file=sys.stderr, flush=True)


def _shape_kwargs() -> dict:
  try:
    return dict(host_rate=tbm.parse_rate(FLAGS.host_rate), host_delay_us=tbm.parse_delay(FLAGS.host_delay),
                uplink_rate=tbm.parse_rate(FLAGS.uplink_rate),
                uplink_delay_us=tbm.parse_delay(FLAGS.uplink_delay))
  except ValueError as e:
    raise app.UsageError(str(e)) from e


def _host_count() -> int:
  if not FLAGS.hosts or len(FLAGS.hosts) != 1 or not FLAGS.hosts[0].isdigit():
    raise app.UsageError("--hosts=H (one number of hosts) is required")
  return int(FLAGS.hosts[0])


def _parse_hosts(spec: str, hosts: int) -> list[int]:
  """'0,1' / '0-3' / '0,0,1' (two processes on host 0) -> host indices."""
  out = []
  for part in spec.split(","):
    try:
      if "-" in part:
        lo, hi = (int(x) for x in part.split("-"))
        out.extend(range(lo, hi + 1))
      else:
        out.append(int(part))
    except ValueError as e:
      raise app.UsageError(f"bad --hosts={spec!r}: want e.g. 0,1 or 0-3") from e
  bad = [h for h in out if not 0 <= h < hosts]
  if not out or bad:
    raise app.UsageError(f"--hosts={spec!r}: hosts must be in 0..{hosts - 1}")
  return out


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
  """Runs one job per host list, concurrently; prints and returns (worst) exit status."""
  log_root = FLAGS.log_dir or tempfile.mkdtemp(prefix=f"microbench-{bed.prefix}-")
  jobs: dict[str, list[launch.Proc]] = {}
  for j, hosts in enumerate(host_lists):
    name = str(j)
    log_dir = os.path.join(log_root, f"job{j}")
    try:
      os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
      raise app.UsageError(f"cannot create log dir {log_dir}: {e.strerror}") from None
    coordinator = f"{bed.addr(hosts[0])}:{bed.free_port(hosts[0])}"
    n = len(hosts)
    procs = []
    for i, h in enumerate(hosts):
      argv = bed.exec_argv(h, list(_COMMAND) + (launch.distributed_flags(coordinator, n, i) if FLAGS.pass_flags
                                                 else []))
      env = launch.with_repo_on_path(dict(os.environ, **launch.distributed_env(
          coordinator, n, i, FLAGS.devices_per_process, bed.host_name(h), job=name)))
      procs.append(launch.Proc(name if len(host_lists) > 1 else "", i, argv, env,
                               os.path.join(log_dir, f"rank{i}.log"), passthrough=(i == 0),
                               prefix=f"[job{j}] " if len(host_lists) > 1 else ""))
    jobs[name] = procs
    say(f"job {j}: {n} process(es) on host(s) {','.join(map(str, hosts))}, coordinator {coordinator}, "
        f"logs in {log_dir}")
  results = launch.run_jobs(jobs, timeout=FLAGS.timeout or None, grace=FLAGS.grace, say=say)
  report = []
  for j, hosts in enumerate(host_lists):
    r = results[str(j)]
    status = "exit 0" if r.returncode == 0 else f"FAILED (exit {r.returncode}: {r.reason})"
    say(f"job {j} on host(s) {','.join(map(str, hosts))}: {status} in {r.seconds:.1f} s")
    report.append(dict(job=j, hosts=hosts, returncode=r.returncode, failed_rank=r.failed_rank,
                       failed_code=r.failed_code, reason=r.reason, seconds=round(r.seconds, 3),
                       log_dir=os.path.join(log_root, f"job{j}")))
  if FLAGS.report:
    with open(FLAGS.report, "w", encoding="utf-8") as f:
      json.dump(dict(testbed=bed.prefix, command=_COMMAND, jobs=report), f, indent=1)
  return next((r["returncode"] for r in report if r["returncode"]), 0)


def _need_command() -> None:
  if not _COMMAND:
    raise app.UsageError("no command: put it after --, e.g. scripts/testbed.py --hosts=2 -- python job.py")
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
  host_lists = [_parse_hosts(spec, bed.hosts) for spec in FLAGS.hosts] if FLAGS.hosts else [
      list(range(bed.hosts))]
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
  launch.run_script(main, _COMMAND, "testbed", __name__)


if __name__ == "__main__":
  run()
