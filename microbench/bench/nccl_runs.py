"""One sweep run once per NCCL setting (`microbench --nccl_env`), each in a process of its own.

Why processes: NCCL reads NCCL_ALGO, NCCL_PROTO and the channel limits when a communicator starts, and XLA keeps
its communicators for the life of the process, so a setting changed inside one process would not reach the
collectives already set up. Each setting's run is an ordinary run folder under RUN/nccl_settings/<label>
(meta.json records its environment, so the results store and the report see the setting), listed in
RUN/nccl_settings.json as each finishes: a failure mid-way keeps the settings already measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

from microbench.cluster import nccl_settings as ns
from microbench.output import run_folder

_REPLACED = ("--nccl_env", "--outdir", "--collectives")


def child_args(argv: Sequence[str]) -> list[str]:
  """The command's own arguments without the flags each setting's run gets its own value of."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    name = a.split("=", 1)[0]
    if name in _REPLACED:
      skip = "=" not in a
      continue
    out.append(a)
  return out


def run_all(argv: Sequence[str], settings: Sequence[ns.Setting], outdir: str, say=print) -> int:
  """Runs the sweep under each setting (NCCL's own first); the worst exit status."""
  os.makedirs(outdir, exist_ok=True)
  base_env = {k: v for k, v in os.environ.items() if k not in ns.VARIABLES}
  done, worst = [], 0
  for s in settings:
    folder = os.path.join("nccl_settings", s.label)
    say(f"microbench: NCCL setting {s.label} ({' '.join(f'{k}={v}' for k, v in s.env().items()) or 'NCCL decides'}):"
        f" {', '.join(s.collectives)} into {os.path.join(outdir, folder)}")
    cmd = [sys.executable, "-m", "microbench", *child_args(argv), f"--outdir={os.path.join(outdir, folder)}",
           f"--collectives={','.join(s.collectives)}"]
    code = subprocess.call(cmd, env={**base_env, **s.env()})
    worst = max(worst, code)
    done.append({"label": s.label, "env": s.env(), "folder": folder, "collectives": list(s.collectives),
                 "exit": code})
    _write(outdir, done)
  return worst


def _write(outdir: str, done: list[dict]) -> None:
  path = os.path.join(outdir, run_folder.NCCL_SETTINGS)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump({"settings": done}, f, indent=1)
  os.replace(path + ".tmp", path)
