"""The folder tree is the architecture: each package imports only from the layers below it, with no cycles.

Layers, bottom to top: `microbench.fabric` (what a machine is and what a collective costs: GPU kinds, links,
rates, machine descriptions, collective cost formulas; JAX-free); `meshes/` (topologies, meshes, scopes,
strategies as rules) and `models/` (Flax models, on meshes only), folders at the top of the repository that
install as `microbench.meshes` and `microbench.models`; `microbench.aot` (compile-only devices);
`microbench.hlo`, `.output`, `.cluster` (reading programs, writing results, running on hosts);
`microbench.report` (reading finished runs: fits, tables, plots); `microbench.bench`, `.train` (the two
measurements, independent of each other); `microbench.study` (built on both); `microbench.cli` (the
commands) on top.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("meshes", "models", "microbench")

LAYER = {
    "microbench.fabric": 0,  # what a machine is and what a collective costs, as data and formulas: JAX-free
    "microbench.meshes": 1,
    "microbench.models": 2,
    "microbench.aot": 3,  # compile-only devices of a GPU kind (the kinds themselves are fabric's)
    "microbench.hlo": 4, "microbench.output": 4, "microbench.cluster": 4,
    "microbench.report": 5,  # reads run folders; below the measurements so a run can leave its fit and figures
    "microbench.bench": 6, "microbench.train": 6,
    "microbench.store": 6,  # the results store: run folders (output, report) indexed; commands record into it
    "microbench.tuning": 6,  # what XLA and NCCL read (performance table, SoL options, tuner file), from runs
    "microbench.study": 7, "microbench.doctor": 7,
    "microbench.cli": 8, "microbench": 8,  # microbench/__init__ and __main__ (python -m microbench)
}


def _unit(module: str) -> str:
  """The layer unit a module belongs to: its longest prefix in LAYER."""
  parts = module.split(".")
  for i in range(len(parts), 0, -1):
    name = ".".join(parts[:i])
    if name in LAYER:
      return name
  raise AssertionError(f"{module} is in no layer; add its package to tests/test_layout.py's LAYER")


def _modules(root: str = ROOT) -> dict[str, str]:
  out = {}
  for pkg in PACKAGES:
    for dirpath, _, files in os.walk(os.path.join(root, pkg)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
          name = rel.removesuffix(".__init__")
          out[name if pkg == "microbench" else f"microbench.{name}"] = os.path.join(dirpath, f)
  return out


def _imports(path: str, module: str, known: set[str]) -> set[str]:
  """Project modules imported anywhere in the file (also inside functions)."""
  tree = ast.parse(open(path, encoding="utf-8").read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      # `from pkg import sub` imports pkg.sub (a module) or a name defined in pkg.
      names = [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    for name in names:
      if name.split(".")[0] == "microbench":
        while name not in known and "." in name:  # `from pkg import function` -> pkg
          name = name.rsplit(".", 1)[0]
        if name in known and name != module:
          found.add(name)
  return found


def _graph(root: str = ROOT) -> dict[str, set[str]]:
  mods = _modules(root)
  return {m: _imports(p, m, set(mods)) for m, p in mods.items()}


def test_every_module_is_in_a_layer():
  for m in _modules():
    _unit(m)


def test_no_module_imports_from_a_layer_above_or_a_sibling_concern(root: str = ROOT):
  bad = []
  for m, deps in _graph(root).items():
    u = _unit(m)
    for d in deps:
      v = _unit(d)
      if v != u and LAYER[v] >= LAYER[u] and not (u == "microbench" and v.startswith("microbench.cli")):
        bad.append(f"{m} ({u}, layer {LAYER[u]}) imports {d} ({v}, layer {LAYER[v]})")
  assert not bad, "\n".join(bad)


def test_models_depend_only_on_meshes():
  for m, deps in _graph().items():
    if m.startswith("microbench.models"):
      assert all(d.startswith(("microbench.models", "microbench.meshes")) for d in deps), (m, deps)


def test_fabric_is_jax_free(root: str = ROOT):
  """The machine's facts need no JAX (a scheduler prolog, a report on a laptop): fabric's modules import only
  the standard library and each other, anywhere in the file."""
  bad = []
  for m, path in _modules(root).items():
    if not m.startswith("microbench.fabric"):
      continue
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
      for name in names:
        top = name.split(".")[0]
        if name.startswith("microbench.fabric") or top == "__future__" or top in sys.stdlib_module_names:
          continue
        bad.append(f"{m} imports {name}")
  assert not bad, "\n".join(bad)


def test_no_import_cycles():
  graph = _graph()
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(m: str) -> None:
    state[m] = 1
    stack.append(m)
    for d in sorted(graph[m]):
      if d.startswith(m + "."):  # a package importing its own submodules (re-exports) is not a cycle
        continue
      if state.get(d) == 1:
        cycle = stack[stack.index(d):] + [d]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if d not in state:
        visit(d)
    stack.pop()
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m)


def _copy_of_the_tree(tmp_path) -> str:
  """The packages' sources copied aside, so a planted file never shows in the tree other tests read at once."""
  for pkg in PACKAGES:
    shutil.copytree(os.path.join(ROOT, pkg), tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.toml"))
  return str(tmp_path)


def test_checks_catch_a_planted_violation(tmp_path):
  """The layer check is proven by the bug it catches: a cluster module importing the CLI fails it."""
  root = _copy_of_the_tree(tmp_path)
  test_no_module_imports_from_a_layer_above_or_a_sibling_concern(root)  # the copy passes as the tree does
  with open(os.path.join(root, "microbench", "cluster", "_planted_violation.py"), "w", encoding="utf-8") as f:
    f.write("from microbench.cli import absl_app  # planted by tests/test_layout.py\n")
  with pytest.raises(AssertionError, match="_planted_violation"):
    test_no_module_imports_from_a_layer_above_or_a_sibling_concern(root)


def test_no_sys_path_hacks_outside_tests():
  r = subprocess.run(["grep", "-rln", "sys.path.insert", "--include=*.py", "microbench", "meshes", "models",
                      "scripts"], cwd=ROOT, capture_output=True, text=True, check=False)
  assert r.stdout == "", r.stdout


@pytest.mark.slow
def test_console_scripts_start_from_the_install():
  """Every console script in pyproject.toml resolves, and (where installed, as in CI) answers --help."""
  import sys
  import tomllib

  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    scripts = tomllib.load(f)["project"]["scripts"]
  assert set(scripts) == {"microbench", "microbench-train", "microbench-launch", "microbench-testbed",
                          "microbench-report", "microbench-study", "microbench-doctor"}
  for name, target in scripts.items():
    module, func = target.split(":")
    exe = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(exe):  # the installed script imports its function itself: --help proves both
      assert f"from {module} import {func}" in open(exe, encoding="utf-8").read(), f"{exe}: not {target} (reinstall)"
      r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120, check=False)
      assert r.returncode in (0, 1) and "Traceback" not in r.stderr, (name, r.stderr[-500:])
      assert "--" in r.stdout, name  # absl lists the command's own flags
    else:  # each command defines its own flags, so each is imported in its own process
      code = f"import {module} as m; assert callable(m.{func})"
      subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_jax_free_check_catches_a_planted_import(tmp_path):
  root = _copy_of_the_tree(tmp_path)
  test_fabric_is_jax_free(root)
  with open(os.path.join(root, "microbench", "fabric", "_planted_jax.py"), "w", encoding="utf-8") as f:
    f.write("def f():\n  import jax.numpy  # planted by tests/test_layout.py\n")
  with pytest.raises(AssertionError, match="_planted_jax imports jax.numpy"):
    test_fabric_is_jax_free(root)


