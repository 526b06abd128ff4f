"""NCCL's INFO log of every process, captured into the run folder (`--nccl_debug`, or NCCL_DEBUG set by the
user): NCCL reads these variables once, when the first communicator starts, so they are set before JAX's
backend does; what the user set is kept, only what is missing is added."""

from __future__ import annotations

import glob
import os
import sys
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


def read_logs(outdir: str) -> dict[str, str]:
  """{file name: text} of every captured log this host can see, kept apart so that a file's cut last line is
  told from a whole one (NCCL ends every line); bytes that are not UTF-8 become U+FFFD, never an error."""
  out = {}
  for p in sorted(glob.glob(os.path.join(outdir, LOG_DIR, "*"))):
    try:
      with open(p, encoding="utf-8", errors="replace") as f:
        out[os.path.basename(p)] = f.read()
    except OSError as e:  # a file that went away or cannot be read: named, the others still read
      print(f"# NCCL: {os.path.basename(p)}: {e.strerror or e}", file=sys.stderr)
  return out
