"""The results store: indexing (idempotent, concurrent, crash-safe, versioned), comparisons against a
baseline or the previous run (beyond noise and tolerance, with what changed), rules, history change points,
the fleet's views and the Prometheus textfile; each check shown to fail on the fault it exists for."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

sa = pytest.importorskip("sqlalchemy")  # the report extra: pip install -e '.[report]'

from microbench.store import compare, connect, fleet, folders, history, index, queries, rules, schema  # noqa: E402
from store_fixtures import make_sweep, variant  # noqa: E402
from support import ROOT, clean_env  # noqa: E402


def _stamp(day: int) -> str:
  return f"2026-11-{day:02d}T02:00:00+00:00"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> str:
  return make_sweep(str(tmp_path_factory.mktemp("sweep") / "real"))


@pytest.fixture
def store(tmp_path) -> connect.Store:
  return connect.open_store(connect.resolve(str(tmp_path / "s.db")))


def _report(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "microbench.cli.report", *args], capture_output=True, text=True,
                        timeout=120, env=clean_env(), cwd=cwd, check=False)


def _count(store: connect.Store, table: str) -> int:
  with store.read() as conn:
    return conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar()


# ----------------------------------------------------------------------------------------------------- indexing

def test_indexing_is_idempotent_and_a_bad_folder_is_one_line(sweep, store, tmp_path):
  a = variant(sweep, str(tmp_path / "runs" / "a"), stamp=_stamp(1))
  variant(sweep, str(tmp_path / "runs" / "b"), stamp=_stamp(2))
  os.makedirs(tmp_path / "runs" / "broken")
  open(tmp_path / "runs" / "broken" / "doctor.json", "w").write("{not json")
  first = index.index(store, [str(tmp_path / "runs")], say=lambda _: None)
  counts = [_count(store, t) for t in ("runs", "points", "machines")]
  again = index.index(store, [str(tmp_path / "runs"), a], say=lambda _: None)
  assert [_count(store, t) for t in ("runs", "points", "machines")] == counts
  assert len(first.runs) == 2 and counts[0] == 2 and counts[2] == 1
  assert {r for _, r in first.runs} <= {r for _, r in again.runs}
  assert len(first.errors) == 1 and "broken/doctor.json" in first.errors[0] and "\n" not in first.errors[0]
  r = _report(f"--store={tmp_path / 's.db'}", "--index", str(tmp_path / "runs"))
  assert r.returncode == 1 and "not indexed" in r.stdout and "indexed 2 run(s)" in r.stdout, r.stdout + r.stderr


def test_a_store_from_a_newer_version_is_refused_in_one_line(store, tmp_path):
  with store.write() as conn:
    conn.execute(schema.info.update().values(value=str(schema.VERSION + 1)))
  with pytest.raises(connect.StoreError, match="newer microbench") as e:
    connect.open_store(store.url)
  assert "\n" not in str(e.value)
  r = _report(f"--store={tmp_path / 's.db'}", "--fleet")
  assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "newer" in r.stderr


def test_a_version_1_store_is_migrated_and_keeps_its_runs(sweep, tmp_path):
  url = connect.resolve(str(tmp_path / "old.db"))
  old = connect.Store(url, connect._engine(url))  # pylint: disable=protected-access
  with old.write() as conn:
    schema.upgrade(conn, url, to=1)
  with old.read() as conn:
    assert schema.version(conn) == 1 and not sa.inspect(conn).has_table("node_results")
  entry = folders.read(variant(sweep, str(tmp_path / "a"), stamp=_stamp(1)))
  entry.nodes = {}
  with old.write() as conn:  # what version 1's code wrote: the run and its points
    conn.execute(schema.machines.insert().values(machine_id=entry.machine_id, name="m", identity="{}", first_seen="x"))
    conn.execute(schema.runs.insert().values(run_id=entry.run_id, machine_id=entry.machine_id, kind="sweep", name="a",
                                             path="a", fingerprint="{}", finished_at=_stamp(1), status="finished",
                                             indexed_at=_stamp(1)))
  new = connect.open_store(url)
  with new.read() as conn:
    assert schema.version(conn) == schema.VERSION and sa.inspect(conn).has_table("node_results")
    assert queries.run_row(conn, entry.run_id)["name"] == "a"


def _index_one(url: str, path: str) -> None:
  index.write(connect.open_store(url), folders.read(path))


def test_jobs_finishing_at_once_lose_nothing(sweep, tmp_path):
  paths = [variant(sweep, str(tmp_path / f"r{i}"), seed=i, stamp=_stamp(i + 1)) for i in range(6)]
  url = connect.resolve(str(tmp_path / "shared.db"))
  ctx = multiprocessing.get_context("spawn")
  procs = [ctx.Process(target=_index_one, args=(url, p)) for p in paths]
  for p in procs:
    p.start()
  for p in procs:
    p.join(120)
  assert [p.exitcode for p in procs] == [0] * 6
  s = connect.open_store(url)
  assert _count(s, "runs") == 6 and _count(s, "points") == 6 * _count_points(paths[0])


def _count_points(path: str) -> int:
  return len(folders.read(path).points)


def test_a_writer_killed_mid_transaction_leaves_the_store_consistent(sweep, tmp_path):
  path = variant(sweep, str(tmp_path / "a"), stamp=_stamp(1))
  db = tmp_path / "k.db"
  code = ("import sys, time; sys.path.insert(0, sys.argv[3])\n"
          "from microbench.store import connect, folders, index, schema\n"
          "s = connect.open_store(connect.resolve(sys.argv[1]))\n"
          "orig = schema.points.insert\n"
          "def slow():\n  print('in transaction', flush=True); time.sleep(60); return orig()\n"
          "schema.points.insert = slow\n"
          "index.write(s, folders.read(sys.argv[2]))\n")
  proc = subprocess.Popen([sys.executable, "-c", code, str(db), path, ROOT], stdout=subprocess.PIPE, text=True,
                          env=clean_env())
  assert proc.stdout.readline().strip() == "in transaction"
  proc.send_signal(signal.SIGKILL)
  proc.wait(30)
  assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
  s = connect.open_store(connect.resolve(str(db)))
  assert _count(s, "runs") == 0 and _count(s, "points") == 0  # the half-written run is not there
  index.write(s, folders.read(path))
  assert _count(s, "runs") == 1 and _count(s, "points") == _count_points(path)


# ---------------------------------------------------------------------------------------------------- comparing

@pytest.fixture
def history_store(sweep, store, tmp_path):
  """Three accepted nights as baseline, then a night like them, one 30% slower, one faster, one with NCCL_ALGO."""
  base = [variant(sweep, str(tmp_path / f"base{i}"), seed=i, stamp=_stamp(i + 1)) for i in range(3)]
  ids = [index.write(store, folders.read(p)) for p in base]
  queries.set_baseline(store, "accepted", ids)
  same = index.write(store, folders.read(variant(sweep, str(tmp_path / "same"), seed=10, stamp=_stamp(5))))
  slow = index.write(store, folders.read(variant(sweep, str(tmp_path / "slow"), seed=11, slower=1.3,
                                                 stamp=_stamp(6), env={"NCCL_ALGO": "Ring"})))
  fast = index.write(store, folders.read(variant(sweep, str(tmp_path / "fast"), seed=12, slower=0.7, stamp=_stamp(7))))
  return {"same": same, "slow": slow, "fast": fast, "base": ids}


def test_the_same_machine_again_is_the_same_within_noise(store, history_store):
  c = compare.compare(store, history_store["same"], "accepted")
  assert c.exit_status == 0 and c.points and all(p["verdict"] == compare.SAME for p in c.points)
  assert "same within noise" in c.verdict() and c.machine_note is None


def test_a_slower_run_is_a_regression_with_what_changed(store, history_store):
  c = compare.compare(store, history_store["slow"], "accepted")
  assert c.exit_status == 1 and len(c.regressed) == len(c.points)
  assert any("NCCL_ALGO" in x and "'Ring'" in x for x in c.changes)
  text = "\n".join(compare.lines(c))
  assert text.splitlines()[-1].startswith("verdict: REGRESSED") and "REGRESSED all_reduce scale_up" in text


def test_tolerance_and_noise_each_keep_a_change_from_failing(store, history_store, sweep, tmp_path):
  # beyond noise but within a 40% tolerance: not a regression
  assert compare.compare(store, history_store["slow"], "accepted", tolerance=0.4).exit_status == 0
  # run against run (the samples' bootstrap): 15% slower but as noisy as 50% per sample is within noise; the
  # slower run with quiet samples is not
  noisy = index.write(store, folders.read(variant(sweep, str(tmp_path / "noisy"), seed=3, slower=1.15, noise=0.5,
                                                  samples=10, stamp=_stamp(8))))
  c = compare.compare(store, noisy, history_store["same"])
  assert c.exit_status == 0 and not c.regressed and c.points
  assert compare.compare(store, history_store["slow"], history_store["same"]).exit_status == 1


def test_faster_previous_and_another_machine(store, history_store, sweep, tmp_path):
  c = compare.compare(store, history_store["fast"], "accepted")
  assert c.exit_status == 0 and all(p["verdict"] == compare.IMPROVED for p in c.points)
  prev = compare.compare(store, history_store["fast"], "previous")
  assert prev.against_ids == [history_store["slow"]] and prev.exit_status == 0
  other = index.write(store, folders.read(variant(sweep, str(tmp_path / "other"), hosts=["n7", "n8"],
                                                  stamp=_stamp(9))))
  c = compare.compare(store, other, "accepted")
  assert c.machine_note and "different machines" in c.machine_note
  assert any(x.startswith("nodes") for x in c.changes)


def test_the_command_line_compares_and_exits_1_on_a_regression(store, history_store, tmp_path):
  r = _report(f"--store={tmp_path / 's.db'}", str(tmp_path / "slow"), "--against=accepted")
  assert r.returncode == 1 and r.stdout.strip().splitlines()[-1].startswith("verdict: REGRESSED"), r.stdout + r.stderr
  assert "changed: env.NCCL_ALGO: None -> 'Ring'" in r.stdout
  r = _report(f"--store={tmp_path / 's.db'}", str(tmp_path / "same"), "--against=nosuch")
  assert r.returncode == 2 and "nosuch" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------------------- rules

def _rules(tmp_path, text: str) -> str:
  path = tmp_path / "rules.toml"
  path.write_text(text)
  return str(path)


def test_rules_judge_beyond_noise(store, history_store, tmp_path):
  path = _rules(tmp_path, """
