"""microbench-testbed --fault: a host link or a rack uplink shaped to a fraction of its rate, or given loss or
delay (both directions), so that microbench-doctor has something real to find. The parsing, the tc lines (the
loss filters' share of IP IDs counted exactly), the validation; then on a real testbed, the faulty link's
rate in both directions and its loss measured with ping."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from microbench.cluster import testbed as tbm  # pylint: disable=g-import-not-at-top


def test_parse_faults():
  faults = tbm.parse_faults(["h3:rate=0.25", "UPLINK1:loss=2%", "h5:delay=5ms,rate=50mbit", "h3:loss=1%"])
  assert faults["h3"] == tbm.LinkFault("h3", rate_fraction=0.25, loss_pct=1.0), "one part's specs merge"
  assert faults["uplink1"] == tbm.LinkFault("uplink1", loss_pct=2.0)
  assert faults["h5"] == tbm.LinkFault("h5", rate_bits=50_000_000, delay_us=5000)
  assert faults["h5"].text() == "h5: rate 50 Mbit/s, delay +5000 us"
  assert tbm.parse_faults([]) == {}


@pytest.mark.parametrize("spec,message", [
    ("h3", "want PART:KEY=VALUE"), ("eth0:rate=0.5", "want PART"), ("h3:speed=2", "want PART"),
    ("h3:rate=1.5", "in (0, 1]"), ("h3:rate=0", "in (0, 1]"), ("h3:rate=fast", "bad fault"),
    ("h3:loss=2", "percentage"), ("h3:loss=60%", "percentage"), ("h3:loss=0.01%", "percentage"),
    ("h3:delay=0ms", "positive"), ("h3:rate=0.5,rate=0.2", "twice"),
])
def test_bad_faults_are_one_line(spec, message):
  with pytest.raises(ValueError, match=re.escape(message)) as e:
    tbm.parse_faults([spec])
  assert "\n" not in str(e.value) and spec in str(e.value)


def test_faults_are_checked_against_the_testbed():
  bed = tbm.Testbed(prefix="tbabc123", hosts=4, racks=2, host_rate=200_000_000, uplink_rate=100_000_000,
                    faults=("h3:rate=0.25", "uplink1:loss=2%,delay=1ms"))
  assert bed.link("h3") == (50_000_000, 0, 0.0) and bed.link("h2") == (200_000_000, 0, 0.0)
  assert bed.link("uplink1") == (100_000_000, 1000, 2.0) and bed.link("uplink0") == (100_000_000, 0, 0.0)
  assert "faults: h3: rate x0.25; uplink1: loss 2%, delay +1000 us" in bed.describe()
  for kw, message in [(dict(faults=("h4:rate=0.5",)), "h0..h3"),
                      (dict(faults=("uplink2:loss=1%",)), "uplink0..uplink1"),
                      (dict(racks=1, faults=("uplink0:loss=1%",)), "one rack has no uplink"),
                      (dict(host_rate=None, faults=("h1:rate=0.5",)), "unshaped")]:
    args = dict(prefix="tbabc123", hosts=4, racks=2, host_rate=200_000_000, uplink_rate=100_000_000) | kw
    with pytest.raises(ValueError, match=re.escape(message)):
      tbm.Testbed(**args)
  # An absolute rate needs no shaped link; the state file keeps the faults as written.
  bed = tbm.Testbed(prefix="tbabc123", hosts=2, faults=("h1:rate=10mbit",))
  assert bed.link("h1") == (10_000_000, 0, 0.0)
  assert json.loads(json.dumps(bed.to_json()))["faults"] == ["h1:rate=10mbit"]


def _share_dropped(lines: list[str]) -> float:
  """The share of the 65536 IP IDs that the u32 filters (a 16-bit value/mask at offset 4) send to the drop
  class, each ID counted once however many filters match it (they must be disjoint)."""
  filters = [tuple(int(x, 16) for x in re.search(r"match u16 (0x[0-9a-f]+) (0x[0-9a-f]+) at 4", l).groups())
             for l in lines if l.startswith("filter")]
  hits = [sum(1 for value, mask in filters if ident & mask == value) for ident in range(1 << 16)]
  assert max(hits) <= 1, "overlapping filters"
  return sum(hits) / (1 << 16)


@pytest.mark.parametrize("pct", [0.1, 2, 5, 12.5, 33, 50])
def test_loss_filters_drop_the_asked_share_of_ip_ids(pct):
  lines = tbm.loss_filter_lines("eth0", pct, "1:fff0")
  assert _share_dropped(lines) == round(pct / 100 * tbm.LOSS_STEPS) / tbm.LOSS_STEPS
  assert abs(_share_dropped(lines) - pct / 100) <= 0.5 / tbm.LOSS_STEPS
  assert all(l.endswith("flowid 1:fff0") for l in lines)


def test_a_wrong_loss_filter_fails_the_share_check():
  """Mutation test: masks one bit too short (the filters overlap and drop twice the share) fail the check."""
  lines = [re.sub(r"(match u16 0x[0-9a-f]+) (0x[0-9a-f]+)", lambda m: f"{m.group(1)} 0x{int(m.group(2), 16) >> 1:04x}",
                  l) for l in tbm.loss_filter_lines("eth0", 5, "1:fff0")]
  with pytest.raises(AssertionError):
    assert _share_dropped(lines) == round(0.05 * tbm.LOSS_STEPS) / tbm.LOSS_STEPS


def test_lossy_links_keep_their_rate_and_delay():
  fifo = tbm.lossy_fifo_commands("eth0", 200_000_000, 1000, 2.0)
  assert fifo[0] == "qdisc add dev eth0 root handle 1: htb default 2"
  assert any(l.startswith("qdisc add dev eth0 parent 1:2 handle 2: tbf rate 200000000bit") for l in fifo)
  assert "qdisc add dev eth0 parent 2:1 handle 10: netem delay 1000us limit 100000" in fifo
  assert "qdisc add dev eth0 parent 1:fff0 handle fff0: pfifo limit 0" in fifo
  assert not any("tbf" in l for l in tbm.lossy_fifo_commands("eth0", None, 0, 2.0))
  fair = tbm.fair_commands("ns", "up0", 100_000_000, 0, [("10.77.0.1", "10.77.0.3")], loss_pct=2.0)
  filters = [l for l in fair if l.startswith("filter")]
  assert "flowid 1:fff0" in filters[0] and "match ip src" in filters[-1], "loss filters before the pair filters"
  assert _share_dropped(filters[:-1]) == 20 / 1024


def _cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "microbench.cli.testbed", *args], capture_output=True, text=True,
                        cwd=REPO, timeout=60, check=False)


@pytest.mark.parametrize("args,message", [
    (["--hosts=2", "--host_rate=200mbit", "--fault=h2:rate=0.5", "--", "true"], "h0..h1"),
    (["--hosts=2", "--host_rate=200mbit", "--fault=h1:loss=2", "--", "true"], "percentage"),
    (["run", "--id=tbnosuch", "--fault=h1:rate=0.5", "--", "true"], "planted when the testbed is built"),
])
def test_fault_flag_errors_are_one_line(args, message):
  r = _cli(*args)
  assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


# The real thing.
RECEIVE = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 9999))
s.settimeout(1.0)
print("ready", flush=True)
got = 0
try:
  while True:
    s.recv(2048)
    got += 1
except socket.timeout:
  print(got, flush=True)
"""
SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], 9999))  # connected: the kernel numbers its frames' IP IDs one by one
for _ in range(int(sys.argv[2])):
  s.send(b"x" * 200)
  time.sleep(0.0005)
