"""--store, which every command that leaves a run takes: where the run is recorded as it ends (SQLite beside
the run folders unless said otherwise; docs/results-store.md)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from absl import flags

flags.DEFINE_string("store", None, "Results store the run is recorded in as it ends: a SQLite file, a"
                    " postgresql://USER@HOST/DB URL, or none. Default: $MICROBENCH_STORE, else microbench.db beside"
                    " the run folder.")
FLAGS = flags.FLAGS


def record(run_dir: str | None, say: Callable[[str], None] = print) -> None:
  """The finished (or stopped) run into the store, from process 0 only; never fails the command."""
  if not run_dir or not os.path.isdir(run_dir):
    return
  jax = sys.modules.get("jax")  # not imported: one process (the doctor's simulation, a report)
  if jax is not None and jax.process_index() != 0:
    return
  from microbench.store import index  # pylint: disable=import-outside-toplevel
  index.record(FLAGS.store, run_dir, say)
