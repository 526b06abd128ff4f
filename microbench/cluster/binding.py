"""Which GPUs each process drives: the local device ids handed to `jax.distributed`, decided from the launcher's
variables, with the rule that decided them so a run can record it.

JAX's own rule under SLURM and Open MPI is "local rank L drives visible GPU L". It holds only when every task
on a node sees all of the node's GPUs and there is one task per GPU. Sites that bind GPUs per task
(`--gpus-per-task`, `--gpu-bind`, a prolog setting CUDA_VISIBLE_DEVICES) show each task its own GPU as device
0, so local rank 3 asks for a GPU it cannot see and the job dies at start-up; one process per node is given
only GPU 0 of its 8. The rules, first match wins (`RULES` says the same in words):

1. `--local_device_ids=I,J`, else (in a `--distributed` job, as JAX) JAX_LOCAL_DEVICE_IDS: exactly those, as
   indices among the GPUs the process sees.
2. Not a `--distributed` job, or no launcher (no SLURM_LOCALID / OMPI_COMM_WORLD_LOCAL_RANK): every GPU seen.
3. CUDA_VISIBLE_DEVICES shows no GPU: nothing to choose.
4. The launcher bound this task's own GPUs: SLURMD_TRES_BIND names a GPU binding (srun's --gpus-per-task,
   --gpu-bind), or the task sees fewer GPUs than the step has on the node (SLURM_GPUS_ON_NODE, else
   SLURM_JOB_GPUS), or, where neither is known, one GPU or fewer GPUs than tasks. Then every GPU it sees
   (CUDA renumbers them from 0). Tasks whose sets must overlap (8 tasks bound to 4 of 8 GPUs each, as
   --gpu-bind=closest gives) are refused: which GPU is a task's own cannot be told.
5. One task on this node: every GPU it sees (one process per node drives all of them).
6. T tasks on this node (SLURM_STEP_TASKS_PER_NODE, OMPI_COMM_WORLD_LOCAL_SIZE) share P GPUs
   (CUDA_VISIBLE_DEVICES, else GPU_DEVICE_ORDINAL, else SLURM_STEP_GPUS): local rank L drives the L-th block of
   P / T (P == T: GPU L); P not a multiple of T is refused.
7. No GPU list at all: GPU L, JAX's own rule.

Open MPI's local rank wins over SLURM's: `mpirun` inside an allocation leaves its ranks the SLURM variables of
the daemon step that started them. GPU lists are compared by count, not by id: cgroup-constrained nodes
renumber CUDA_VISIBLE_DEVICES from 0 while SLURM's lists keep the node's ids. What SLURM sets was read off
SLURM 22.05 on the emulated cluster: under a per-task binding it narrows CUDA_VISIBLE_DEVICES, GPU_DEVICE_ORDINAL
and SLURM_STEP_GPUS to the task's GPUs alike, and keeps SLURM_GPUS_ON_NODE and SLURMD_TRES_BIND for the step.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

RULES = {
    "flag": "--local_device_ids as given",
    "jax_env": "JAX_LOCAL_DEVICE_IDS as given",
    "single_process": "not a --distributed job: every GPU the process sees",
    "no_launcher": "no launcher's local rank (SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK): every GPU the process sees",
    "no_gpus": "CUDA_VISIBLE_DEVICES shows no GPU: nothing to choose",
    "task_bound": "the launcher bound this task's own GPUs: every GPU it sees",
    "one_per_node": "one task on this node: every GPU it sees",
    "shared_split": "the node's tasks share its GPUs: local rank L drives the L-th equal block",
    "local_rank": "the GPU count is unknown: GPU numbered by the local rank (JAX's own rule)",
}
# Every variable the decision reads, recorded with it.
INPUTS = ("CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS",
          "SLURMD_TRES_BIND", "SLURM_LOCALID",
          "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
          "JAX_LOCAL_DEVICE_IDS")


class BindingError(ValueError):
  """A binding that cannot be decided or is impossible; the message is one line saying what to change."""


@dataclasses.dataclass(frozen=True)
class Binding:
  """The decision: `local_device_ids` None means every GPU the process sees."""
  local_device_ids: tuple[int, ...] | None
  rule: str
  reason: str
  inputs: dict[str, str] = dataclasses.field(default_factory=dict)

  def jax_argument(self) -> list[int]:
    """jax.distributed.initialize's local_device_ids: [] for every visible GPU, which also keeps JAX from
    applying its own local-rank rule on top (it fills in only a None)."""
    return list(self.local_device_ids) if self.local_device_ids is not None else []

  def record(self) -> dict[str, Any]:
    """For meta.json: the ids (null: all the process sees), the rule, why, and the variables read."""
    ids = None if self.local_device_ids is None else list(self.local_device_ids)
    return {"local_device_ids": ids, "rule": self.rule, "reason": self.reason, "inputs": dict(self.inputs)}


_current: Binding | None = None


def remember(binding: Binding) -> None:
  """The binding this process started with (distributed.initialize calls it), for the environment record."""
  global _current  # pylint: disable=global-statement
  _current = binding


def current() -> Binding | None:
  return _current


def parse_ids(text: str, what: str = "--local_device_ids") -> tuple[int, ...]:
  """'0,1,2,3' -> (0, 1, 2, 3); anything else is one line naming `what`."""
  parts = [p.strip() for p in text.split(",")]
  if not text.strip() or not all(re.fullmatch(r"\d+", p) for p in parts):
    raise BindingError(f"{what}={text!r}: give GPU indices as non-negative integers separated by commas, e.g. 0,1")
  ids = tuple(int(p) for p in parts)
  if len(set(ids)) != len(ids):
    raise BindingError(f"{what}={text!r} names a GPU twice; give each index once")
  return ids


def visible_count(cvd: str) -> int:
  """How many GPUs CUDA shows for CUDA_VISIBLE_DEVICES=`cvd`: the entries before the first invalid one (CUDA
  stops there), an entry being an index, a GPU-/MIG- UUID; '', '-1' or 'NoDevFiles' show none."""
  n = 0
  for entry in cvd.split(","):
    entry = entry.strip()
    if not (re.fullmatch(r"\d+", entry) or entry.startswith(("GPU-", "MIG-"))):
      break
    n += 1
  return n


def gpu_list(text: str) -> list[str]:
  """SLURM's GPU lists ('0,1,2,3', '0-3', '0-1,4'), expanded; other entries are kept as they are."""
  out: list[str] = []
  for part in (p.strip() for p in text.split(",") if p.strip()):
    m = re.fullmatch(r"(\d+)-(\d+)", part)
    out += [str(i) for i in range(int(m.group(1)), int(m.group(2)) + 1)] if m else [part]
  return out