"""


def _delivered(bed: tbm.Testbed, src: int, dst: int, count: int) -> int:
  """UDP datagrams of `count` sent from host src that host dst receives."""
  recv = subprocess.Popen(bed.exec_argv(dst, [sys.executable, "-c", RECEIVE, bed.addr(dst)]), stdout=subprocess.PIPE,
                          text=True)
  try:
    assert recv.stdout.readline().strip() == "ready"
    subprocess.run(bed.exec_argv(src, [sys.executable, "-c", SEND, bed.addr(dst), str(count)]), check=True,
                   timeout=60)
    return int(recv.communicate(timeout=30)[0].strip())
  finally:
    if recv.poll() is None:
      recv.kill()


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_netns")
def test_planted_faults_on_a_real_testbed():
  """h0's link at a quarter of its rate both ways (tc as built); h1's link dropping 10% of the frames that cross
  it (UDP datagrams counted), the healthy h0 -> h2 path none."""
  bed = tbm.Testbed.new(hosts=3, host_rate=200_000_000, faults=("h0:rate=0.25", "h1:loss=10%"))
  try:
    bed.up()
    def show(ns: str, dev: str) -> str:
      return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True,
                            check=True).stdout
    assert "rate 50Mbit" in show(bed.host_ns(0), "eth0") and "rate 50Mbit" in show(bed.switch_ns, "h0")
    assert "rate 200Mbit" in show(bed.host_ns(2), "eth0") and "rate 200Mbit" in show(bed.switch_ns, "h1")
    assert 0.05 < 1 - _delivered(bed, 2, 1, 1000) / 1000 < 0.2  # into h1: 10% dropped
    assert 0.05 < 1 - _delivered(bed, 1, 2, 1000) / 1000 < 0.2  # out of h1 too
    assert _delivered(bed, 0, 2, 500) == 500
  finally:
    bed.down()
  assert not [ns for ns in tbm.list_netns() if ns.startswith(bed.prefix + "-")]


def test_study_machine_specs_carry_faults_to_the_testbed(monkeypatch):
  """`testbed:fault=PART:KEY=VALUE` (repeatable) in a study machine spec: the testbed's syntax and checks, kept
  through the plan's JSON, and planted by the testbed backend when it builds the testbed."""
  from microbench.study import backends as bk  # pylint: disable=g-import-not-at-top
  from microbench.study import machines as mm  # pylint: disable=g-import-not-at-top
  m = mm.parse("testbed:racks=2,hosts_per_rack=2,fault=h3:rate=0.25,fault=uplink1:loss=2%")
  assert m.faults == ("h3:rate=0.25", "uplink1:loss=2%") and mm.parse("testbed").faults == ()
  assert mm.Machine.from_json(json.loads(json.dumps(m.to_json()))) == m
  for spec, message in [("testbed:fault=h8:rate=0.5", "h0..h7"), ("testbed:fault=h1:loss=2", "percentage"),
                        ("leonardo:fault=h1:rate=0.5", "testbed machine only")]:
    with pytest.raises(mm.MachineError, match=re.escape(message)):
      mm.parse(spec)
  built = {}

  class Bed:
    def __init__(self, **kw):
      built.update(kw)

    def up(self):
      pass

    def describe(self):
      return ""

  monkeypatch.setattr(tbm, "permission_problem", lambda: None)
  monkeypatch.setattr(tbm.Testbed, "new", lambda **kw: Bed(**kw))
  bk.TestbedBackend(m, say=lambda s: None).open()
  assert built["faults"] == ("h3:rate=0.25", "uplink1:loss=2%") and built["hosts"] == 4
