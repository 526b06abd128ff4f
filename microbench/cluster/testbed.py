"""An emulated cluster network on one Linux machine: hosts are network namespaces behind shaped links.

Scale-out and rack-scale results depend on the network, and a development machine has none. Here each
host is a network namespace `<prefix>-h<i>` with one veth (`eth0`, 10.77.x.y/16) into a switch: a Linux
bridge per rack, all living in a switch namespace `<prefix>-sw`, so nothing is created in (or routed
through) the root namespace and the addresses never leave the namespaces. With several racks, each rack
bridge joins a `core` bridge through a veth uplink. Every link is shaped in both directions with tc:
tbf for the rate and, when a delay is asked for, a netem child for the delay (each link end's egress,
so a link's one-way delay is the given delay and host-to-host in one rack crosses two links).

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

from microbench.fabric.rates import QUEUES, gbytes_per_s

NETNS_ETC = "/etc/netns"
STATE_DIR = "/tmp"
STATE_PATTERN = "microbench-testbed-*.json"
PREFIX_RE = re.compile(r"^tb[0-9a-z]{1,12}$")
HOST_SUBNET = "10.77"  # 10.77.0.0/16, used only on veths inside namespaces this module creates
MAX_HOSTS = 1000


class TestbedError(Exception):
  """A one-line, user-facing reason why the testbed could not be built, used or removed."""


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
                  pairs: list[tuple[str, str]]) -> list[str]:
  """`tc -batch` lines giving `dev`'s egress one queue per host pair (src, dst addresses) crossing it, served
  in turn at the link's rate: HTB, one leaf per pair with an even guaranteed share and the whole link as its
  ceiling, equal quanta (so active pairs split what idle ones leave evenly), u32 filters on the addresses.

  This is a switch port that arbitrates between flows: concurrent host pairs share the link max-min fairly
  whatever their paths and RTTs, and one pair's backlog (50 ms at the link rate, as tbf's queue) delays
  nobody else's packets, ACKs included. fq_codel would do it per TCP flow, but minimal kernels (this lab's
  VM) have only tbf, htb, netem and the fifos.
  """
  burst = max(32 * 1024, rate_bits // 8 // 500)  # as tbf's: 2 ms at line rate
  limit = max(burst, rate_bits // 8 // 20)  # 50 ms at line rate
  share = max(8000, rate_bits // (len(pairs) + 1))
  leaf = f"rate {share}bit ceil {rate_bits}bit burst {burst} cburst {burst} quantum {FAIR_TURN_BYTES}"
  lines = [f"qdisc add dev {dev} root handle 1: htb default 2",
           f"class add dev {dev} parent 1: classid 1:1 htb rate {rate_bits}bit ceil {rate_bits}bit "
           f"burst {burst} cburst {burst}"]
  queue = (f"netem delay {delay_us}us limit 100000" if delay_us else f"bfifo limit {limit}")
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
    if not self.state_path:
      self.state_path = state_path_for(self.prefix)

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
    if (self.host_delay_us or self.uplink_delay_us) and not self._netem_available():
      raise TestbedError("delays need the netem qdisc (sch_netem), which this kernel lacks; drop "
                         "--host_delay/--uplink_delay or use a kernel with netem")
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
          self._shape(sw, dev, self.uplink_rate, self.uplink_delay_us, pairs)
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
      _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
      others = [self.addr(j) for j in range(self.hosts) if j != i]
      self._shape(ns, "eth0", self.host_rate, self.host_delay_us, [(self.addr(i), b) for b in others])  # out
      self._shape(sw, f"h{i}", self.host_rate, self.host_delay_us, [(b, self.addr(i)) for b in others])  # in

  def _shape(self, ns: str, dev: str, rate: int | None, delay_us: int, pairs: list[tuple[str, str]]) -> None:
    """Shapes one link end's egress: tbf's fifo, or (`queue` fair, with a rate) a queue per host pair."""
    if self.queue == "fair" and rate:
      path = os.path.join(STATE_DIR, f"microbench-testbed-{self.prefix}-{ns}-{dev}.tc")
      with open(path, "w", encoding="ascii") as f:
        f.write("\n".join(fair_commands(ns, dev, rate, delay_us, pairs)) + "\n")
      try:
        _run(["tc", "-n", ns, "-batch", path])
      finally:
        os.remove(path)
      return
    for cmd in shape_commands(ns, dev, rate, delay_us):
      _run(cmd)

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
