"""`microbench-study MODE [--flags]`: the multi-tenancy interference study (the work is in microbench.study).

This module only dispatches. Each mode is a module of microbench.cli.study_modes that defines its own flags
and its main, and only the mode that runs is imported: `MODE --help` lists that mode's flags alone, a flag
name means one thing, and a mode that needs no JAX starts without it. A flag of another mode is refused in one
line naming the mode(s) it belongs to, found by reading the modes' sources (importing them all would define
every mode's flags at once, and two modes may define one name with different defaults).
"""

from __future__ import annotations

import ast
import functools
import importlib
import logging
import os
import sys
from collections.abc import Callable

from absl import app

from microbench.cli import absl_app

NAME = "microbench-study"
MODES = ("plan", "predict", "place", "run", "report", "proxy", "schedule", "gpcnet")
PACKAGE = "microbench.cli.study_modes"
# Where a mode's flags may come from besides its own module: absl's --help lists the key flags of these.
SHARED_FLAG_MODULES = (f"{PACKAGE}.common", "microbench.cli.cluster_flags", "microbench.cli.store_flags")
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _source(name: str) -> ast.Module:
  path = os.path.join(_HERE, *name.split(".")[2:]) + ".py"  # microbench.cli.X.Y -> X/Y.py beside this file
  with open(path, encoding="utf-8") as f:
    return ast.parse(f.read(), path)


def _defined(tree: ast.AST) -> dict[str, bool]:
  """The flags `flags.DEFINE_*("name", ...)` calls in `tree` define: name -> whether it is a boolean."""
  return {n.args[0].value: "bool" in n.func.attr for n in ast.walk(tree)
          if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.startswith("DEFINE")
          and n.args and isinstance(n.args[0], ast.Constant)}


@functools.cache
def owners() -> dict[str, tuple[str, ...]]:
  """Flag name -> the modes that define it: their own DEFINEs, the `common.define_*` groups they call, and the
  cluster (store) flags where they import cluster_flags (store_flags)."""
  groups = {f.name: _defined(f) for f in _source(SHARED_FLAG_MODULES[0]).body if isinstance(f, ast.FunctionDef)}
  cluster = _defined(_source(SHARED_FLAG_MODULES[1]))
  store = _defined(_source(SHARED_FLAG_MODULES[2]))
  out: dict[str, list[str]] = {}
  for mode in MODES:
    tree = _source(f"{PACKAGE}.{mode}")
    names = dict(_defined(tree))
    for n in ast.walk(tree):
      if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
          and n.func.value.id == "common":
        names.update(groups.get(n.func.attr, {}))
      elif isinstance(n, ast.ImportFrom) and any(a.name == "cluster_flags" for a in n.names):
        names.update(cluster)
      if isinstance(n, ast.ImportFrom) and any(a.name == "store_flags" for a in n.names):
        names.update(store)
    for name in names:
      out.setdefault(name, []).append(mode)
  return {name: tuple(modes) for name, modes in out.items()}


@functools.cache
def _booleans() -> frozenset[str]:
  trees = [_source(f"{PACKAGE}.{m}") for m in MODES] + [_source(n) for n in SHARED_FLAG_MODULES]
  return frozenset(name for t in trees for name, boolean in _defined(t).items() if boolean)


def refusal(mode: str, name: str) -> str | None:
  """The line refusing --`name`, which `mode` does not define: a spelling the mode renamed, or a flag of other
  modes; None for a flag no mode has (absl's own line says so)."""
  renamed = getattr(sys.modules.get(f"{PACKAGE}.{mode}"), "RENAMED", {})
  known = owners()
  if name in renamed:
    elsewhere = ", ".join(known.get(name, ()))
    return (f"--{name} is --{renamed[name]} in `{mode}`" + (f" (--{name} is a flag of {elsewhere})" if elsewhere
                                                                else ""))
  flag = name if name in known else name[2:] if name.startswith("no") and name[2:] in _booleans() else None
  if flag is None:
    return None
  return f"--{name} is a flag of {', '.join(f'`{m}`' for m in known[flag])}, not of `{mode}`"


def usage() -> str:
  """The modes, one line each (the first line of each mode's docstring)."""
  lines = [f"{NAME} MODE [--flags]: the multi-tenancy interference study; `{NAME} MODE --help` lists a mode's"
           " flags.", "", "modes:"]
  for mode in MODES:
    doc = ast.get_docstring(_source(f"{PACKAGE}.{mode}")) or ""
    lines.append(f"  {mode:9s} {doc.splitlines()[0] if doc else ''}")
  return "\n".join(lines)


def _fail(message: str) -> None:
  print(f"{NAME}: error: {message}", file=sys.stderr, flush=True)
  sys.exit(absl_app.EXIT_USAGE)


def _main(module, mode: str) -> Callable[[list[str]], int]:
  def main(argv: list[str]) -> int:
    if argv[1:]:
      raise app.UsageError(f"want one mode of {', '.join(MODES)} (got {[mode, *argv[1:]]}); see --help")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    return module.main(argv)
  return main


def run(argv: list[str] | None = None) -> None:
  """Console-script entry point: the mode (the first argument that is not a flag) is imported and run."""
  argv = list(sys.argv if argv is None else argv)
  mode = next((a for a in argv[1:] if not a.startswith("-")), None)
  if mode is None and any(a in HELP_FLAGS for a in argv[1:]):
    print(usage())
    sys.exit(0)
  if mode not in MODES:
    _fail(f"want one mode of {', '.join(MODES)} (got {argv[1:] or 'none'}); see --help")
  module = importlib.import_module(f"{PACKAGE}.{mode}")
  sys.modules["__main__"].__doc__ = f"{NAME} {mode}: {module.__doc__}"  # what absl's --help prints first
  rest = argv[:argv.index(mode, 1)] + argv[argv.index(mode, 1) + 1:]
  absl_app.run(_main(module, mode), NAME, [module.__name__, *SHARED_FLAG_MODULES], argv=rest,
               unknown_flag=functools.partial(refusal, mode))


if __name__ == "__main__":
  run()
