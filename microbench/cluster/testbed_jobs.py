"""Jobs on the emulated cluster: which hosts each job uses, one coordinator per job on its first host,
per-job logs, and a report of how each job ended.

Several jobs may share hosts (and so links): that is how the testbed stages multi-tenancy. Process I of a
job runs inside its host's namespace with the same flags and environment as under the local launcher,
plus MICROBENCH_JOB and the namespace's name as MICROBENCH_HOSTNAME.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

from microbench.cluster import launch
from microbench.cluster.testbed import Testbed


def parse_host_list(spec: str, hosts: int) -> list[int]:
  """'0,1' / '0-3' / '0,0,1' (two processes on host 0) -> host indices; ValueError says what is allowed."""
  out = []
  for part in spec.split(","):
    try:
      if "-" in part:
        lo, hi = (int(x) for x in part.split("-"))
        out.extend(range(lo, hi + 1))
      else:
        out.append(int(part))
    except ValueError:
      raise ValueError(f"bad --hosts={spec!r}: want e.g. 0,1 or 0-3") from None
  bad = [h for h in out if not 0 <= h < hosts]
  if not out or bad:
    raise ValueError(f"--hosts={spec!r}: hosts must be in 0..{hosts - 1}")
  return out


@dataclasses.dataclass(frozen=True)
class JobReport:
  """How one testbed job ended (one entry of the --report JSON)."""
  job: int
  hosts: list[int]
  returncode: int
  failed_rank: int | None
  failed_code: int | None
  reason: str
  seconds: float
  log_dir: str


FABRIC_ENV = "MICROBENCH_FABRIC"  # the testbed as a described fabric: what `microbench` expects of its points


def fabric_spec(bed: Testbed) -> str | None:
  """The healthy testbed as `--fabric` would describe it (planted faults are not in it: the expectation is of
  the machine as built, so a fault shows as LOW); None where its host links are unshaped (no rate to expect)."""
  if not bed.host_rate:
    return None
  return (f"testbed:racks={bed.racks},hosts_per_rack={bed.hosts // bed.racks},host_rate={bed.host_rate}bit,"
          f"uplink_rate={f'{bed.uplink_rate}bit' if bed.uplink_rate else 'none'},queue={bed.queue}")


def job_procs(bed: Testbed, hosts: Sequence[int], command: Sequence[str], name: str, log_dir: str, *,
              devices_per_process: int = 1, pass_flags: bool = True, passthrough: bool = True,
              prefix: str = "") -> list[launch.Proc]:
  """The processes of one job, process I inside host hosts[I], with a coordinator on its first host (not
  started; see launch.run_jobs or the study's runner). Logs go to log_dir/rank<I>.log."""
  coordinator = f"{bed.addr(hosts[0])}:{bed.free_port(hosts[0])}"
  n = len(hosts)
  procs = []
  for i, h in enumerate(hosts):
    argv = bed.exec_argv(h, list(command) + (launch.distributed_flags(coordinator, n, i) if pass_flags else []))
    env = launch.rank_env(coordinator, n, i, devices_per_process, bed.host_name(h), job=name)
    spec = fabric_spec(bed)
    if spec:
      env[FABRIC_ENV] = spec
    procs.append(launch.Proc(name, i, argv, env, os.path.join(log_dir, f"rank{i}.log"),
                             passthrough=passthrough and i == 0, prefix=prefix))
  return procs


def run_jobs(bed: Testbed, host_lists: Sequence[Sequence[int]], command: Sequence[str], *, log_root: str,
             devices_per_process: int = 1, pass_flags: bool = True, timeout: float | None = None,
             grace: float = 2.0, say: Callable[[str], None] = print) -> list[JobReport]:
  """Runs one job per host list, all at once, and reports each (a failed job stops only its own ranks).

  Raises OSError when a job's log folder can't be created."""
  jobs: dict[str, list[launch.Proc]] = {}
  several = len(host_lists) > 1
  for j, hosts in enumerate(host_lists):
    name = str(j)
    log_dir = os.path.join(log_root, f"job{j}")
    os.makedirs(log_dir, exist_ok=True)
    procs = job_procs(bed, hosts, command, name, log_dir, devices_per_process=devices_per_process,
                      pass_flags=pass_flags, prefix=f"[job{j}] " if several else "")
    if not several:
      for p in procs:
        p.job = ""
    jobs[name] = procs
    say(f"job {j}: {len(hosts)} process(es) on host(s) {','.join(map(str, hosts))}, coordinator "
        f"{procs[0].env[launch.ENV_COORDINATOR]}, logs in {log_dir}")
  results = launch.run_jobs(jobs, timeout=timeout, grace=grace, say=say)
  reports = []
  for j, hosts in enumerate(host_lists):
    r = results[str(j)]
    status = "exit 0" if r.returncode == 0 else f"FAILED (exit {r.returncode}: {r.reason})"
    say(f"job {j} on host(s) {','.join(map(str, hosts))}: {status} in {r.seconds:.1f} s")
    reports.append(JobReport(j, list(hosts), r.returncode, r.failed_rank, r.failed_code, r.reason,
                             round(r.seconds, 3), os.path.join(log_root, f"job{j}")))
  return reports