def _quickstart_commands() -> list[str]:
  """The shell lines of README's Quickstart code block(s)."""
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  section = text.split("\n## Quickstart", 1)[1].split("\n## ", 1)[0]
  blocks = section.split("```")[1::2]
  return [line.strip() for b in blocks for line in b.splitlines()[1:] if line.strip() and not line.startswith("#")]


CI_VENV = ".ci-venv/bin/python -m pip install"  # CI's second venv, for the extras README leaves out


def _quickstart_problems(ci: list[str], commands: list[str]) -> list[str]:
  """Why CI's lines would not run README's Quickstart literally in a venv holding README's extras only."""
  missing = [c for c in commands if c not in ci]
  if missing:
    return [f"not a line of CI: {c}" for c in missing]
  positions = [ci.index(c) for c in commands]  # each a line of its own, verbatim
  problems = [] if positions == sorted(positions) else ["the Quickstart's lines are out of order"]
  return problems + [f"line {i + 1} installs into the Quickstart's venv before its last command: {line}"
                     for i, line in enumerate(ci) if "pip install" in line and line not in commands
                     and CI_VENV not in line and i < max(positions)]


def test_ci_runs_readmes_quickstart_literally():
  """CI runs the Quickstart exactly as a new user types it (fresh venv, README's extras): a README command that
  fails on a fresh machine fails CI. The other extras go into a venv of CI's own (installed beside the
  Quickstart), or into the Quickstart's after its last command."""
  ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()
  commands = _quickstart_commands()
  assert commands and "python -m pytest -q -n auto tests" in commands
  assert not _quickstart_problems(ci, commands)
  assert any(CI_VENV in line for line in ci) and not any(CI_VENV in c for c in commands)
  # Planted: an extra installed into the Quickstart's venv before its fast suite; its lines swapped; one missing.
  early = [*ci[:ci.index(commands[-1])], "pip install -q -e '.[gpu-compile]'", *ci[ci.index(commands[-1]):]]
  assert any("installs into the Quickstart's venv" in p for p in _quickstart_problems(early, commands))
  swapped = [commands[-1] if line == commands[0] else commands[0] if line == commands[-1] else line for line in ci]
  assert _quickstart_problems(swapped, commands) == ["the Quickstart's lines are out of order"]
  assert _quickstart_problems([line for line in ci if line != commands[0]], commands)