def tasks_on_node(spec: str, node: int | None) -> int | None:
  """Tasks on this node from SLURM's '8(x2),4' form (node `node` of the step); None when it cannot say."""
  counts: list[int] = []
  for part in (p.strip() for p in spec.split(",") if p.strip()):
    m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
    if not m:
      return None
    counts += [int(m.group(1))] * int(m.group(2) or 1)
  if not counts:
    return None
  if len(set(counts)) == 1:
    return counts[0]
  return counts[node] if node is not None and 0 <= node < len(counts) else None


def _int(environ: Mapping[str, str], name: str) -> int | None:
  text = environ.get(name)
  if text is None or text.strip() == "":
    return None
  if not re.fullmatch(r"\s*\d+\s*", text):
    raise BindingError(f"{name}={text!r} is not a non-negative integer; the GPU binding reads it as the launcher"
                       f" wrote it: check the launcher, or pass --local_device_ids")
  return int(text)


def _launcher(environ: Mapping[str, str]) -> tuple[str, int, int | None] | None:
  """(launcher, local rank, tasks on this node or None): Open MPI's before SLURM's."""
  if environ.get("OMPI_COMM_WORLD_LOCAL_RANK") is not None:
    return "Open MPI", _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
  if environ.get("SLURM_LOCALID") is not None:
    tasks = environ.get("SLURM_STEP_TASKS_PER_NODE")
    return ("SLURM", _int(environ, "SLURM_LOCALID"),
            tasks_on_node(tasks, _int(environ, "SLURM_NODEID")) if tasks else None)
  return None


