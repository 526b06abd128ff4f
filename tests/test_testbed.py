"""microbench-testbed: the emulated cluster shapes links as asked, runs concurrent jobs, reports each
job's status, and leaves nothing behind (namespaces, /etc/netns entries, state) after success, failure,
Ctrl-C or a crashed `up`. Tests that build namespaces need root and netns; they skip, saying why, where
those are missing (CI runs as root)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time

import pytest

from support import interrupt_when_ready

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from microbench.cluster import testbed as tbm  # pylint: disable=g-import-not-at-top
from microbench.fabric import rates

TESTBED = ["-m", "microbench.cli.testbed"]  # the microbench-testbed console script
JOB = os.path.join(REPO, "tests", "_psum_job.py")


def run_testbed(*args: str, command: list[str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
  argv = [sys.executable, *TESTBED, *args] + (["--", *command] if command else [])
  return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False)


def leftovers(prefix: str) -> list[str]:
  found = [ns for ns in tbm.list_netns() if ns.startswith(prefix + "-")]
  if os.path.isdir(tbm.NETNS_ETC):
    found += [f"/etc/netns/{d}" for d in os.listdir(tbm.NETNS_ETC) if d.startswith(prefix + "-")]
  if os.path.exists(tbm.state_path_for(prefix)):
    found.append(tbm.state_path_for(prefix))
  return found


@pytest.fixture
def bed_id():
  """A fresh testbed id; whatever the test leaves is removed (and reported) afterwards."""
  prefix = "tbt" + secrets.token_hex(3)
  yield prefix
  left = leftovers(prefix)
  if left:
    run_testbed("down", f"--id={prefix}")
  assert not left, f"left behind: {left}"


def busbw(text: str) -> float:
  return float(re.search(r"BUSBW rank=0 .* busbw_GBps=([0-9.]+)", text).group(1))


# Pure functions: run everywhere.
def test_parse_rate_and_delay():
  assert rates.parse_rate("200mbit") == 200_000_000
  assert rates.parse_rate("1.5gbit") == 1_500_000_000
  assert rates.parse_rate("25mbps") == 200_000_000  # tc: bps = bytes per second
  assert rates.parse_rate("") is None and rates.parse_rate("0") is None
  assert rates.gbytes_per_s(200_000_000) == 0.025
  assert rates.parse_delay("1ms") == 1000 and rates.parse_delay("250us") == 250 and rates.parse_delay("") == 0
  for bad in ("fast", "200", "10mb"):
    with pytest.raises(ValueError):
      rates.parse_rate(bad)
  with pytest.raises(ValueError):
    rates.parse_delay("soon")


def test_shape_commands():
  (tbf,) = tbm.shape_commands("ns", "eth0", 200_000_000, 0)
  assert tbf[:9] == ["tc", "-n", "ns", "qdisc", "add", "dev", "eth0", "root", "handle"]
  assert "tbf" in tbf and "200000000bit" in tbf
  tbf, netem = tbm.shape_commands("ns", "eth0", 200_000_000, 1000)
  assert netem[netem.index("parent") + 1] == "1:1" and netem[netem.index("delay") + 1] == "1000us"
  (netem,) = tbm.shape_commands("ns", "eth0", None, 500)
  assert "netem" in netem and "root" in netem
  assert not tbm.shape_commands("ns", "eth0", None, 0)


def test_fair_queue_commands():
  """A queue per host pair: the leaves' guaranteed shares fit in the link, each may borrow all of it, equal
  16 KB quanta (even split of what idle pairs leave, turns short enough for a bursty pair), and each pair's filter
  names its source and destination."""
  lines = tbm.fair_commands("ns", "up0", 100_000_000, 0, [("10.77.0.1", "10.77.0.3"), ("10.77.0.2", "10.77.0.3")])
  assert lines[0] == "qdisc add dev up0 root handle 1: htb default 2"
  leaves = [l for l in lines if l.startswith("class add") and "parent 1:1 " in l]
  assert len(leaves) == 3  # the default class (ARP, anything unmatched) and one per pair
  rates = [int(re.search(r" rate (\d+)bit", l).group(1)) for l in leaves]
  assert sum(rates) <= 100_000_000 and all(" ceil 100000000bit" in l and "quantum 16384" in l for l in leaves)
  filters = [l for l in lines if l.startswith("filter")]
  assert filters == [
      "filter add dev up0 parent 1: protocol ip prio 1 u32 match ip src 10.77.0.1/32 match ip dst 10.77.0.3/32 flowid 1:3",
      "filter add dev up0 parent 1: protocol ip prio 1 u32 match ip src 10.77.0.2/32 match ip dst 10.77.0.3/32 flowid 1:4"]
  assert sum("bfifo limit 625000" in l for l in lines) == 3  # 50 ms at 100 Mbit/s per pair, as tbf's queue
  delayed = tbm.fair_commands("ns", "up0", 100_000_000, 500, [("10.77.0.1", "10.77.0.3")])
  assert sum("netem delay 500us" in l for l in delayed) == 2 and not any("bfifo" in l for l in delayed)
  with pytest.raises(ValueError, match="fifo, fair"):
    tbm.Testbed(prefix="tbabc123", hosts=2, queue="wfq")
  with pytest.raises(ValueError, match="at most 64 hosts"):
    tbm.Testbed(prefix="tbabc123", hosts=65, queue="fair")


def test_topology_names_and_validation():
  bed = tbm.Testbed(prefix="tbabc123", hosts=4, racks=2)
  assert [bed.rack_of(i) for i in range(4)] == [0, 0, 1, 1]
  assert bed.addr(0) == "10.77.0.1" and bed.addr(251) == "10.77.1.2"
  assert bed.host_ns(3) == "tbabc123-h3" and bed.switch_ns == "tbabc123-sw"
  assert bed.state_path == "/tmp/microbench-testbed-tbabc123.json"
  with pytest.raises(ValueError):
    tbm.Testbed(prefix="tbabc123", hosts=3, racks=2)
  with pytest.raises(ValueError):
    tbm.Testbed(prefix="eth0", hosts=2)
  with pytest.raises(tbm.TestbedError):
    tbm.remove_prefix("x")


@pytest.mark.slow
def test_usage_errors_are_one_line():
  for args in (["--hosts=3", "--racks=2", "--", "true"], ["--hosts=2", "--host_rate=fast", "--", "true"],
               ["--hosts=2"]):
    r = run_testbed(*args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.cluster
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_without_net_admin_says_so():
  r = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, *TESTBED, "--hosts=2",
                      "--", "true"], capture_output=True, text=True, timeout=60, check=False)
  assert r.returncode != 0
  assert r.stderr.strip() == ("microbench-testbed: needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces; "
                              "run it with sudo")


# The real thing: namespaces, bridges, tc.
@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
def test_oneshot_shaped_rate_and_cleanup(bed_id):
  """Acceptance: 2 hosts at 200 Mbit/s; a 2-rank all-reduce's busbw (factor 1) is close to 0.025 GB/s."""
  r = run_testbed(f"--id={bed_id}", "--hosts=2", "--host_rate=200mbit",
              command=[sys.executable, JOB, "--bytes=8000000", "--iters=3"])
  assert r.returncode == 0, r.stderr[-3000:]
  assert "psum=3.0 expected=3.0 OK" in r.stdout
  assert f"host {bed_id}-h0 started" in r.stdout
  bw = busbw(r.stdout)
  assert 0.65 * 0.025 <= bw <= 1.1 * 0.025, bw
  assert f"removed testbed {bed_id}" in r.stderr


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
def test_up_run_concurrent_jobs_racks_and_down(bed_id, tmp_path):
  r = run_testbed("up", f"--id={bed_id}", "--hosts=4", "--racks=2", "--host_rate=400mbit", "--uplink_rate=100mbit")
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == bed_id
  state = json.load(open(tbm.state_path_for(bed_id), encoding="utf-8"))
  assert state["racks_of_hosts"] == [0, 0, 1, 1]
  job = [sys.executable, JOB, "--bytes=4000000", "--iters=3"]

  # In-rack vs cross-rack: the cross-rack pair is bounded by the 4x slower uplink.
  in_rack = run_testbed("run", f"--id={bed_id}", "--hosts=0,1", command=job)
  cross = run_testbed("run", f"--id={bed_id}", "--hosts=1,2", command=job)
  assert in_rack.returncode == 0 and cross.returncode == 0, (in_rack.stderr[-2000:], cross.stderr[-2000:])
  assert busbw(in_rack.stdout) > 2 * busbw(cross.stdout), (busbw(in_rack.stdout), busbw(cross.stdout))

  # Two jobs at once on shared hosts plus a third that fails: each one's status is reported.
  report = tmp_path / "report.json"
  r = run_testbed("run", f"--id={bed_id}", "--hosts=2,3", "--hosts=2,3", f"--report={report}", command=job)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "[job0] RESULT rank=0" in r.stdout and "[job1] RESULT rank=0" in r.stdout
  jobs = json.load(open(report, encoding="utf-8"))["jobs"]
  assert [j["returncode"] for j in jobs] == [0, 0] and [j["hosts"] for j in jobs] == [[2, 3], [2, 3]]
  r = run_testbed("run", f"--id={bed_id}", "--hosts=0,1", "--hosts=2,3", f"--report={report}",
              command=[sys.executable, JOB, "--fail_rank=1", "--fail_code=5"])
  assert r.returncode == 5
  jobs = json.load(open(report, encoding="utf-8"))["jobs"]
  assert [(j["returncode"], j["failed_rank"]) for j in jobs] == [(5, 1), (5, 1)]
  assert "job 0 rank 1 failed with exit code 5" in r.stderr

  r = run_testbed("down", f"--id={bed_id}")
  assert r.returncode == 0, r.stderr
  assert not leftovers(bed_id)


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
def test_sigint_removes_everything(bed_id, tmp_path):
  proc = subprocess.Popen([sys.executable, *TESTBED, f"--id={bed_id}", "--hosts=2", "--grace=1", "--",
                           sys.executable, JOB, "--sleep=300", f"--pid_dir={tmp_path}"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
  err = interrupt_when_ready(proc, lambda: len(list(tmp_path.glob("rank*.pid"))) >= 2)
  assert proc.returncode == 130, err[-2000:]
  assert "interrupted (SIGINT)" in err and f"removed testbed {bed_id}" in err
  for pid_file in tmp_path.glob("rank*.pid"):
    assert not os.path.exists(f"/proc/{pid_file.read_text()}"), "a rank survived"
  assert not leftovers(bed_id)


@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
def test_down_after_crashed_up(bed_id):
  proc = subprocess.Popen([sys.executable, *TESTBED, "up", f"--id={bed_id}", "--hosts=60"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
  deadline = time.monotonic() + 30
  while not [ns for ns in tbm.list_netns() if ns.startswith(bed_id + "-h")] and time.monotonic() < deadline:
    time.sleep(0.05)
  proc.kill()  # SIGKILL: no cleanup of its own
  proc.wait()
  assert leftovers(bed_id), "up left nothing to clean: the test did not exercise a crash"
  os.remove(tbm.state_path_for(bed_id))  # Even without the state file, down --id finds it all by name.
  r = run_testbed("down", f"--id={bed_id}")
  assert r.returncode == 0, r.stderr
  assert not leftovers(bed_id)


def _pair_classes(ns: str, dev: str) -> tuple[dict[str, int], dict[str, tuple[str, str]]]:
  """(bytes sent per leaf class, the (src, dst) addresses each class's filter matches) of one link end."""
  sent = {}
  out = subprocess.run(["tc", "-n", ns, "-s", "class", "show", "dev", dev], capture_output=True, text=True,
                       check=True).stdout
  for cid, nbytes in re.findall(r"class htb (1:[0-9a-f]+) parent 1:1 .*?\n\s*Sent (\d+) bytes", out):
    sent[cid] = int(nbytes)
  match = {}
  out = subprocess.run(["tc", "-n", ns, "filter", "show", "dev", dev], capture_output=True, text=True,
                       check=True).stdout
  for cid, src, dst in re.findall(r"flowid (1:[0-9a-f]+).*?\n\s*match ([0-9a-f]{8})/ffffffff at 12\n"
                                  r"\s*match ([0-9a-f]{8})/ffffffff at 16", out):
    match[cid] = tuple(".".join(str(int(h[i:i + 2], 16)) for i in range(0, 8, 2)) for h in (src, dst))
  return sent, match


def _send(bed: tbm.Testbed, src: int, dst: int, nbytes: int) -> None:
  """nbytes over TCP from host src to host dst (a listener in dst's namespace, a sender in src's)."""
  port = bed.free_port(dst)
  server = subprocess.Popen(bed.exec_argv(dst, [sys.executable, "-c", (
      "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
      f"s.bind(({bed.addr(dst)!r}, {port})); s.listen(1); print('ready', flush=True); c, _ = s.accept(); n = 0\n"
      "while True:\n  b = c.recv(1 << 16)\n  if not b: break\n  n += len(b)\nprint(n)")]),
      stdout=subprocess.PIPE, text=True)
  assert server.stdout.readline().strip() == "ready"
  subprocess.run(bed.exec_argv(src, [sys.executable, "-c", (
      f"import socket; s = socket.create_connection(({bed.addr(dst)!r}, {port})); s.sendall(bytes({nbytes}));"
      "s.close()")]), check=True, timeout=60)
  assert int(server.communicate(timeout=60)[0].strip()) == nbytes


def _pair_carried(bed: tbm.Testbed, src: int, dst: int, nbytes: int) -> list[str]:
  """Where a src -> dst transfer did not land in its own pair's class on a link it crosses (empty: all did)."""
  pair = (bed.addr(src), bed.addr(dst))
  ends = [(bed.host_ns(src), "eth0"), (bed.switch_ns, f"h{dst}")]
  if bed.rack_of(src) != bed.rack_of(dst):
    ends += [(bed.switch_ns, f"up{bed.rack_of(src)}"), (bed.switch_ns, f"dn{bed.rack_of(dst)}")]
  wrong = []
  for ns, dev in ends:
    sent, match = _pair_classes(ns, dev)
    mine = [cid for cid, p in match.items() if p == pair]
    if len(mine) != 1 or sent.get(mine[0], 0) < nbytes or sent.get("1:2", 0) > nbytes // 10:
      wrong.append(f"{ns} {dev}: pair class {mine} sent {[sent.get(c) for c in mine]}, default {sent.get('1:2')}")
  return wrong


@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
def test_fair_queue_puts_each_host_pair_in_its_own_queue(bed_id, monkeypatch):
  """--queue=fair: a transfer from rack 0 to rack 1 lands in its pair's own queue on every link it crosses (its
  host link, the uplinks, the destination's link), not in the default queue; a classifier that swaps source
  and destination (every pair's traffic then falls into the shared default queue: FIFO again) fails the check."""
  bed = tbm.Testbed(prefix=bed_id, hosts=4, racks=2, host_rate=400_000_000, uplink_rate=100_000_000, queue="fair")
  bed.up()
  try:
    _send(bed, 0, 3, 2_000_000)
    assert _pair_carried(bed, 0, 3, 2_000_000) == []
    # Packets of at most a turn (16 KB) on both ends of every host link, so a fair queue's turn stays short.
    for ns, dev in [(bed.host_ns(i), "eth0") for i in range(4)] + [(bed.switch_ns, f"h{i}") for i in range(4)]:
      shown = subprocess.run(["ip", "-n", ns, "-d", "link", "show", dev], capture_output=True, text=True).stdout
      assert " gso_max_size 16384 " in shown, (ns, dev, shown)
  finally:
    bed.down()
  real = tbm.fair_commands
  monkeypatch.setattr(tbm, "fair_commands", lambda ns, dev, rate, delay, pairs: real(
      ns, dev, rate, delay, [(b, a) for a, b in pairs]))
  bed = tbm.Testbed(prefix=bed_id, hosts=4, racks=2, host_rate=400_000_000, uplink_rate=100_000_000, queue="fair")
  bed.up()
  try:
    _send(bed, 0, 3, 2_000_000)
    assert len(_pair_carried(bed, 0, 3, 2_000_000)) == 4
  finally:
    bed.down()
