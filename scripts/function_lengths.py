"""Function lengths (not a test): the longest functions in microbench/, models/ and meshes/, and how many run
past a threshold, so that long ones can be found and split into named steps that fit on a screen.

A function's length is its lines from `def` (decorators included) to its last line; a nested function counts
towards the function holding it and is also listed on its own.

  python scripts/function_lengths.py --over=60 --top=20
"""

from __future__ import annotations

import ast
import pathlib

from absl import flags

from microbench.cli import absl_app

flags.DEFINE_integer("over", 60, "Count the functions longer than this many lines.")
flags.DEFINE_integer("top", 20, "List this many of the longest functions.")
flags.DEFINE_list("roots", ["microbench", "models", "meshes"], "Folders to walk, relative to the repository.")
FLAGS = flags.FLAGS

REPO = pathlib.Path(__file__).resolve().parent.parent


def function_lengths(roots: list[str]) -> list[tuple[int, str, str, int]]:
  """(lines, qualified name, path, first line) of every function under `roots`, longest first."""
  found = []
  for root in roots:
    for path in sorted((REPO / root).rglob("*.py")):
      tree = ast.parse(path.read_text(), filename=str(path))
      rel = str(path.relative_to(REPO))
      found.extend((n, name, rel, line) for name, line, n in _walk(tree, ""))
  return sorted(found, key=lambda f: (-f[0], f[2], f[3]))


def _walk(node: ast.AST, prefix: str) -> list[tuple[str, int, int]]:
  """(qualified name, first line, lines) of the functions in `node`, nested ones named `outer.inner`."""
  out = []
  for child in ast.iter_child_nodes(node):
    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      name = f"{prefix}{child.name}"
      if not isinstance(child, ast.ClassDef):
        first = min([child.lineno] + [d.lineno for d in child.decorator_list])
        out.append((name, first, child.end_lineno - first + 1))
      out.extend(_walk(child, name + "."))
    else:
      out.extend(_walk(child, prefix))
  return out


def main(argv: list[str]) -> None:
  del argv
  found = function_lengths(FLAGS.roots)
  width = max((len(name) for _, name, _, _ in found[:FLAGS.top]), default=0)
  for n, name, path, line in found[:FLAGS.top]:
    print(f"{n:5d}  {name:<{width}}  {path}:{line}")
  over = sum(1 for f in found if f[0] > FLAGS.over)
  print(f"{over} of {len(found)} functions over {FLAGS.over} lines")


if __name__ == "__main__":
  absl_app.run(main, "function_lengths.py", [__name__])
