"""The set-up before JAX starts (8 virtual CPU devices, no compilation cache), the fixtures the test files share,
and a check of the test groups' markers. The helpers test files import live in tests/support.py."""

from __future__ import annotations

import os

# Must happen before JAX's backend starts: every in-process test sees 8 CPU devices.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The CLI's --compilation_cache=auto is off in the suite: every test's sweep compiles what it checks, nothing lands
# in ~/.cache, and no test depends on another's entries. The cache's own tests name their folders.
os.environ.setdefault("MICROBENCH_COMPILATION_CACHE", "none")

import pytest  # noqa: E402

import support  # noqa: E402


# ------------------------------------------------------------------------------------------- test groups
# README's `python -m pytest -q tests` runs the fast suite: every layer, in minutes on two cores. The rest carries
# markers on the tests themselves (pyproject.toml declares them, with --strict-markers, and deselects slow and
# cluster by default; `.ci/run` runs them all):
#   cluster      needs root and Debian's slurm-wlm / munge / Open MPI: the emulated cluster, SLURM, mpirun.
#   gpu_compile  needs the gpu-compile extra (XLA:GPU through JAX's CUDA plugin); always slow too.
#   tpu_compile  needs the tpu-compile extra (XLA:TPU through libtpu); always slow too.
#   long         a minute or more on two cores (also slow): collected first, so parallel workers finish together.
#   slow         end-to-end runs, multi-process launches, exhaustive property tests, GPU-target compiles: a test
#                function that takes 4 s or more (all its parameters together) on a 2-core machine, but for one
#                end-to-end test per command (sweep, training, launcher) and the bad-input lines, which stay in
#                the fast suite.
# A marker a test lacks would move it into the fast suite, so collection checks what it can tell from the test
# itself: a test set up by a cluster probe's fixture is `cluster`, one on the GPU target's mesh `gpu_compile`, and
# gpu_compile and tpu_compile tests are `slow`.
_IMPLIED = {"needs_netns": "cluster", "needs_slurm": "cluster", "gpu_mesh": "gpu_compile"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every collected test is checked
def pytest_collection_modifyitems(config, items):
  del config
  bad = []
  for item in items:
    marks = {m.name for m in item.iter_markers()}
    bad += [f"{item.nodeid}: uses {fixture} but is not marked {mark}" for fixture, mark in _IMPLIED.items()
            if fixture in getattr(item, "fixturenames", ()) and mark not in marks]
    if marks & {"gpu_compile", "tpu_compile"} and "slow" not in marks:
      bad.append(f"{item.nodeid}: marked {' and '.join(sorted(marks & {'gpu_compile', 'tpu_compile'}))} but not slow")
  if bad:
    raise pytest.UsageError("test groups: a marker is missing\n  " + "\n  ".join(bad))
  # `long` tests (a minute or more on two cores) first: pytest-xdist's workers then end on short tests and finish
  # together, instead of one running a three-minute test while the other waits (a stable sort: the rest keep
  # their order).
  items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_report_header(config):
  expr = config.getoption("markexpr")
  if expr == "not slow and not cluster":
    return ("fast suite: tests marked slow or cluster are deselected; -m 'slow or cluster' runs them,"
            " -m '' runs everything")
  return None


def pytest_addoption(parser):
  parser.addoption("--update-golden", action="store_true", default=False,
                   help="rewrite tests/golden/*.json from this run instead of comparing with them")


@pytest.fixture(scope="session")
def update_golden(request) -> bool:
  """True when the golden files should be regenerated (`--update-golden` or MICROBENCH_UPDATE_GOLDEN=1)."""
  return bool(request.config.getoption("--update-golden") or os.environ.get("MICROBENCH_UPDATE_GOLDEN"))


@pytest.fixture(scope="session")
def parsed_flags():
  """absl flags parsed with defaults, for in-process calls into code that reads FLAGS."""
  from absl import flags
  import microbench.cli.bench  # noqa: F401  (defines the flags)
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["pytest"])
  return flags.FLAGS


@pytest.fixture(scope="session")
def needs_netns():
  """Skips, saying why, where the emulated cluster's network namespaces cannot be built. Session-scoped, so the
  skip comes before any module fixture that would build a testbed."""
  problem = support.netns_problem()
  if problem:
    pytest.skip(f"testbed cannot run: {problem}")


@pytest.fixture(scope="session")
def needs_slurm():
  """Skips, saying why, where a real SLURM cannot run on the emulated cluster (see needs_netns)."""
  problem = support.slurm_problem()
  if problem:
    pytest.skip(f"no SLURM on the emulated cluster: {problem}")
