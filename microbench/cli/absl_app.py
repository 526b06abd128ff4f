"""absl `app.run` as every command here wants it: `--help` lists the command's own flags, and bad input
is one line (`NAME: error: ...`, exit 2) rather than absl's usage text with every flag."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from absl import app, flags

EXIT_USAGE = 2


def run(main: Callable[[list[str]], int | None], name: str, flag_modules: Sequence[str],
        argv: list[str] | None = None, unknown_flag: Callable[[str], str | None] | None = None) -> None:
  """`unknown_flag(name)`: a better line for a flag absl does not know (e.g. one of another mode), or None for
  absl's own."""
  argv = list(sys.argv if argv is None else argv)
  fv = flags.FLAGS
  for module in flag_modules:  # absl's --help shows the key flags of the module named by argv[0]
    for flag in fv.get_key_flags_for_module(module):
      fv.register_key_flag_for_module(argv[0], flag)

  def guarded(args: list[str]) -> int | None:
    try:
      return main(args)
    except app.UsageError as e:
      print(f"{name}: error: {e}", file=sys.stderr, flush=True)
      return EXIT_USAGE

  def parse(args: list[str]) -> list[str]:  # a flag absl rejects (bad enum value, unknown flag): one line too
    try:
      return fv(args)
    except flags.Error as e:
      better = unknown_flag(e.flagname) if unknown_flag and isinstance(e, flags.UnrecognizedFlagError) else None
      print(f"{name}: error: {better or e}", file=sys.stderr, flush=True)
      sys.exit(EXIT_USAGE)

  app.run(guarded, argv=argv, flags_parser=parse)


def run_with_command(main: Callable[[list[str]], int], command: list[str], name: str, flag_module: str) -> None:
  """`NAME [--flags] -- COMMAND ...` (the launchers): what follows `--` is appended to `command`; the
  flags before it are handled as for every other command."""
  argv = sys.argv
  if "--" in argv:
    cut = argv.index("--")
    command.extend(argv[cut + 1:])
    argv = argv[:cut]
  run(main, name, [flag_module], argv=argv)
