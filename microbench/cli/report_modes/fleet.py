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


def _one_node(rows: list[dict]) -> int:
  """--fleet --node=NAME (a SLURM health check): exit 1 when the latest doctor run named the node, with its
  drain line (run with --drain)."""
  import shlex  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  row = next((r for r in rows if r["node"] == FLAGS.node), None)
  if row is None:
    print(f"microbench-report: node {FLAGS.node}: no doctor run in the store has examined it")
    return 0
  if row["last_verdict"] != "named":
    print(f"microbench-report: node {FLAGS.node}: {row['last_verdict']} at its latest doctor run"
          f" (last healthy {row['last_healthy'] or 'never'})")
    return 0
  print(f"microbench-report: node {FLAGS.node}: NAMED by its latest doctor run ({row['last_named']}):"
        f" {row['last_detail']}")
  for cmd in common.drain_commands({FLAGS.node: row["last_detail"]}):
    print(("draining: " if FLAGS.drain else "drain (run with --drain): ") + shlex.join(cmd))
    if FLAGS.drain:
      subprocess.run(cmd, check=False)
  return 1


def main(paths: list[str]) -> int:
  from microbench.store import fleet  # pylint: disable=import-outside-toplevel
  store = common.open_store(common.beside(paths))
  status = 0
  if FLAGS.fleet:
    with store.read() as conn:
      rows = fleet.nodes(conn, FLAGS.since)
    if FLAGS.node:
      status = _one_node(rows)
    else:
      print(fleet.table(rows) if rows else "microbench-report: no doctor run in the store yet", end="" if rows else "\n")
  if FLAGS.prometheus:
    write_prometheus(store)
  return status
