"""`microbench-launch`: N processes of a command on this host as one jax.distributed job (flags only; the
work is in microbench.cluster.launch).

  microbench-launch --num_processes=4 --devices_per_process=2 -- microbench --scopes=scale_out ...

Process I gets `--distributed --coordinator_address=127.0.0.1:PORT --num_processes=N --process_id=I`
appended (unless --pass_flags=false) and MICROBENCH_COORDINATOR / MICROBENCH_NUM_PROCESSES /
MICROBENCH_PROCESS_ID / MICROBENCH_HOSTNAME / JAX_NUM_CPU_DEVICES in its environment. Rank 0's output is
passed through; every rank logs to --log_dir. If a rank fails, the others are stopped and the launcher
exits non-zero naming it, so a broken multi-host run ends in seconds instead of hanging.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from absl import app, flags

from microbench.cli import absl_app
from microbench.cluster import launch

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_processes", None, "Processes in the job.", lower_bound=1)
flags.DEFINE_integer("devices_per_process", 1, "CPU devices per process (JAX_NUM_CPU_DEVICES).", lower_bound=1)
flags.DEFINE_integer("processes_per_host", 0,
                     "If > 0, groups of this many processes report distinct fake host names host0, host1, ... "
                     "(MICROBENCH_HOSTNAME) so one machine emulates several nodes. 0: all report this host.",
                     lower_bound=0)
# --log_dir (absl.logging's flag, reused): directory for the per-rank logs rank<I>.log; default a new temp dir.
flags.DEFINE_float("timeout", 0, "Seconds before the whole job is stopped (exit 124). 0: no limit.", lower_bound=0)
flags.DEFINE_float("grace", 2, "Seconds between SIGTERM and SIGKILL when stopping ranks (JAX's preemption "
                   "notifier swallows SIGTERM in multi-process jobs, so SIGKILL is what usually ends them).",
                   lower_bound=0)
flags.DEFINE_bool("pass_flags", True, "Append the --distributed ... flags to the command (else env only).")
flags.DEFINE_integer("port", 0, "Coordinator port on 127.0.0.1 (0: pick a free one).", lower_bound=0)

NAME = "microbench-launch"
_COMMAND: list[str] = []


def say(msg: str) -> None:
  print(f"{NAME}: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; put the command after --")
  if not _COMMAND:
    raise app.UsageError(f"no command: {NAME} --num_processes=N -- <command ...>")
  if FLAGS.num_processes is None:
    raise app.UsageError("--num_processes is required")
  if shutil.which(_COMMAND[0]) is None:
    raise app.UsageError(f"command not found: {_COMMAND[0]}")
  n = FLAGS.num_processes
  log_dir = FLAGS.log_dir or tempfile.mkdtemp(prefix="microbench-launch-")
  try:
    os.makedirs(log_dir, exist_ok=True)
  except OSError as e:
    raise app.UsageError(f"cannot create --log_dir={log_dir}: {e.strerror}") from None
  coordinator = f"127.0.0.1:{FLAGS.port or launch.free_port()}"
  procs = launch.local_job(_COMMAND, n, FLAGS.devices_per_process, log_dir, coordinator,
                           FLAGS.processes_per_host, FLAGS.pass_flags)
  say(f"{n} process(es) x {FLAGS.devices_per_process} device(s), coordinator {coordinator}, logs in {log_dir}")
  launch.install_signal_handlers()
  try:
    result = launch.run_jobs({"": procs}, timeout=FLAGS.timeout or None, grace=FLAGS.grace, say=say)[""]
  except launch.Interrupted as e:
    say(f"interrupted ({e}); stopped all {n} rank(s). Logs in {log_dir}")
    return 128 + e.signum
  if result.returncode == 0:
    say(f"all {n} rank(s) exited 0 ({result.seconds:.1f} s)")
  else:
    say(f"FAILED: {result.reason}; exit {result.returncode}. Logs in {log_dir}")
  return result.returncode


def run() -> None:
  """Console-script entry point."""
  absl_app.run_with_command(main, _COMMAND, NAME, __name__)


if __name__ == "__main__":
  run()