def test_no_file_refers_outside_the_project():
  """Users get the repository, nothing beside it: no text names a reference file they cannot read."""
  bad = []
  out = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
  for rel in out:
    if rel.endswith((".png", ".json")) or rel == "tests/test_layout.py":
      continue
    text = open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace").read()
    for needle in ("../shared", "reference/methodology", "reference/collectives", "reference/hardware",
                   "reference/gpu-aot", "reference/tpu-aot", "reference/jax-notes", "reference/style"):
      if needle in text:
        bad.append(f"{rel}: {needle}")
  assert not bad, "\n".join(bad)


def test_test_files_take_helpers_from_support_not_conftest():
  """conftest.py is pytest's (the set-up before JAX starts, fixtures, hooks); the helpers test files import live in
  tests/support.py, a plain module, so no test depends on how pytest loaded conftest."""
  bad = []
  for f in sorted(os.listdir(os.path.join(ROOT, "tests"))):
    if f.endswith(".py") and f != "conftest.py":
      for node in ast.walk(ast.parse(open(os.path.join(ROOT, "tests", f), encoding="utf-8").read())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
          names = [node.module or ""]
        bad += [f"tests/{f}:{node.lineno}" for n in names if n.split(".")[-1] == "conftest"]
  assert not bad, bad


def test_every_link_between_the_docs_resolves():
  """README and docs/ link each other by relative path: every such link names a file that exists (and, for
  `page.md#anchor`, a heading of that page), so the book has no dead ends."""
  import re  # pylint: disable=g-import-not-at-top

  def anchors(path: str) -> set[str]:
    heads = [line.lstrip("#").strip() for line in open(path, encoding="utf-8") if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}

  pages = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                           if f.endswith(".md")]
  bad = []
  for page in pages:
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if target.startswith(("http://", "https://", "#", "mailto:")):
        continue
      rel, _, anchor = target.partition("#")
      path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), rel))
      if not os.path.exists(path):
        bad.append(f"{page}: {target} (no such file)")
      elif anchor and path.endswith(".md") and anchor not in anchors(path):
        bad.append(f"{page}: {target} (no such heading)")
  assert not bad, "\n".join(bad)


def test_models_and_meshes_install_inside_the_package():
  """Nothing named `models` or `meshes` may be imported as a top-level package (any other project's folder of
  that name would shadow ours); pyproject's package list names every folder with an __init__.py."""
  bad = []
  for m, path in _modules().items():
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
      bad += [f"{m} imports {n}" for n in names if n.split(".")[0] in ("models", "meshes")]
  assert not bad, "\n".join(bad)
  import tomllib  # pylint: disable=import-outside-toplevel
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    tool = tomllib.load(f)["tool"]["setuptools"]
  packages = {m for m, p in _modules().items() if p.endswith("__init__.py")}
  assert set(tool["packages"]) == packages, set(tool["packages"]) ^ packages
  assert tool["package-dir"] == {"microbench.models": "models", "microbench.meshes": "meshes"}


@pytest.mark.slow
def test_the_wheel_holds_no_top_level_models_or_meshes(tmp_path):
  """`pip install .` puts models and meshes under microbench/: the built wheel's files say so, and in this
  environment (an editable install) `import models` fails outside the repository while microbench.models works."""
  import zipfile  # pylint: disable=import-outside-toplevel
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                  str(tmp_path), ROOT], check=True, timeout=300, capture_output=True)
  (wheel,) = tmp_path.glob("microbench-*.whl")
  tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
  names = set(zipfile.ZipFile(wheel).namelist())
  assert not tops & {"models", "meshes"}, tops
  assert {"microbench/models/transformer.py", "microbench/meshes/mesh.py", "microbench/aot/gpu_compile.py"} <= names
  code = ("import importlib.util as u; import microbench.models.transformer, microbench.meshes.mesh;"
          "assert u.find_spec('models') is None and u.find_spec('meshes') is None")
  subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=120)
