"""An emulated cluster network on one Linux machine: hosts are network namespaces behind shaped links.

Scale-out and rack-scale results depend on the network, and a development machine has none. Here each
host is a network namespace `<prefix>-h<i>` with one veth (`eth0`, 10.77.x.y/16) into a switch: a Linux
bridge per rack, all living in a switch namespace `<prefix>-sw`, so nothing is created in (or routed
through) the root namespace and the addresses never leave the namespaces. With several racks, each rack
bridge joins a `core` bridge through a veth uplink. Every link is shaped in both directions with tc:
tbf for the rate and, when a delay is asked for, a netem child for the delay (each link end's egress,
so a link's one-way delay is the given delay and host-to-host in one rack crosses two links).

Faults (`faults`, `parse_faults`): one host link or rack uplink shaped to a fraction of its rate, given a delay,
or given loss, so that a tool finding slow parts (microbench-doctor) has something real to find. Loss needs no
netem: a u32 filter on the IP ID's low bits sends that fraction of frames to a queue of length 0 (IDs count
up per frame, so every host sends frames unsegmented when a loss fault exists).

Names carry a random id (`tb<id>`), the state lives in a JSON file, and `down()` removes everything by
name prefix, so a crashed `up` or a killed job leaves nothing behind once `down` runs.

gloo picks the address it advertises by resolving the machine's hostname; inside a namespace that would
be 127.0.0.1, so each host namespace gets /etc/netns/<ns>/hosts (which `ip netns exec` bind-mounts over
/etc/hosts) mapping the hostname to the host's own address, and every other host's namespace name to its
address (so a host can reach another by name, as SLURM's node names and JAX's SLURM coordinator do).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from microbench.fabric import rates as rates_mod
from microbench.fabric.rates import QUEUES, gbytes_per_s

NETNS_ETC = "/etc/netns"
STATE_DIR = "/tmp"
STATE_PATTERN = "microbench-testbed-*.json"
PREFIX_RE = re.compile(r"^tb[0-9a-z]{1,12}$")
HOST_SUBNET = "10.77"  # 10.77.0.0/16, used only on veths inside namespaces this module creates
MAX_HOSTS = 1000


class TestbedError(Exception):
  """A one-line, user-facing reason why the testbed could not be built, used or removed."""


FAULT_KEYS = ("rate", "loss", "delay")
LOSS_STEPS = 1024  # loss is a multiple of 1/1024: one u32 filter per set bit of round(p * 1024)
_PART_RE = re.compile(r"^(h|uplink)([0-9]+)$")


@dataclasses.dataclass(frozen=True)
class LinkFault:
  """A fault planted on one link (both directions): `part` is `h<i>` (host i's link) or `uplink<r>` (rack r's
  uplink); its rate scaled by `rate_fraction` or set to `rate_bits`, `delay_us` added, `loss_pct` of frames
  dropped."""
  part: str
  rate_fraction: float | None = None
  rate_bits: int | None = None
  loss_pct: float = 0.0
  delay_us: int = 0

  def text(self) -> str:
    out = []
    if self.rate_fraction is not None:
      out.append(f"rate x{self.rate_fraction:g}")
    if self.rate_bits is not None:
      out.append(f"rate {self.rate_bits / 1e6:g} Mbit/s")
    if self.loss_pct:
      out.append(f"loss {self.loss_pct:g}%")
    if self.delay_us:
      out.append(f"delay +{self.delay_us} us")
    return f"{self.part}: {', '.join(out)}"


FAULT_SYNTAX = ("want PART:KEY=VALUE[,KEY=VALUE], PART h<i> (a host link) or uplink<r> (a rack uplink), keys rate"
                " (a fraction in (0, 1] like 0.25, or a tc rate like 50mbit), loss (a percentage like 2%),"
                " delay (like 5ms); e.g. h3:rate=0.25, uplink1:loss=2%, h5:delay=5ms")


def parse_faults(specs: Sequence[str]) -> dict[str, LinkFault]:
  """`h3:rate=0.25`, `uplink1:loss=2%`, `h5:delay=5ms,rate=0.5` (repeatable; one part's specs merge) -> faults
  by part. ValueError, one line, names the bad spec and says what is allowed."""
  merged: dict[str, dict] = {}
  for spec in specs:
    part, colon, rest = spec.strip().partition(":")
    m = _PART_RE.match(part.strip().lower())
    if not colon or not m or not rest.strip():
      raise ValueError(f"bad fault {spec!r}: {FAULT_SYNTAX}")
    part = f"{m.group(1)}{int(m.group(2))}"
    kw = merged.setdefault(part, {})
    for item in rest.split(","):
      key, eq, value = (x.strip().lower() for x in item.partition("="))
      if not eq or key not in FAULT_KEYS or not value:
        raise ValueError(f"bad fault {spec!r}: {FAULT_SYNTAX}")
      if key in kw or (key == "rate" and ("rate_fraction" in kw or "rate_bits" in kw)):
        raise ValueError(f"fault {spec!r}: {part} is given {key} twice")
      try:
        if key == "rate":
          if re.fullmatch(r"[0-9]*\.?[0-9]+", value):
            frac = float(value)
            if not 0 < frac <= 1:
              raise ValueError(f"a rate fraction must be in (0, 1], got {value}")
            kw["rate_fraction"] = frac
          else:
            kw["rate_bits"] = rates_mod.parse_rate(value)
            if kw["rate_bits"] is None:
              raise ValueError("a rate of 0 is a cut link, not a slow one")
        elif key == "loss":
          m_loss = re.fullmatch(r"([0-9]*\.?[0-9]+)%", value)
          pct = float(m_loss.group(1)) if m_loss else -1.0
          if not 0 < pct <= 50 or round(pct / 100 * LOSS_STEPS) < 1:
            raise ValueError(f"loss must be a percentage in [0.1%, 50%], got {value!r}")
          kw["loss_pct"] = pct
        else:
          kw["delay_us"] = rates_mod.parse_delay(value)
          if kw["delay_us"] <= 0:
            raise ValueError(f"a delay must be positive, got {value!r}")
      except ValueError as e:
        raise ValueError(f"bad fault {spec!r}: {e}") from None
  return {part: LinkFault(part, **kw) for part, kw in merged.items()}


def loss_filter_lines(dev: str, loss_pct: float, flowid: str, prio: int = 1) -> list[str]:
  """`tc -batch` filter lines sending `loss_pct`% of IPv4 frames to `flowid` (a class whose queue drops all):
  for each set bit of n = round(p * 1024), the frames whose IP ID has its lowest set bit at one position, a
  disjoint 2^-j of all IDs. IDs count up by one per frame, so the loss is spread evenly over each flow."""
  n = round(loss_pct / 100 * LOSS_STEPS)
  lines = []
  for b in range(10):
    if n >> b & 1:
      j = 10 - b  # this bit is 2^-j of all IDs: the lowest j bits are 1 followed by j - 1 zeros
      lines.append(f"filter add dev {dev} parent 1: protocol ip prio {prio} u32 match u16 0x{1 << (j - 1):04x}"
                   f" 0x{(1 << j) - 1:04x} at 4 flowid {flowid}")
  return lines


DROP_CLASS = "fff0"  # the class whose queue (length 0) drops what a loss filter sends it


def lossy_fifo_commands(dev: str, rate_bits: int | None, delay_us: int, loss_pct: float) -> list[str]:
  """`tc -batch` lines for a FIFO link end with loss: an HTB root whose default class passes everything (its
  child the same tbf / netem `shape_commands` would put at the root) and a drop class fed by the loss filters."""
  lines = [f"qdisc add dev {dev} root handle 1: htb default 2",
           f"class add dev {dev} parent 1: classid 1:2 htb rate 100gbit quantum 65536"]
  if rate_bits:
    burst = max(32 * 1024, rate_bits // 8 // 500)
    lines.append(f"qdisc add dev {dev} parent 1:2 handle 2: tbf rate {rate_bits}bit burst {burst} latency 50ms")
    if delay_us:
      lines.append(f"qdisc add dev {dev} parent 2:1 handle 10: netem delay {delay_us}us limit 100000")
  elif delay_us:
    lines.append(f"qdisc add dev {dev} parent 1:2 handle 2: netem delay {delay_us}us limit 100000")
  lines += [f"class add dev {dev} parent 1: classid 1:{DROP_CLASS} htb rate 100gbit quantum 65536",
            f"qdisc add dev {dev} parent 1:{DROP_CLASS} handle {DROP_CLASS}: pfifo limit 0"]
  return lines + loss_filter_lines(dev, loss_pct, f"1:{DROP_CLASS}")


def shape_commands(ns: str, dev: str, rate_bits: int | None, delay_us: int) -> list[list[str]]:
  """tc commands shaping the egress of `dev` in namespace `ns`: tbf (rate), with a netem child (delay).

  tbf's burst is 2 ms at line rate (at least 32 KiB, so TSO/GSO super-packets pass unsplit at low rates);
  its queue holds 50 ms. Without a rate, netem alone adds the delay.
  """
  cmds = []
  if rate_bits:
    burst = max(32 * 1024, rate_bits // 8 // 500)
    cmds.append(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate",
                 f"{rate_bits}bit", "burst", str(burst), "latency", "50ms"])
    if delay_us:
      cmds.append(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                   "delay", f"{delay_us}us", "limit", "100000"])
  elif delay_us:
    cmds.append(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                 f"{delay_us}us", "limit", "100000"])
  return cmds


# Fair queues take turns of at most 16 KB (1.3 ms at 100 Mbit/s), closer to a switch's per-packet arbitration:
# with 64 KB turns (and 64 KB segmentation-offload packets) a pair waited 5 ms per turn behind a bulk pair, so a
# transfer with ~128 KB in flight (a 1.6 MB all-reduce bucket) got a third of a shared uplink instead of half
# (docs/measured-figures.md, sigma #7). The hosts' links send offload packets of at most this size (gso_max_size), since an
# HTB turn is at least one packet. Not one frame: 1514-byte packets cost the two lab cores enough that jobs
# sharing no link slowed each other by 1.6-1.9x; 32 KB turns left sigma #7's DP at -23%.
FAIR_TURN_BYTES = 16384
MAX_FAIR_HOSTS = 64  # fair queues classify every host pair on every link: N^2 filters


def fair_commands(ns: str, dev: str, rate_bits: int, delay_us: int,
                  pairs: list[tuple[str, str]], loss_pct: float = 0.0) -> list[str]:
  """`tc -batch` lines giving `dev`'s egress one queue per host pair (src, dst addresses) crossing it, served
  in turn at the link's rate: HTB, one leaf per pair with an even guaranteed share and the whole link as its
  ceiling, equal quanta (so active pairs split what idle ones leave evenly), u32 filters on the addresses.

  This is a switch port that arbitrates between flows: concurrent host pairs share the link max-min fairly
  whatever their paths and RTTs, and one pair's backlog (50 ms at the link rate, as tbf's queue) delays
  nobody else's packets, ACKs included. fq_codel would do it per TCP flow, but minimal kernels (this lab's
  VM) have only tbf, htb, netem and the fifos. With `loss_pct`, the loss filters come first (same priority,
  added earlier: u32 tries them first) and feed a drop class.
  """
  burst = max(32 * 1024, rate_bits // 8 // 500)  # as tbf's: 2 ms at line rate
  limit = max(burst, rate_bits // 8 // 20)  # 50 ms at line rate
  share = max(8000, rate_bits // (len(pairs) + 1))
  leaf = f"rate {share}bit ceil {rate_bits}bit burst {burst} cburst {burst} quantum {FAIR_TURN_BYTES}"
  lines = [f"qdisc add dev {dev} root handle 1: htb default 2",
           f"class add dev {dev} parent 1: classid 1:1 htb rate {rate_bits}bit ceil {rate_bits}bit "
           f"burst {burst} cburst {burst}"]
  queue = (f"netem delay {delay_us}us limit 100000" if delay_us else f"bfifo limit {limit}")
  if loss_pct:
    lines += [f"class add dev {dev} parent 1: classid 1:{DROP_CLASS} htb rate 100gbit quantum 65536",
              f"qdisc add dev {dev} parent 1:{DROP_CLASS} handle {DROP_CLASS}: pfifo limit 0"]
    lines += loss_filter_lines(dev, loss_pct, f"1:{DROP_CLASS}")
  for k, (src, dst) in enumerate([("", "")] + list(pairs)):
    cid = f"{k + 2:x}"
    lines.append(f"class add dev {dev} parent 1:1 classid 1:{cid} htb {leaf}")
    lines.append(f"qdisc add dev {dev} parent 1:{cid} handle {k + 2:x}: {queue}")
    if src:
      lines.append(f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip src {src}/32 "
                   f"match ip dst {dst}/32 flowid 1:{cid}")
  return lines


def permission_problem() -> str | None:
  """Why this process cannot build a testbed (no `ip`/`tc`, no root/CAP_NET_ADMIN), or None."""
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"`{tool}` (iproute2) not found on PATH"
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      cap = int(next(l for l in f if l.startswith("CapEff:")).split()[1], 16)
  except (OSError, StopIteration, ValueError):
    cap = (1 << 64) - 1 if os.geteuid() == 0 else 0
  if not (cap >> 12) & 1 or not (cap >> 21) & 1:  # CAP_NET_ADMIN, CAP_SYS_ADMIN (netns mounts)
    return "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces; run it with sudo"
  return None


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if check and proc.returncode != 0:
    msg = (proc.stderr or proc.stdout).strip().splitlines()
    raise TestbedError(f"`{' '.join(cmd)}` failed: {msg[-1] if msg else f'exit {proc.returncode}'}")
  return proc


def list_netns() -> list[str]:
  out = _run(["ip", "netns", "list"], check=False).stdout
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def state_path_for(prefix: str) -> str:
  return os.path.join(STATE_DIR, f"microbench-testbed-{prefix}.json")


@dataclasses.dataclass
class Testbed:
  """One emulated cluster: `hosts` hosts in `racks` racks (host i is in rack i // (hosts // racks))."""
  prefix: str
  hosts: int
  racks: int = 1
  host_rate: int | None = None
  host_delay_us: int = 0
  uplink_rate: int | None = None
  uplink_delay_us: int = 0
  queue: str = "fifo"  # each shaped link's queue: fifo (tbf's 50 ms drop-tail) or fair (one per host pair)
  faults: tuple[str, ...] = ()  # planted link faults as written (parse_faults): h3:rate=0.25, uplink1:loss=2%
  state_path: str = ""
  created: bool = False

  def __post_init__(self) -> None:
    if not PREFIX_RE.match(self.prefix):
      raise ValueError(f"bad testbed id {self.prefix!r}: want tb followed by up to 12 of [0-9a-z]")
    if not 1 <= self.hosts <= MAX_HOSTS:
      raise ValueError(f"--hosts must be in [1, {MAX_HOSTS}], got {self.hosts}")
    if self.racks < 1 or self.hosts % self.racks:
      raise ValueError(f"--hosts={self.hosts} must be a multiple of --racks={self.racks}")
    if self.queue not in QUEUES:
      raise ValueError(f"bad queue {self.queue!r}: use one of {', '.join(QUEUES)}")
    if self.queue == "fair" and self.hosts > MAX_FAIR_HOSTS:
      raise ValueError(f"--queue=fair classifies every host pair on every link: at most {MAX_FAIR_HOSTS} hosts,"
                       f" got {self.hosts}")
    self.faults = tuple(self.faults)
    for part, fault in self.link_faults().items():
      kind, index = _PART_RE.match(part).groups()
      if kind == "h" and int(index) >= self.hosts:
        raise ValueError(f"fault on {part}: there are {self.hosts} hosts, h0..h{self.hosts - 1}")
      if kind == "uplink" and (self.racks < 2 or int(index) >= self.racks):
        raise ValueError(f"fault on {part}: " + (f"there are {self.racks} racks, uplink0..uplink{self.racks - 1}"
                                                 if self.racks > 1 else "one rack has no uplink (--racks >= 2)"))
      base = self.host_rate if kind == "h" else self.uplink_rate
      if fault.rate_fraction is not None and not base:
        raise ValueError(f"fault on {part}: rate={fault.rate_fraction:g} is a fraction of the link's rate, and the"
                         f" link is unshaped; give --{'host' if kind == 'h' else 'uplink'}_rate or an absolute"
                         f" rate (rate=50mbit)")
    if not self.state_path:
      self.state_path = state_path_for(self.prefix)

  def link_faults(self) -> dict[str, LinkFault]:
    """The planted faults by part (`h<i>`, `uplink<r>`); ValueError for a spec that does not parse."""
    return parse_faults(self.faults)

  def link(self, part: str) -> tuple[int | None, int, float]:
    """(rate in bits/s or None, one-way delay in us, loss %) of a link, `h<i>` or `uplink<r>`, faults applied."""
    host = part.startswith("h")
    rate = self.host_rate if host else self.uplink_rate
    delay = self.host_delay_us if host else self.uplink_delay_us
    fault = self.link_faults().get(part)
    if not fault:
      return rate, delay, 0.0
    if fault.rate_fraction is not None:
      rate = max(8000, int(rate * fault.rate_fraction))
    elif fault.rate_bits is not None:
      rate = fault.rate_bits
    return rate, delay + fault.delay_us, fault.loss_pct

  @classmethod
  def new(cls, **kwargs) -> Testbed:
    """A testbed with a fresh random id that no existing namespace uses."""
    taken = list_netns()
    while True:
      prefix = "tb" + secrets.token_hex(3)
      if not any(ns.startswith(prefix + "-") for ns in taken):
        return cls(prefix=prefix, **kwargs)

  # Names and addresses.
  @property
  def switch_ns(self) -> str:
    return f"{self.prefix}-sw"

  def host_ns(self, i: int) -> str:
    return f"{self.prefix}-h{i}"

  def host_name(self, i: int) -> str:
    """The name process on host i reports (MICROBENCH_HOSTNAME)."""
    return self.host_ns(i)

  def addr(self, i: int) -> str:
    return f"{HOST_SUBNET}.{i // 250}.{i % 250 + 1}"

  def rack_of(self, i: int) -> int:
    return i // (self.hosts // self.racks)

  # State.
  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["host_addrs"] = [self.addr(i) for i in range(self.hosts)]
    d["racks_of_hosts"] = [self.rack_of(i) for i in range(self.hosts)]
    return d

  def save(self) -> None:
    tmp = self.state_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(self.to_json(), f, indent=1)
    os.replace(tmp, self.state_path)

  @classmethod
  def load(cls, path: str) -> Testbed:
    try:
      with open(path, encoding="utf-8") as f:
        d = json.load(f)
    except (OSError, ValueError) as e:
      raise TestbedError(f"cannot read testbed state {path}: {e}") from e
    fields = {f.name for f in dataclasses.fields(cls)}
    d = {k: v for k, v in d.items() if k in fields}
    d["state_path"] = path
    return cls(**d)

  # Life cycle.
  def up(self) -> None:
    """Builds namespaces, bridges, veths and shaping. On any error removes what it built and raises."""
    problem = permission_problem()
    if problem:
      raise TestbedError(problem)
    self.save()  # First, so that `down` finds the prefix even if we die half-way.
    try:
      self._build()
    except BaseException:
      self.down()
      raise
    self.created = True
    self.save()

  def _build(self) -> None:
    sw = self.switch_ns
    _run(["ip", "netns", "add", sw])
    _run(["ip", "-n", sw, "link", "set", "lo", "up"])
    faults = self.link_faults()
    if (self.host_delay_us or self.uplink_delay_us) and not self._netem_available():
      raise TestbedError("delays need the netem qdisc (sch_netem), which this kernel lacks; drop "
                         "--host_delay/--uplink_delay or use a kernel with netem")
    if any(f.delay_us for f in faults.values()) and not self._netem_available():
      raise TestbedError("a delay fault needs the netem qdisc (sch_netem), which this kernel lacks; plant a rate"
                         " or loss fault instead, or use a kernel with netem")
    lossy = any(f.loss_pct for f in faults.values())
    for r in range(self.racks):
      self._bridge(f"br{r}")
    if self.racks > 1:
      self._bridge("core")
      for r in range(self.racks):
        _run(["ip", "-n", sw, "link", "add", f"up{r}", "type", "veth", "peer", "name", f"dn{r}"])
        _run(["ip", "-n", sw, "link", "set", f"up{r}", "master", f"br{r}", "up"])
        _run(["ip", "-n", sw, "link", "set", f"dn{r}", "master", "core", "up"])
        inside = [self.addr(i) for i in range(self.hosts) if self.rack_of(i) == r]
        outside = [self.addr(i) for i in range(self.hosts) if self.rack_of(i) != r]
        for dev, pairs in ((f"up{r}", [(a, b) for a in inside for b in outside]),  # rack -> core
                           (f"dn{r}", [(b, a) for a in inside for b in outside])):  # core -> rack
          self._shape(sw, dev, *self.link(f"uplink{r}"), pairs)
    os.makedirs(NETNS_ETC, exist_ok=True)
    for i in range(self.hosts):
      ns = self.host_ns(i)
      _run(["ip", "netns", "add", ns])
      etc = os.path.join(NETNS_ETC, ns)
      os.makedirs(etc, exist_ok=True)
      with open(os.path.join(etc, "hosts"), "w", encoding="ascii") as f:
        f.write(f"127.0.0.1 localhost\n::1 localhost\n{self.addr(i)} {socket.gethostname()} {ns}\n")
        f.writelines(f"{self.addr(j)} {self.host_ns(j)}\n" for j in range(self.hosts) if j != i)
      _run(["ip", "-n", ns, "link", "set", "lo", "up"])
      _run(["ip", "-n", sw, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", "netns", ns])
      _run(["ip", "-n", sw, "link", "set", f"h{i}", "master", f"br{self.rack_of(i)}", "up"])
      _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/16", "dev", "eth0"])
      if self.queue == "fair":  # packets no larger than a fair queue's turn, on both ends of the host link
        for where, dev in ((ns, "eth0"), (sw, f"h{i}")):
          _run(["ip", "-n", where, "link", "set", dev, "gso_max_size", str(FAIR_TURN_BYTES)])
      if lossy:  # one frame per packet the queues see, so a loss filter's share of IP IDs is a share of frames
        _run(["ip", "-n", ns, "link", "set", "eth0", "gso_max_segs", "1"])
      _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
      others = [self.addr(j) for j in range(self.hosts) if j != i]
      self._shape(ns, "eth0", *self.link(f"h{i}"), [(self.addr(i), b) for b in others])  # out
      self._shape(sw, f"h{i}", *self.link(f"h{i}"), [(b, self.addr(i)) for b in others])  # in

  def _shape(self, ns: str, dev: str, rate: int | None, delay_us: int, loss_pct: float,
             pairs: list[tuple[str, str]]) -> None:
    """Shapes one link end's egress: tbf's fifo, or (`queue` fair, with a rate) a queue per host pair; with
    loss, a drop class fed by the loss filters beside either."""
    lines = None
    if self.queue == "fair" and rate:
      lines = fair_commands(ns, dev, rate, delay_us, pairs, **({"loss_pct": loss_pct} if loss_pct else {}))
    elif loss_pct:
      lines = lossy_fifo_commands(dev, rate, delay_us, loss_pct)
    if lines is None:
      for cmd in shape_commands(ns, dev, rate, delay_us):
        _run(cmd)
      return
    path = os.path.join(STATE_DIR, f"microbench-testbed-{self.prefix}-{ns}-{dev}.tc")
    with open(path, "w", encoding="ascii") as f:
      f.write("\n".join(lines) + "\n")
    try:
      _run(["tc", "-n", ns, "-batch", path])
    finally:
      os.remove(path)

  def _bridge(self, name: str) -> None:
    sw = self.switch_ns
    _run(["ip", "-n", sw, "link", "add", name, "type", "bridge", "stp_state", "0", "forward_delay", "0"])
    _run(["ip", "-n", sw, "link", "set", name, "up"])

  def _netem_available(self) -> bool:
    ok = _run(["tc", "-n", self.switch_ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"],
              check=False).returncode == 0
    if ok:
      _run(["tc", "-n", self.switch_ns, "qdisc", "del", "dev", "lo", "root"], check=False)
    return ok

  def down(self) -> list[str]:
    """Removes everything of this testbed; see `remove_prefix`."""
    removed = remove_prefix(self.prefix)
    for path in (self.state_path, self.state_path + ".tmp"):
      if os.path.exists(path):
        os.remove(path)
    return removed

  # Running things inside.
  def exec_argv(self, host: int, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", self.host_ns(host)] + list(argv)

  def free_port(self, host: int) -> int:
    """A TCP port free on host's address, probed from inside its namespace."""
    probe = ("import socket; s = socket.socket(); s.bind((%r, 0)); print(s.getsockname()[1])" % self.addr(host))
    out = _run(self.exec_argv(host, [sys.executable, "-c", probe])).stdout
    return int(out.strip())

  def check_alive(self) -> None:
    """Raises if the testbed's namespaces are gone (e.g. `down` ran)."""
    present = set(list_netns())
    missing = [ns for ns in [self.switch_ns] + [self.host_ns(i) for i in range(self.hosts)]
               if ns not in present]
    if missing:
      raise TestbedError(f"testbed {self.prefix} is incomplete (missing {', '.join(missing[:3])}"
                         f"{'...' if len(missing) > 3 else ''}); run `down` and `up` again")

  def describe(self) -> str:
    def link(rate: int | None, delay: int) -> str:
      r = f"{rate / 1e6:g} Mbit/s ({gbytes_per_s(rate):.4g} GB/s)" if rate else "unshaped"
      return r + (f", {delay} us" if delay else "")
    text = (f"testbed {self.prefix}: {self.hosts} host(s) in {self.racks} rack(s); host links "
            f"{link(self.host_rate, self.host_delay_us)}")
    if self.racks > 1:
      text += f"; uplinks {link(self.uplink_rate, self.uplink_delay_us)}"
    if self.queue == "fair":
      text += "; fair queues (one per host pair on every shaped link)"
    faults = self.link_faults()
    if faults:
      text += "; faults: " + "; ".join(f.text() for f in faults.values())
    return text


def remove_prefix(prefix: str) -> list[str]:
  """Deletes every namespace `<prefix>-*` (killing what runs inside) and its /etc/netns entry.

  Deleting a namespace deletes its interfaces and so the veth peers and the qdiscs: nothing of the
  testbed lives outside its namespaces except the /etc/netns/<ns> hosts files and the state file.
  """
  if not PREFIX_RE.match(prefix):
    raise TestbedError(f"refusing to remove {prefix!r}: not a testbed prefix")
  removed = []
  for ns in list_netns():
    if not ns.startswith(prefix + "-"):
      continue
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
      try:
        os.kill(int(pid), signal.SIGKILL)
      except (ProcessLookupError, ValueError):
        pass  # already gone
    for _ in range(50):
      if _run(["ip", "netns", "del", ns], check=False).returncode == 0 or ns not in list_netns():
        break
      time.sleep(0.1)
    removed.append(ns)
  for etc in glob.glob(os.path.join(NETNS_ETC, prefix + "-*")):
    shutil.rmtree(etc, ignore_errors=True)
  try:
    os.rmdir(NETNS_ETC)  # Only if empty.
  except OSError:
    pass
  leftovers = [ns for ns in list_netns() if ns.startswith(prefix + "-")]
  if leftovers:
    raise TestbedError(f"could not remove namespace(s) {', '.join(leftovers)}")
  return removed


def find_states() -> list[str]:
  return sorted(glob.glob(os.path.join(STATE_DIR, STATE_PATTERN)))


def all_prefixes() -> list[str]:
  """Prefixes of every testbed on this machine: from state files, namespace names and /etc/netns."""
  found = {os.path.basename(p)[len("microbench-testbed-"):-len(".json")] for p in find_states()}
  names = list_netns() + (os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else [])
  for name in names:
    m = re.fullmatch(r"(tb[0-9a-z]{1,12})-(sw|h[0-9]+)", name)
    if m:
      found.add(m.group(1))
  return sorted(p for p in found if PREFIX_RE.match(p))