def decide(flag_ids: Sequence[int] | None, distributed: bool, environ: Mapping[str, str]) -> Binding:
  """The binding for a process with `environ` (os.environ), `--local_device_ids` (None: not given) and
  whether it joins a `--distributed` job; BindingError (one line) where the rules cannot give a right one."""
  inputs = {k: environ[k] for k in INPUTS if k in environ}

  def bound(ids: Sequence[int] | None, rule: str, reason: str) -> Binding:
    return Binding(None if ids is None else tuple(ids), rule, reason, inputs)

  cvd = environ.get("CUDA_VISIBLE_DEVICES")
  seen = None if cvd is None else visible_count(cvd)
  explicit = _explicit(flag_ids, distributed, environ, seen, cvd)
  if explicit:
    rule, what, ids = explicit
    return bound(ids, rule, f"{what}={','.join(map(str, ids))}")
  if not distributed:
    return bound(None, "single_process", RULES["single_process"])
  launcher = _launcher(environ)
  if launcher is None:
    return bound(None, "no_launcher", RULES["no_launcher"])
  name, local, tasks = launcher
  where = f"{name} local rank {local}" + (f" of {tasks} tasks on this node" if tasks else "")
  if tasks is not None and local >= tasks:
    raise BindingError(f"{where}: the local rank must be below the task count; check the launcher's variables,"
                       f" or pass --local_device_ids")
  if seen == 0:
    return bound(None, "no_gpus", f"{where}; CUDA_VISIBLE_DEVICES={cvd!r} shows no GPU")
  pool, named = _pool(environ, seen, cvd)
  on_node, tres, slurm_bound = _slurm_gpus(environ)
  if pool is None:
    own = False
  elif slurm_bound:
    own = True
  elif on_node:
    own = len(pool) < on_node
  else:  # one GPU, or fewer than the node's tasks: not a set they could share one each
    own = len(pool) == 1 or (tasks is not None and len(pool) < tasks)
  if own:
    if tasks is not None and on_node and tasks * len(pool) > on_node:
      raise BindingError(f"{where} sees {named} of the node's {on_node}: {tasks} tasks cannot each have"
                         f" {len(pool)} GPU(s) of their own (overlapping sets, as --gpu-bind=closest gives); bind"
                         f" one set per task (--gpus-per-task, --gpu-bind=single:1 or map_gpu) or pass"
                         f" --local_device_ids")
    why = f"SLURMD_TRES_BIND={tres!r}" if slurm_bound else "bound to this task"
    return bound(None if seen is not None else pool, "task_bound", f"{where}; {named}: {why}")
  if tasks == 1:
    return bound(None if seen is not None else pool, "one_per_node",
                 f"{where}; {named or 'every GPU it sees'}: all of them for the one process")
  if pool is None:
    return bound([local], "local_rank", f"{where}; no GPU list: GPU {local} (JAX's own rule)")
  share = tasks or len(pool)  # unknown task count: one GPU each, as JAX assumes
  if len(pool) < share or len(pool) % share:
    raise BindingError(f"{where}; {named} does not split evenly among {share} tasks; run one task per GPU (or"
                       f" one per node), or pass --local_device_ids")
  if local >= share:
    raise BindingError(f"{where}; {named} has no GPU for this local rank; pass --local_device_ids")
  k = len(pool) // share
  ids = pool[local * k:(local + 1) * k]
  return bound(ids, "shared_split", f"{where}; {named} shared: {k} each, this task's {','.join(map(str, ids))}")