[[rule]]
name = "baseline"
metric = "vs_baseline"
baseline = "accepted"
value = 0.9

[[rule]]
name = "absolute"
metric = "busbw_gbps"
collective = "all_reduce"
min_bytes = "64K"
value = 0.1

[[rule]]
name = "mfu"
metric = "train/mfu"
value = 0.3
""")
  rl = rules.load(path)
  same = {o.rule.name: o.verdict for o in rules.judge(store, history_store["same"], rl)}
  slow = {o.rule.name: o.verdict for o in rules.judge(store, history_store["slow"], rl)}
  assert same == {"baseline": rules.PASS, "absolute": rules.PASS, "mfu": rules.NONE}
  assert slow["baseline"] == rules.FAIL
  # the absolute threshold set just above the measured busbw fails, just below passes: the rule reads the figure
  with store.read() as conn:
    recs = [r for r in queries.records(conn, history_store["same"]) if r["collective"] == "all_reduce"
            and r["bytes"] >= 65536]
  top = max(r["busbw_gbps"] for r in recs)
  above = rules.Rule("a", "busbw_gbps", ">=", top * 1.5, 1, collective="all_reduce", min_bytes=65536)
  below = rules.Rule("b", "busbw_gbps", ">=", min(r["busbw_gbps"] for r in recs) * 0.5, 1, collective="all_reduce",
                     min_bytes=65536)
  got = rules.judge(store, history_store["same"], [above, below])
  assert [o.verdict for o in got] == [rules.FAIL, rules.PASS]


@pytest.mark.parametrize("text,line,what", [
    ("[[rule]]\nmetric = \"vs_expected\"\nvalue = \n", 3, "not TOML"),
    ("[[rule]]\nmetric = \"vs_expected\"\nvalue = 0.7\n\n[[rule]]\nmetric = \"speed\"\nvalue = 1\n", 6, "metric"),
    ("[[rule]]\nmetric = \"busbw_gbps\"\nvalue = 1\nmin_bytes = \"lots\"\n", 4, "not a size"),
    ("[[rule]]\nmetric = \"busbw_gbps\"\nop = \"=>\"\nvalue = 1\n", 3, "op"),
    ("[[rule]]\nmetric = \"vs_baseline\"\nvalue = 0.9\n", 1, "names its baseline"),
    ("[[rule]]\nmetric = \"busbw_gbps\"\nvalu = 1\n", 3, "unknown key"),
])
def test_a_bad_rules_file_is_one_line_with_file_and_line(tmp_path, text, line, what):
  path = _rules(tmp_path, text)
  with pytest.raises(rules.RulesError) as e:
    rules.load(path)
  assert str(e.value).startswith(f"{path}:{line}: ") and what in str(e.value) and "\n" not in str(e.value)


def test_the_command_line_refuses_a_bad_rules_file_before_reading_runs(tmp_path):
  path = _rules(tmp_path, "[[rule]]\nmetric = \"speed\"\n")
  r = _report(f"--store={tmp_path / 's.db'}", str(tmp_path), f"--rules={path}")
  assert r.returncode == 2 and f"{path}:2:" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------------- history

def _points(values: list[float], width: float = 0.04) -> list[history.Point]:
  return [history.Point(f"r{i}", _stamp(i + 1), v, v * (1 - width), v * (1 + width), None) for i, v in enumerate(values)]


def test_change_points_find_the_night_the_link_slowed_and_nothing_in_noise():
  rng = np.random.default_rng(0)
  noise = np.exp(rng.normal(0, 0.01, 14))
  stepped = [(10.0 if i < 8 else 7.0) * n for i, n in enumerate(noise)]
  assert history.change_points(_points(stepped)) == [8]  # run 9
  assert history.change_points(_points([10.0 * n for n in noise])) == []
  # a step within tolerance is no change point; the same step with a tolerance below it is
  small = [(10.0 if i < 8 else 9.7) * n for i, n in enumerate(noise)]
  assert history.change_points(_points(small), tolerance=0.05) == []
  assert history.change_points(_points(small, width=0.002), tolerance=0.01) == [8]
  # a series as wide as its runs' own noise does not make a change point out of a wiggle
  assert history.change_points(_points([10.0 * n for n in np.exp(rng.normal(0, 0.05, 14))], width=0.2)) == []


def test_history_draws_and_names_the_change(sweep, store, tmp_path):
  for night in range(1, 9):
    index.write(store, folders.read(variant(sweep, str(tmp_path / f"n{night}"), seed=night, stamp=_stamp(night),
                                            slower=1.0 if night < 6 else 1.4)))
  r = _report(f"--store={tmp_path / 's.db'}", "--history", f"--out={tmp_path / 'h'}")
  assert r.returncode == 0, r.stderr
  changes = [l for l in r.stdout.splitlines() if l.startswith("CHANGE")]
  assert changes and all(" at run 6 " in l for l in changes), r.stdout
  assert os.path.getsize(tmp_path / "h" / "history.png") > 10_000
  assert os.listdir(tmp_path / "h" / "tensorboard")


# --------------------------------------------------------------------------------------------------------- fleet

def _doctor(tmp_path, name: str, stamp: str, named: list[str]) -> str:
  folder = tmp_path / name
  folder.mkdir()
  hosts = ["n0", "n1", "n2", "n3"]
  doc = {"status": 1 if named else 0, "nodes": 4, "hosts": hosts, "racks": [0, 0, 1, 1], "fabric": None,
         "settings": {}, "seconds": 1.0, "finished_at": stamp, "unresolved": [],
         "culprits": [{"part": f"h{hosts.index(n)}", "what": f"network link of {n}", "hosts": [n]} for n in named]}
  (folder / "doctor.json").write_text(json.dumps(doc))
  return str(folder)


def test_the_fleet_view_and_the_drain_line(store, tmp_path):
  for night in range(1, 5):
    index.write(store, folders.read(_doctor(tmp_path, f"d{night}", _stamp(night), ["n2"] if night >= 3 else [])))
  with store.read() as conn:
    rows = {n["node"]: n for n in fleet.nodes(conn)}
  assert rows["n2"]["named"] == 2 and rows["n2"]["last_healthy"] == _stamp(2) and rows["n2"]["last_named"] == _stamp(4)
  assert rows["n1"]["named"] == 0 and rows["n1"]["last_healthy"] == _stamp(4)
  scontrol = tmp_path / "bin" / "scontrol"
  scontrol.parent.mkdir()
  scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'drained'}\n")
  scontrol.chmod(0o755)
  rules_file = _rules(tmp_path, "[[rule]]\nmetric = \"doctor\"\n")
  env = clean_env(PATH=f"{scontrol.parent}:{os.environ['PATH']}")
  args = [sys.executable, "-m", "microbench.cli.report", f"--store={tmp_path / 's.db'}", str(tmp_path / "d4"),
          f"--rules={rules_file}"]
  printed = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False)
  assert printed.returncode == 1 and "drain (run with --drain): scontrol update nodename=n2 state=drain" in printed.stdout
  assert not (tmp_path / "drained").exists()
  ran = subprocess.run([*args, "--drain"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False)
  assert ran.returncode == 1 and (tmp_path / "drained").read_text().startswith("update nodename=n2 state=drain")


def _promtool():
  import shutil as sh  # pylint: disable=import-outside-toplevel
  return sh.which("promtool")


def test_the_prometheus_textfile_passes_promtool_and_a_broken_one_does_not(sweep, store, tmp_path):
  index.write(store, folders.read(variant(sweep, str(tmp_path / "a"), stamp=_stamp(1))))
  index.write(store, folders.read(_doctor(tmp_path, "d1", _stamp(1), ["n2"])))
  out = tmp_path / "tf" / "microbench.prom"
  r = _report(f"--store={tmp_path / 's.db'}", f"--prometheus={out}")
  assert r.returncode == 0, r.stderr
  text = out.read_text()
  assert 'microbench_doctor_node_healthy{node="n2"} 0' in text and "microbench_busbw_bytes_per_second{" in text
  assert not list(out.parent.glob("*.tmp"))
  if _promtool() is None:
    pytest.skip("promtool (Debian's prometheus package) is not installed: the format was not checked by Prometheus")
  ok = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True, text=True, check=False)
  assert ok.returncode == 0, ok.stdout + ok.stderr
  broken = text.replace("# TYPE microbench_doctor_named gauge", "# TYPE microbench_doctor_named counter")
  bad = subprocess.run([_promtool(), "check", "metrics"], input=broken, capture_output=True, text=True, check=False)
  assert bad.returncode != 0  # a counter not named _total: the check reads what we write


# ------------------------------------------------------------------------------------------------------ commands

def test_a_sweep_records_itself_and_a_broken_store_loses_nothing(tmp_path):
  args = [sys.executable, "-m", "microbench", "--collectives=all_reduce", "--scopes=scale_up", "--max_bytes=4K",
          "--samples=2", "--iters=6"]
  r = subprocess.run([*args, f"--outdir={tmp_path / 'runs' / 'a'}"], capture_output=True, text=True, env=clean_env(),
                     cwd=ROOT, timeout=240, check=False)
  assert r.returncode == 0 and "# results store: run" in r.stdout, r.stderr[-2000:]
  s = connect.open_store(connect.resolve(str(tmp_path / "runs" / connect.FILENAME)))
  assert _count(s, "runs") == 1
  (tmp_path / "file").write_text("")
  r = subprocess.run([*args, f"--outdir={tmp_path / 'b'}", f"--store={tmp_path / 'file' / 'x.db'}"],
                     capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=240, check=False)
  assert r.returncode == 0 and "results store: not recorded" in r.stdout and "--index" in r.stdout
  assert os.path.exists(tmp_path / "b" / "results.jsonl")


def test_an_nccl_tests_log_is_a_run_with_its_nccl_version(store, tmp_path):
  from test_nccl_tests_logs import NEW  # pylint: disable=import-outside-toplevel
  log = tmp_path / "all_reduce_perf.log"
  log.write_text(NEW)
  entry = folders.read(str(log))
  assert entry.kind == folders.NCCL_TESTS and entry.points and entry.fingerprint["nccl"]
  run_id = index.write(store, entry)
  with store.read() as conn:
    assert len(queries.records(conn, run_id)) == len(entry.points)
