"""`microbench-report --fleet` (per node: doctor runs, times named, last named, last healthy) and
`--prometheus=FILE` (the latest figures and verdicts for node_exporter's textfile collector)."""

from __future__ import annotations

from microbench.cli.report_modes import common

FLAGS = common.FLAGS


def write_prometheus(store, rule_results: dict[str, int] | None = None) -> None:
  from microbench.store import fleet  # pylint: disable=import-outside-toplevel
  with store.read() as conn:
    text = fleet.exposition(conn, FLAGS.node, rule_results)
  fleet.write_textfile(FLAGS.prometheus, text)
  print(f"microbench-report: wrote {text.count(chr(10)) - text.count('# ')} sample(s) to {FLAGS.prometheus}")


def main(paths: list[str]) -> int:
  from microbench.store import fleet  # pylint: disable=import-outside-toplevel
  store = common.open_store(common.beside(paths))
  if FLAGS.fleet:
    with store.read() as conn:
      rows = fleet.nodes(conn, FLAGS.since)
    print(fleet.table(rows) if rows else "microbench-report: no doctor run in the store yet", end="" if rows else "\n")
  if FLAGS.prometheus:
    write_prometheus(store)
  return 0
