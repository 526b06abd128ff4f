"""XLA:GPU's command buffers (CUDA graphs) for a point's programs: `--command_buffer`, nccl-tests' `-G`.

Without command buffers the GPU runtime launches every thunk of a program from the host, one by one, on every
call and on every trip of a loop; with them it records the program once into a CUDA graph and launches that:
collectives included (NCCL kernels captured into the graph) and a loop with a known trip count as a
conditional node that iterates on the device. What that saves is launch overhead: visible at small messages.

The options are set per compile (`compiler_options`), not process-wide through XLA_FLAGS, so both arms of
`--command_buffer=both` compile in one process. Both arms are pinned rather than left to XLA's default (which
has changed between versions and already records runs of 5 or more fusions): `no` lists no command type at
all (every thunk launched on its own, nccl-tests without -G), `yes` lists XLA's default types plus
collectives, loops and conditionals, from one command up (XLA's default minimum is 5).

XLA:GPU forms command buffers on the thunk sequence, after the HLO (microbench.hlo.thunks): a program
that must be checked is compiled with `xla_dump_to` a temporary folder and its thunk sequence read back.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import tempfile
from typing import Any

SETTINGS = ("no", "yes", "both")
# XLA's default command types (FUSION ... DYNAMIC_SLICE_FUSION in this jaxlib) plus what a timed loop of
# collectives needs. Spelled out: compiler_options takes no `+COLLECTIVES` form (it is refused as no enum).
YES_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,COLLECTIVES,WHILE,CONDITIONAL"
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
SAYS = {  # the sweep's header line per setting
    "yes": "every program recorded into XLA:GPU command buffers (CUDA graphs), collectives and the timed loop"
           " included, as checked in its thunk sequence",
    "both": "each point timed without command buffers (time(us)) and again with them (cmdbuf(us)), its"
            " collectives and timed loop inside one, as checked in its thunk sequence",
}


@dataclasses.dataclass(frozen=True)
class Arm:
  """How one program is compiled: with command buffers or with none, and whether its thunk sequence is read
  to confirm where the collective and the loop run."""
  on: bool
  check: bool = True

  @property
  def name(self) -> str:
    return "yes" if self.on else "no"

  def options(self) -> dict[str, Any]:
    if not self.on:
      return {"xla_gpu_enable_command_buffer": ""}
    return {"xla_gpu_enable_command_buffer": YES_COMMANDS, "xla_gpu_graph_min_graph_size": 1}


def applies(platform: str) -> bool:
  """Command buffers are XLA:GPU's: no other platform has them."""
  return platform in GPU_PLATFORMS


def refusal(setting: str, platform: str) -> str | None:
  """Why `--command_buffer=setting` can't run on devices of `platform` (one line), None when it can."""
  if setting == "no" or applies(platform):
    return None
  return (f"--command_buffer={setting}: command buffers (CUDA graphs) are XLA:GPU's, and this run's devices are"
          f" {platform}; drop the flag, or add --target=KIND to compile for a GPU kind and check them")


def refuses_collective(setting: str, name: str) -> str | None:
  """Why `name` can't be measured with command buffers (one line), or None: XLA:GPU launches the ragged
  all-to-all outside them whatever is asked (its thunk sequence has every ragged collective outside; a
  target sweep shows it), so --command_buffer would measure nothing it promises."""
  if setting != "no" and name.startswith("ragged_all_to_all"):
    return (f"--command_buffer={setting} with {name}: XLA:GPU launches the ragged all-to-all outside command"
            " buffers (none of its collective thunks is captured); measure it without --command_buffer")
  return None


def main_arm(setting: str, platform: str) -> Arm | None:
  """The arm of a point's main programs: None off GPUs (nothing is set: XLA:CPU has no command buffers);
  `both` times the plain programs first (its `time_us`, as nccl-tests' default) and `yes` as the second arm.
  The default `no` pins command buffers off without reading the thunk sequence (no dump on every compile)."""
  if not applies(platform):
    return None
  return Arm(on=setting == "yes", check=setting != "no")


# XLA:GPU runs a command buffer's first execution op by op ("warm up iteration") and records and instantiates the
# CUDA graph on the next: two untimed calls of each timed program before the samples (program.time_pairs).
GRAPH_WARMUP = 2

SECOND_ARM = Arm(on=True)  # --command_buffer=both: the same programs again, with command buffers


def compile_lowered(lowered, arm: Arm):
  """`lowered.compile()` with the arm's options; returns (compiled, thunk sequence text or None). With
  `arm.check` XLA dumps into a temporary folder, read and removed here (the thunk sequence after XLA's thunk
  passes, which only exists when a pass changed it, else the one before them)."""
  if not arm.check:
    return lowered.compile(compiler_options=arm.options()), None
  with tempfile.TemporaryDirectory(prefix="microbench-thunks-") as folder:
    compiled = lowered.compile(compiler_options={**arm.options(), "xla_dump_to": folder})
    users = _users_dump_folder()
    if users:  # the per-compile option outranks XLA_FLAGS: the user's own dump still gets the program
      shutil.copytree(folder, users, dirs_exist_ok=True)
    return compiled, read_thunk_sequence(folder)


def _users_dump_folder() -> str | None:
  """The folder of `--xla_dump_to` in XLA_FLAGS, if the user set one."""
  m = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
  return m.group(1).strip("'\"") if m else None


def read_thunk_sequence(folder: str) -> str | None:
  """The final thunk sequence XLA dumped into `folder` (one module), None when there is none (e.g. a hit in
  JAX's persistent compilation cache: nothing was compiled, so nothing was dumped)."""
  for pattern in ("*.thunk_sequence_after_thunk_passes.txt", "*.thunk_sequence.txt"):
    found = sorted(glob.glob(os.path.join(folder, pattern)))
    if found:
      with open(found[-1], encoding="utf-8") as f:
        return f.read()
  return None
