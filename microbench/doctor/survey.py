"""The doctor's loop: survey rounds, then confirmation rounds on the suspects, then the verdict.

The same loop drives a real job (`measure` runs a round's programs on the allocation and returns every test's
time, the same on every process, so every process takes the same next step) and a simulation (`simulate`),
so the schedule and the diagnosis that a test proves on a simulated 512-node fleet are the ones that run.
A round runs one program per (kind, rail): all its pairs at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from microbench.doctor import diagnose, pair_rounds
from microbench.doctor.fleet import Fleet, Test

CONFIRM_ROUNDS = 3  # enough to clear a rack's nodes, then confirm its uplink, with one round to spare
SIZES = {"p2p": 1 << 20, "all_reduce": 4096, "scale_up": 1 << 20}  # bytes per rank

# Tests that run at once (one kind, one rail) -> seconds; p2p programs also yield a `loss` test per pair (the
# share of its TCP segments resent), which is judged like any other kind.
Measure = Callable[[Sequence[Test]], dict[Test, float]]
PROGRAM = {"loss": "p2p"}  # a derived kind and the program whose run yields it


class SettingsError(ValueError):
  """A request the doctor refuses; its text is the command line's one-line error."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the doctor runs; `check` refuses what it cannot (the command line and Python callers alike).
  A p2p size of 0 means auto: chosen once the fabric is known (fleet.auto_p2p_bytes)."""
  threshold: float = diagnose.THRESHOLD
  survey_rounds: int = pair_rounds.SURVEY_ROUNDS
  confirm_rounds: int = CONFIRM_ROUNDS
  kinds: tuple[str, ...] = ("p2p", "all_reduce")  # the pair tests of every round
  scale_up: bool = True  # a node-local all-reduce over each node's devices (skipped on one device per node)
  sizes: tuple[tuple[str, int], ...] = tuple(SIZES.items())


@dataclasses.dataclass
class Outcome:
  results: list[diagnose.Result]
  verdict: diagnose.Verdict
  survey_rounds: int
  confirm_rounds: int
  scales: dict[str, diagnose.Scale]
  seconds: float
  notes: list[str]

  @property
  def rounds(self) -> int:
    return self.survey_rounds + self.confirm_rounds


def survey_tests(fleet: Fleet, settings: Settings) -> list[list[Test]]:
  """The survey's tests, round by round: every kind on every rail for each pair of the round; the scale-up
  test of every node in round 0."""
  rounds = []
  for r, pairs in enumerate(pair_rounds.survey(fleet.racks, settings.survey_rounds)):
    tests = [Test(kind, a, b, rail, r) for rail in range(fleet.rails) for kind in settings.kinds
             for a, b in pairs]
    if r == 0 and settings.scale_up:
      tests += [Test("scale_up", i, -1, 0, 0) for i in range(fleet.nodes)]
    rounds.append(tests)
  return rounds


def groups(tests: Sequence[Test]) -> list[list[Test]]:
  """A round's tests as the programs that run them: one per (kind, rail), in a fixed order."""
  out: dict[tuple[str, int], list[Test]] = {}
  for t in tests:
    out.setdefault((t.kind, t.rail), []).append(t)
  return [out[k] for k in sorted(out)]


def check(settings: Settings) -> Settings:
  """`settings`, or SettingsError naming what is wrong and what is allowed."""
  bad = [f"--{k}_bytes" for k, v in settings.sizes if v < 4 and not (k == "p2p" and v == 0)]
  if bad:
    raise SettingsError(f"{', '.join(bad)} must be at least 4 bytes (one float32)")
  if not settings.threshold > 1:
    raise SettingsError(f"--threshold={settings.threshold} must be > 1 (a test this many times its reference is "
                        "slow)")
  if settings.survey_rounds < 1 or settings.confirm_rounds < 0:
    raise SettingsError(f"--survey_rounds={settings.survey_rounds} must be >= 1 and --confirm_rounds="
                        f"{settings.confirm_rounds} >= 0")
  return settings


def run(fleet: Fleet, measure: Measure, settings: Settings = Settings(),
        say: Callable[[str], None] = lambda s: None) -> Outcome:
  """Survey, confirm, judge. `measure` must return a time for every test it is given."""
  check(settings)
  start = time.monotonic()
  sizes = dict(settings.sizes)
  notes = []
  raw: list[tuple[Test, float, float | None]] = []
  tested: dict[Test, tuple[str, ...]] = {}
  survey = survey_tests(fleet, settings)

  def run_round(tests: Sequence[Test]) -> list[tuple[Test, float, float | None]]:
    out = []
    programs = [dataclasses.replace(t, kind=PROGRAM.get(t.kind, t.kind)) for t in tests]
    for group in groups(list(dict.fromkeys(programs))):
      values = measure(group)
      expected = fleet.expected(list(values), sizes)
      out += [(t, v, expected[t].seconds) for t, v in values.items()]
      tested.update((t, expected[t].tested) for t in values)
    return out

  for r, tests in enumerate(survey):
    raw += run_round(tests)
    pairs = len({(t.a, t.b) for t in tests if t.b >= 0})
    say(f"survey round {r + 1}/{len(survey)}: {pairs} pair(s) at once")
  if not raw:
    notes.append("fewer than two nodes: nothing to pair")
  elif fleet.nodes == 2:
    notes.append("two nodes: one pair, the fleet's own reference; a slow link shows only against the fabric"
                 " model (a note), and no test can tell h0's from h1's")
  scales = diagnose.fleet_scales(raw)
  results = [diagnose.judge(t, m, e, scales[t.kind], settings.threshold, tested[t])
             for t, m, e in raw]
  confirm = 0
  while confirm < settings.confirm_rounds:
    tests = diagnose.confirmation_tests(fleet, results, len(survey) + confirm)
    if not tests:
      break
    confirm += 1
    say(f"confirmation round {confirm}: {len(tests)} test(s) on suspects")
    results += [diagnose.judge(t, m, e, scales[t.kind], settings.threshold, tested[t])
                for t, m, e in run_round(tests)]
  return Outcome(results, diagnose.verdict(fleet, results), len(survey), confirm, scales,
                 time.monotonic() - start, notes)
