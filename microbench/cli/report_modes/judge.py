"""`microbench-report RUN --against=NAME|previous|RUN --rules=FILE`: one run judged against a baseline, its
machine's previous run or another run, and against the operator's rules; exit 1 on a regression beyond noise
and --tolerance or on a failed rule. A node the doctor named gets its `scontrol update ... state=drain` line,
run only with --drain."""

from __future__ import annotations

import shlex
import subprocess

from absl import app

from microbench.cli.report_modes import common

FLAGS = common.FLAGS


def _named(store, run_id: str) -> dict[str, str]:
  import sqlalchemy as sa  # pylint: disable=import-outside-toplevel
  from microbench.store import schema  # pylint: disable=import-outside-toplevel
  with store.read() as conn:
    rows = conn.execute(sa.select(schema.node_results.c.node, schema.node_results.c.detail).where(
        schema.node_results.c.run_id == run_id, schema.node_results.c.verdict == "named")).all()
  return dict(rows)


def _load_rules() -> list:
  """--rules read and checked before anything else is (a bad file is one line, FILE:LINE)."""
  from microbench.store import rules  # pylint: disable=import-outside-toplevel
  try:
    return rules.load(FLAGS.rules)
  except rules.RulesError as e:
    raise app.UsageError(str(e)) from None


def _rules(store, run_id: str, rule_list: list) -> tuple[int, dict[str, int]]:
  from microbench.store import rules  # pylint: disable=import-outside-toplevel
  failed, results = 0, {}
  for o in rules.judge(store, run_id, rule_list):
    print(f"rule {o.verdict:<4} {o.rule.name}: {o.detail}" if o.verdict != rules.NONE else
          f"rule ---- {o.rule.name}: {o.verdict} ({o.detail})")
    if o.verdict != rules.NONE:
      results[o.rule.name] = int(o.verdict == rules.PASS)
    failed += o.verdict == rules.FAIL
  print(f"rules: {len(rule_list) - failed} of {len(rule_list)} did not fail" + (f", {failed} FAILED" if failed else ""))
  return (1 if failed else 0), results


def main(paths: list[str]) -> int:
  if len(paths) != 1:
    raise app.UsageError("--against and --rules judge one run: microbench-report RUN --against=NAME|previous|RUN"
                         " [--rules=FILE]")
  rule_list = _load_rules() if FLAGS.rules else None
  from microbench.store import compare, folders, queries  # pylint: disable=import-outside-toplevel
  store = common.open_store(common.beside(paths))
  status, results = 0, {}
  try:
    run_id = queries.resolve_run(store, paths[0])
    if FLAGS.against:
      c = compare.compare(store, run_id, FLAGS.against, FLAGS.tolerance)
      print("\n".join(compare.lines(c)))
      status = c.exit_status
  except (folders.FolderError, queries.NotFound) as e:
    raise app.UsageError(str(e)) from None
  if rule_list is not None:
    rule_status, results = _rules(store, run_id, rule_list)
    status = max(status, rule_status)
  for cmd in common.drain_commands(_named(store, run_id)):
    print(("draining: " if FLAGS.drain else "drain (run with --drain): ") + shlex.join(cmd))
    if FLAGS.drain:
      r = subprocess.run(cmd, capture_output=True, text=True, check=False)
      if r.returncode:
        print(f"microbench-report: {cmd[0]} exited {r.returncode}: {(r.stderr or r.stdout).strip()[:300]}")
        status = max(status, 1)
  if FLAGS.prometheus:
    from microbench.cli.report_modes import fleet  # pylint: disable=import-outside-toplevel
    fleet.write_prometheus(store, results)
  return status
