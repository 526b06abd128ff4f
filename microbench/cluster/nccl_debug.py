"""NCCL's INFO log of every process, captured into the run folder (`--nccl_debug`, or NCCL_DEBUG set by the
user): NCCL reads these variables once, when the first communicator starts, so they are set before JAX's
backend does; what the user set is kept, only what is missing is added."""

from __future__ import annotations

import glob
import os
from collections.abc import MutableMapping

LOG_DIR = "nccl"  # under the run folder: one file per host and process
SUBSYSTEMS = "INIT,NET,GRAPH,TUNING"  # the network, rings/trees and the per-collective algorithm choice


def wanted(flag: bool, environ: MutableMapping[str, str] = os.environ) -> bool:
  return flag or bool(environ.get("NCCL_DEBUG"))


def enable(outdir: str, environ: MutableMapping[str, str] = os.environ) -> str:
  """Set NCCL_DEBUG=INFO, its subsystems and a per-process NCCL_DEBUG_FILE in the run folder where unset;
  returns the folder the logs go to."""
  folder = os.path.abspath(os.path.join(outdir, LOG_DIR))
  os.makedirs(folder, exist_ok=True)
  environ.setdefault("NCCL_DEBUG", "INFO")
  environ.setdefault("NCCL_DEBUG_SUBSYS", SUBSYSTEMS)
  environ.setdefault("NCCL_DEBUG_FILE", os.path.join(folder, "%h.%p.log"))  # NCCL: %h host, %p process id
  return folder


def read_logs(outdir: str) -> tuple[str, list[str]]:
  """The text of every captured log (those this host can see) and their names."""
  paths = sorted(glob.glob(os.path.join(outdir, LOG_DIR, "*")))
  texts = []
  for p in paths:
    try:
      with open(p, encoding="utf-8", errors="replace") as f:
        texts.append(f.read())
    except OSError:
      continue
  return "\n".join(texts), [os.path.basename(p) for p in paths]