def _explicit(flag_ids: Sequence[int] | None, distributed: bool, environ: Mapping[str, str], seen: int | None,
              cvd: str | None) -> tuple[str, str, tuple[int, ...]] | None:
  """The ids given outright (rule, where, ids): `--local_device_ids`, or JAX_LOCAL_DEVICE_IDS in a distributed
  job (JAX reads it there only); refused when empty or past the GPUs CUDA_VISIBLE_DEVICES shows."""
  explicit = ("flag", "--local_device_ids", tuple(flag_ids)) if flag_ids is not None else None
  if explicit is None and distributed and environ.get("JAX_LOCAL_DEVICE_IDS", "").strip():  # JAX reads it there only
    explicit = ("jax_env", "JAX_LOCAL_DEVICE_IDS", parse_ids(environ["JAX_LOCAL_DEVICE_IDS"], "JAX_LOCAL_DEVICE_IDS"))
  if explicit:
    rule, what, ids = explicit
    if not ids:
      raise BindingError(f"{what} is empty; give GPU indices, e.g. 0,1")
    if seen is not None and max(ids) >= seen:
      shown = f"{seen} GPU(s), numbered 0..{seen - 1}" if seen else "no GPU"
      raise BindingError(f"{what}={','.join(map(str, ids))} but CUDA_VISIBLE_DEVICES={cvd!r} shows this process"
                         f" {shown}: the ids index the GPUs the process sees")
  return explicit


def _pool(environ: Mapping[str, str], seen: int | None, cvd: str | None) -> tuple[list[int] | None, str]:
  """The GPUs this task may use, as the indices jax_cuda_visible_devices takes, and what named them."""
  ordinals = None
  if seen is None and environ.get("GPU_DEVICE_ORDINAL", "").strip():
    ordinals = gpu_list(environ["GPU_DEVICE_ORDINAL"])
    if not all(o.isdigit() for o in ordinals):
      raise BindingError(f"GPU_DEVICE_ORDINAL={environ['GPU_DEVICE_ORDINAL']!r} is not a list of GPU indices;"
                         f" pass --local_device_ids")
  step = gpu_list(environ.get("SLURM_STEP_GPUS", ""))
  # The GPUs this task may use, as the indices jax_cuda_visible_devices takes (CUDA's numbering in this process):
  # CUDA_VISIBLE_DEVICES renumbers from 0; without it CUDA shows the whole node, whose ids SLURM's lists use.
  if seen is not None:
    pool, named = list(range(seen)), f"CUDA_VISIBLE_DEVICES={cvd!r} ({seen} GPU(s))"
  elif ordinals is not None:
    pool, named = [int(o) for o in ordinals], f"GPU_DEVICE_ORDINAL={environ['GPU_DEVICE_ORDINAL']!r}"
  elif step and all(g.isdigit() for g in step):
    pool, named = [int(g) for g in step], f"SLURM_STEP_GPUS={environ['SLURM_STEP_GPUS']!r}"
  else:
    pool, named = None, ""
  return pool, named


def _slurm_gpus(environ: Mapping[str, str]) -> tuple[int | None, str, bool]:
  """The step's GPUs on this node (SLURM_STEP_GPUS is narrowed to the task's own under a binding; these are
  not), SLURMD_TRES_BIND, and whether SLURM bound GPUs to the task."""
  on_node = _int(environ, "SLURM_GPUS_ON_NODE")
  if on_node is None and environ.get("SLURM_JOB_GPUS", "").strip():
    on_node = len(gpu_list(environ["SLURM_JOB_GPUS"]))
  tres = environ.get("SLURMD_TRES_BIND", "")
  slurm_bound = any(p.startswith("gpu:") and p != "gpu:none" for p in re.split(r"[;,](?=\w+:)", tres))
  return on_node, tres, slurm_bound
