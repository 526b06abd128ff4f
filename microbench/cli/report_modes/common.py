"""What the store modes share: opening the store the flags name, in one line when it cannot be."""

from __future__ import annotations

from absl import app, flags

FLAGS = flags.FLAGS


def open_store(beside: str | None = None):
  """The store --store (or $MICROBENCH_STORE, or microbench.db beside `beside` or under runs/) names."""
  from microbench.store import connect  # pylint: disable=import-outside-toplevel
  try:
    url = connect.resolve(FLAGS.store, beside=beside)
    if url is None:
      raise app.UsageError("--store=none: this mode reads the results store; give --store=PATH or a postgresql://"
                           " URL")
    return connect.open_store(url)
  except connect.StoreError as e:
    raise app.UsageError(str(e)) from None


def beside(paths: list[str]) -> str | None:
  """The run folder the default store sits beside: the first one given."""
  import os  # pylint: disable=import-outside-toplevel
  return next((p for p in paths if os.path.exists(p)), None)


def drain_commands(named: dict[str, str]) -> list[list[str]]:
  """scontrol's drain command per named node, with the doctor's reason."""
  return [["scontrol", "update", f"nodename={node}", "state=drain", f"reason=microbench-doctor: {why}"[:200]]
          for node, why in sorted(named.items())]
