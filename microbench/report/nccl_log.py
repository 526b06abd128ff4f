"""What NCCL did, read from its INFO log (NCCL_DEBUG=INFO): version, network and plugins, NICs, channels, rings
and trees, NVLS and CollNet, the transport of each peer connection, the communicators' sizes, and the algorithm
and protocol it chose per collective and size (NCCL_DEBUG_SUBSYS including TUNING, NCCL 2.21 and later).

The patterns are the formats NCCL 2.x prints, which differ by version (the fixtures in
tests/fixtures/nccl_logs/ hold one log per era): the version goes to stdout without a prefix before 2.23
when no NCCL_DEBUG_FILE is set; connection lines are `Channel 00 : 0[1b000] -> ...` (2.12, P2P) or
`Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read`; the choice is a TRACE line only before 2.21, then
`1048576 Bytes -> Algo 1 proto 2 time 23.4` (2.21, 2.22: no collective named), `AllReduce: 1048576 Bytes ->
Algo 1 proto 2 time 23.4` (2.23), `AllReduce: 1048576 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..7}`
(2.24 and later, where all-gather and reduce-scatter count the bytes of one rank, not of the whole buffer).

Lines are read per process (the `host:pid:tid` prefix), so logs of several processes interleaved line by line
read the same as separate files. A line NCCL wrote but that did not arrive whole (the last line of a file
without its newline, one that another process's line cut into, a known line that stops short) is counted in
`unread` and named in `problems`, never guessed at; every other line is still read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from microbench.report import tables

ALGORITHMS = {"0": "tree", "1": "ring", "2": "collnet_direct", "3": "collnet_chain", "4": "nvls", "5": "nvls_tree",
              "6": "pat"}  # NCCL's algorithm numbers (ncclAlgo order); 2.24+ print the names
PROTOCOLS = {"0": "LL", "1": "LL128", "2": "Simple"}
NVLS_ALGORITHMS = ("nvls", "nvls_tree")
COLLNET_ALGORITHMS = ("collnet", "collnet_direct", "collnet_chain")
OFFLOADED = NVLS_ALGORITHMS + COLLNET_ALGORITHMS  # reductions in the switches: either one is NVLS or SHARP used
# The sizes where bandwidth, not latency, decides NCCL's choice: an all-reduce this large on a machine with
# NVLS (or CollNet set up) that never uses it is left bandwidth.
LARGE_BYTES = 16 << 20
NCCL_COLLECTIVES = {"all_reduce": "AllReduce", "all_gather": "AllGather", "reduce_scatter": "ReduceScatter",
                    "broadcast": "Broadcast"}  # this project's names -> NCCL's (reduction variants by prefix)
PER_RANK = ("AllGather", "ReduceScatter")  # 2.24+ print count x type size: S / n for these
MAX_PROBLEMS = 10

# `[timestamp] host:pid:tid [dev] NCCL INFO `; TRACE lines carry a time and file:line before `NCCL TRACE`.
_MARK = re.compile(r"(?:(?P<host>[^\s:\[\]\x00-\x1f\ufffd]+):(?P<pid>\d+):\d+ )?(?:\[\d+\] )?(?:[\d.]+ \S+:\d+ )?"
                   r"NCCL (?P<level>INFO|TRACE) ")
_PLAIN_VERSION = re.compile(r"^\s*NCCL version (\d+\.\d+\.\d+\S*)\s*$")  # stdout, or NCCL_DEBUG=VERSION
_VERSION = re.compile(r"^NCCL version (\d+\.\d+\.\d+\S*)$")
_USING_NET = re.compile(r"^Using network (\S.*)$")
_NET_DEVICES = re.compile(r"^NET/(\w+) ?: ?Using((?: \[\d+\]\S+)+)(?: \[RO\])? ?(?:; OOB (\S+))?$")
_NET_PLUGIN = re.compile(r"^NET/Plugin ?: ?Loaded net plugin (.+) \(v\d+\)$")
_COLLNET_PLUGIN = re.compile(r"^NET/Plugin ?: ?Loaded coll(?:net)? plugin (.+) \(v\d+\)$")
_OFI = re.compile(r"^NET/OFI (?:Using|Initializing) (aws-ofi-nccl \S+)$")
_OFI_PROVIDER = re.compile(r"^NET/OFI Selected [Pp]rovider is ([\w-]+)")
_TUNER = re.compile(r"^TUNER/Plugin: Using tuner plugin (.+)$")
_RING = re.compile(r"^Channel (\d+)(?:/(\d+))? :((?: +\d+)+)$")  # 2.4-era rings: no "/count"
_CONNECTION = re.compile(r"^(?:Channel|Ring) \d+(?:/\d+)? : \d+(?:\[[0-9a-f]+\])? -> \d+(?:\[[0-9a-f]+\])?"
                         r"(?: \[(?:send|receive)\])? via (\S.*)$")
_COLLNET_CONNECTION = re.compile(r"^CollNet \d+(?:/\d+)? : \d+ \[(?:send|receive)\] via (COLLNET/\S+)$")
_CHANNEL_COUNTS = re.compile(r"^(\d+) coll channels, (?:\d+ collnet channels, )?(?:(\d+) nvls channels, )?"
                             r"\d+ p2p channels, \d+ p2p channels per peer$")
_NVLS_SUPPORT = re.compile(r"^NVLS multicast support is (not )?available on dev \d+(?: \(NVLS_NCHANNELS (\d+)\))?$")
_COMM = re.compile(r"comm 0x[0-9a-f]+ rank \d+ nRanks (\d+) nNodes (\d+) localRanks (\d+) localRank \d+ MNNVL (\d+)$")
_COMM_OLD = re.compile(r"comm (?:0x[0-9a-f]+|\(nil\)) rank \d+ nranks (\d+) cudaDev \d+ .*- Init COMPLETE$")
_ENV = re.compile(r"^(NCCL_\w+) set (?:by environment )?to (.*?)\.?$")
_TUNING = re.compile(r"^(?:(\w+): )?(\d+) Bytes -> Algo (\w+) proto (\w+) "
                     r"(?:time -?[\d.]+(?:e[+-]?\d+)?|(channel)\{Lo\.\.Hi\}=\{\d+\.\.\d+\})$")
_OPCOUNT = re.compile(r"^(\w+): opCount [0-9a-f]+ sendbuff \S+ recvbuff \S+ count (\d+) datatype (\d+) "
                      r".*\[nranks=(\d+)\]")
TYPE_BYTES = (1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1)  # ncclDataType_t order: int8 ... bfloat16, fp8 e4m3, e5m2
# A line that starts as one of the above but does not match it whole was cut short.
_HEADS = {"version": re.compile(r"^NCCL version"), "network": re.compile(r"^Using network"),
          "NET/ device": re.compile(r"^NET/\w+ ?: ?Using \["), "ring": re.compile(r"^Channel \d+/\d+ :\s*$"),
          "connection": re.compile(r"^(?:Channel|Ring) \d+(?:/\d+)? : \d+"), "CollNet": re.compile(r"^CollNet \d+"),
          "channel count": re.compile(r"^\d+ coll channels"), "NVLS support": re.compile(r"^NVLS multicast support"),
          "communicator": re.compile(r"comm 0x[0-9a-f]+ rank \d+ nRanks"), "tuning": re.compile(r"Bytes -> Algo")}


def _empty() -> dict[str, Any]:
  return {"versions": set(), "processes": set(), "networks": set(), "net_devices": set(), "plugin": set(),
          "collnet_plugin": set(), "tuner": set(), "channels": 0, "nvls_channels": None, "transports": set(),
          "trees": False, "nvls_support": None, "nvls": False, "collnet": False, "collnet_disabled": None,
          "communicators": set(), "env": {}, "choices": {}, "info_lines": 0, "unread": 0, "problems": []}


def parse(logs: str | Mapping[str, str]) -> dict[str, Any]:
  """The facts of NCCL INFO lines: one text, or {file name: text} of the files of several processes."""
  if isinstance(logs, str):
    logs = {"": logs}
  facts = _empty()
  for name, text in logs.items():
    _read_text(name, text, facts)
  out = {k: sorted(v) if isinstance(v, set) and k != "communicators" else v for k, v in facts.items()}
  out["processes"] = len(facts["processes"])
  known = {c[0] for c in facts["communicators"] if c[1] is not None}  # 2.20+ print both lines per communicator
  out["communicators"] = [dict(zip(("ranks", "nodes", "local_ranks", "mnnvl"), c)) for c in
                          sorted(facts["communicators"], key=lambda c: tuple(-1 if x is None else x for x in c))
                          if c[1] is not None or c[0] not in known]
  out["choices"] = [{**dict(zip(("collective", "bytes", "algorithm", "protocol", "per_rank"), k)), "calls": n}
                    for k, n in sorted(facts["choices"].items(), key=lambda kv: (kv[0][0] or "", kv[0][1]))]
  if len(facts["problems"]) > MAX_PROBLEMS:
    out["problems"] = facts["problems"][:MAX_PROBLEMS] + [f"... and {len(facts['problems']) - MAX_PROBLEMS} more"]
  return out


def _problem(facts: dict[str, Any], where: str, what: str) -> None:
  facts["unread"] += 1
  facts["problems"].append(f"{where}: {what}")


def _read_text(name: str, text: str, facts: dict[str, Any]) -> None:
  label = name or "log"
  if not text.strip():
    facts["problems"].append(f"{label}: empty (the process ended before NCCL started, or ran no communicator)")
    return
  lines = text.split("\n")
  last_cut = not text.endswith("\n")  # NCCL ends every line: a last line without its newline was cut off
  binary = 0
  pending: dict[str, list[tuple[str, int]]] = {}  # per process: the last collectives COLL lines announced
  for i, line in enumerate(lines, 1):
    if "\x00" in line or "\ufffd" in line:
      binary += 1
    marks = list(_MARK.finditer(line))
    if not marks:
      if m := _PLAIN_VERSION.match(line):
        facts["versions"].add(m.group(1))
      continue
    where = f"{label}:{i}"
    for j, m in enumerate(marks):
      end = marks[j + 1].start() if j + 1 < len(marks) else len(line)
      body = line[m.end():end].strip()
      proc = f"{m['host']}:{m['pid']}" if m["host"] else ""
      if m["level"] == "INFO":
        facts["info_lines"] += 1
        if proc:
          facts["processes"].add(proc)
      if j + 1 < len(marks):
        _problem(facts, where, "a line another process's line cut into, not read")
      elif last_cut and i == len(lines):
        _problem(facts, where, "cut short at the end of the file (the process ended mid-line), not read")
      elif m["level"] == "INFO":
        _read_line(body, proc, facts, pending, where)
      elif t := _TUNING.match(body):  # TRACE builds before 2.21 log the choice only here
        _choice(t, proc, facts, pending)
  if binary:
    facts["problems"].append(f"{label}: {binary} line(s) of binary data skipped (what NCCL lines they held were read)")


def _read_line(body: str, proc: str, facts: dict[str, Any], pending: dict[str, list[tuple[str, int]]],
               where: str) -> None:
  """One INFO line's fact; a known line that stops short is a problem, an unknown one is skipped."""
  if "Bytes -> Algo" in body and (m := _TUNING.match(body)):  # one per call: most of a long run's lines
    _choice(m, proc, facts, pending)
    return
  if not (_read_setup(body, facts) or _read_topology(body, facts)):
    if m := _OPCOUNT.match(body):  # 2.21/2.22 tuning lines name no collective: these lines (COLL) can
      coll, count, dtype, nranks = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
      size = count * (TYPE_BYTES[dtype] if dtype < len(TYPE_BYTES) else 0) * (nranks if coll in PER_RANK else 1)
      pending.setdefault(proc, []).append((coll, size))
      del pending[proc][:-64]  # every rank's calls: a window of recent ones, not the whole log
    elif kind := next((k for k, head in _HEADS.items() if head.search(body)), None):
      _problem(facts, where, f"{kind} line cut short, not read: {body[:60]!r}")
  _read_flags(body, facts)


def _read_setup(body: str, facts: dict[str, Any]) -> bool:
  """A line naming NCCL's version, network, NICs, plugins or tuner; False where the line is none of these."""
  if m := _VERSION.match(body):
    facts["versions"].add(m.group(1))
  elif m := _USING_NET.match(body):
    facts["networks"].add(m.group(1).strip())
  elif (m := _NET_DEVICES.match(body)) and (m.group(3) or m.group(1) == "Socket" and body.endswith(">")):
    facts["net_devices"].update(re.sub(r"^\[\d+\]", "", d) for d in m.group(2).split())
  elif m := _NET_PLUGIN.match(body) or _OFI.match(body):
    facts["plugin"].add(m.group(1))
  elif m := _COLLNET_PLUGIN.match(body):
    facts["collnet_plugin"].add(m.group(1))
  elif m := _OFI_PROVIDER.match(body):
    facts["plugin"].add(f"OFI provider {m.group(1)}")
    if nics := re.search(r"\(found (\d+) nics\)", body):
      facts["net_devices"].add(f"{m.group(1)} x{nics.group(1)}")
  elif m := _TUNER.match(body):
    facts["tuner"].add(m.group(1))
  else:
    return False
  return True


def _read_topology(body: str, facts: dict[str, Any]) -> bool:
  """A line on channels, transports, NVLS, communicators or an NCCL_ variable; False where it is none."""
  if m := _RING.match(body):
    facts["channels"] = max(facts["channels"], int(m.group(2) or int(m.group(1)) + 1))
  elif m := _CONNECTION.match(body):
    via = m.group(1).strip()
    facts["transports"].add("SHM/direct" if via == "direct shared memory" else via)  # 2.12's SHM wording
  elif m := _COLLNET_CONNECTION.match(body):
    facts["transports"].add(m.group(1))
    facts["collnet"] = True
  elif m := _CHANNEL_COUNTS.match(body):
    facts["channels"] = max(facts["channels"], int(m.group(1)))
    if m.group(2) is not None:
      facts["nvls_channels"] = max(facts["nvls_channels"] or 0, int(m.group(2)))
  elif m := _NVLS_SUPPORT.match(body):
    facts["nvls_support"] = bool(facts["nvls_support"]) or not m.group(1)
    if m.group(2) is not None:
      facts["nvls_channels"] = max(facts["nvls_channels"] or 0, int(m.group(2)))
  elif m := _COMM.search(body):
    facts["communicators"].add((int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4) == "1"))
  elif m := _COMM_OLD.search(body):
    facts["communicators"].add((int(m.group(1)), None, None, None))
  elif m := _ENV.match(body):
    facts["env"][m.group(1)] = m.group(2)
  else:
    return False
  return True


def _read_flags(body: str, facts: dict[str, Any]) -> None:
  """What any line can also say: trees, NVLS or CollNet in use, CollNet turned off."""
  if body.startswith(("Trees", "Connected all trees")):
    facts["trees"] = True
  if body.startswith(("Connected NVLS", "NVLS comm ", "NVLS Trees")) or "via NVLS" in body:
    facts["nvls"] = True
  if re.match(r"(?:rank \d+ )?Connected (?:CollNet|collnet|Collnet)|Collnet Chains", body):
    facts["collnet"] = True
  if "disabling CollNet" in body:
    facts["collnet_disabled"] = body
  if facts["nvls_support"] and (facts["nvls_channels"] or 0) > 0:
    facts["nvls"] = True


def _choice(m: re.Match[str], proc: str, facts: dict[str, Any], pending: dict[str, list[tuple[str, int]]]) -> None:
  """One algorithm/protocol choice, counted per (collective, bytes, algorithm, protocol)."""
  coll, size, algo, proto, named = m.groups()
  if coll is None:  # 2.21/2.22: the collective of this size the process announced last, if only one is
    names = {c for c, b in pending.get(proc, []) if b == int(size)}
    coll = names.pop() if len(names) == 1 else None
  algorithm = ALGORITHMS.get(algo) or algo.lower().replace("collnetdirect", "collnet_direct").replace(
      "collnetchain", "collnet_chain").replace("nvlstree", "nvls_tree")
  protocol = PROTOCOLS.get(proto) or {"ll": "LL", "ll128": "LL128", "simple": "Simple"}.get(proto.lower(), proto)
  key = (coll, int(size), algorithm, protocol, bool(named) and coll in PER_RANK)
  facts["choices"][key] = facts["choices"].get(key, 0) + 1


def expected_network(environment: Mapping[str, Any] | None) -> str | None:
  """Why a run should not have used sockets (None: nothing says so), from the recorded environment: the user
  asked for a network (NCCL_NET, NCCL_IB_HCA), or the host has an active InfiniBand/RoCE/EFA port or Slingshot
  NICs. NCCL_IB_DISABLE=1 or NCCL_NET=Socket is the user choosing sockets."""
  env = environment or {}
  variables = env.get("variables") or {}
  net = (variables.get("NCCL_NET") or "").strip().strip('"')
  if variables.get("NCCL_IB_DISABLE", "").strip() == "1" or net.lower() == "socket":
    return None
  if net:
    return f"NCCL_NET={net} was set"
  if variables.get("NCCL_IB_HCA"):
    return f"NCCL_IB_HCA={variables['NCCL_IB_HCA']} was set"
  nics = env.get("nics") or []
  active = [n for n in nics if n.get("link_layer") != "cxi" and "ACTIVE" in (n.get("state") or "")]
  if active:
    layers = sorted({{"Ethernet": "RoCE"}.get(n.get("link_layer"), n.get("link_layer") or "?") for n in active})
    names = " ".join(f"{n.get('device')}:{n.get('port')}" for n in active[:4]) + (" ..." if len(active) > 4 else "")
    return f"the host has active {'/'.join(layers)} RDMA ports ({names})"
  if any(n.get("link_layer") == "cxi" for n in nics):
    return "the host has Slingshot (cxi) NICs"
  return None


def _sizes(choices: list[dict[str, Any]]) -> str:
  lo, hi = min(c["bytes"] for c in choices), max(c["bytes"] for c in choices)
  return tables.size_text(lo) + ("" if lo == hi else f"-{tables.size_text(hi)}")


def _large_all_reduce(facts: dict[str, Any]) -> list[dict[str, Any]]:
  return [c for c in facts.get("choices", []) if c["collective"] == "AllReduce" and c["bytes"] >= LARGE_BYTES]


def warnings(facts: dict[str, Any], expected: str | None = None, captured: bool = False,
             variables: Mapping[str, str] | None = None) -> list[str]:
  """One line per thing a cluster user must know: sockets where a fast network was `expected`
  (expected_network's reason), NVLS or CollNet/SHARP there but not used, log lines that could not be read,
  no NCCL lines (`captured`: the run set NCCL's variables itself, so none means no communicator ran).
  `variables`: the NCCL_* variables recorded for the run, beside those NCCL's own ENV lines name."""
  out = []
  if not facts["info_lines"]:
    out.append("NCCL wrote no INFO lines: no NCCL communicator ran (a CPU run), or NCCL_DEBUG_FILE points"
               " elsewhere" if captured else "no NCCL INFO lines: set NCCL_DEBUG=INFO to record what NCCL did")
    return out
  env = {**(variables or {}), **facts.get("env", {})}
  if facts.get("problems"):
    more = len(facts["problems"]) - 1
    head = f"{facts['unread']} NCCL log line(s) not read, the rest was" if facts.get("unread") else "NCCL logs"
    out.append(f"{head}: {facts['problems'][0]}" + (f" (+{more} more in meta.json's nccl.problems)" if more else ""))
  nets = {n.lower() for n in facts["networks"]}
  comms = facts.get("communicators", [])
  crossed = (any(t.startswith("NET/Socket") for t in facts["transports"])
             or any((c.get("nodes") or 0) > 1 for c in comms)
             or not facts["transports"] and not any(c.get("nodes") for c in comms))  # unknown: say it
  if expected and nets and nets <= {"socket"} and crossed:
    out.append(f"NCCL used sockets (NET/Socket) although {expected}: check NCCL_IB_HCA, the RDMA driver and"
               " /dev/infiniband inside the job, or a missing network plugin (aws-ofi-nccl for EFA/Slingshot)")
  large = _large_all_reduce(facts)
  forced = f" (NCCL_ALGO={env['NCCL_ALGO']} was set)" if env.get("NCCL_ALGO") else ""
  if facts.get("nvls_support"):
    if facts.get("nvls_channels") == 0:
      out.append("NVLS (NVLink SHARP) multicast was available but NCCL set up 0 NVLS channels"
                 f"{forced}: check NCCL_NVLS_ENABLE, and the memory and IMEX/fabric manager NVLS needs")
    elif large and not any(c["algorithm"] in OFFLOADED for c in large):
      chose = ", ".join(sorted({f"{c['algorithm']}/{c['protocol']}" for c in large}))
      out.append(f"NVLS (NVLink SHARP) was available but NCCL chose {chose} for every all-reduce of"
                 f" {_sizes(large)}{forced}: check NCCL_ALGO, a tuner plugin, and the op and type (NVLS reduces"
                 " sum/min/max of 16- and 32-bit floats)")
  multi_node = any((c.get("nodes") or 0) > 1 for c in comms) or any(t.startswith("NET/") for t in facts["transports"])
  if facts.get("collnet") and large and not any(c["algorithm"] in OFFLOADED for c in large):
    chose = ", ".join(sorted({f"{c['algorithm']}/{c['protocol']}" for c in large}))
    out.append(f"CollNet (SHARP) was set up but NCCL chose {chose} for every all-reduce of {_sizes(large)}{forced}")
  elif facts.get("collnet_plugin") and not facts.get("collnet") and multi_node:
    why = (facts.get("collnet_disabled") or (f"NCCL_COLLNET_ENABLE={env['NCCL_COLLNET_ENABLE']}"
           if "NCCL_COLLNET_ENABLE" in env else "NCCL_COLLNET_ENABLE is not set"))
    out.append(f"CollNet plugin {', '.join(facts['collnet_plugin'])} was loaded but CollNet (SHARP) was not used"
               f" ({why}): on SHARP switches set NCCL_COLLNET_ENABLE=1 with the aggregation manager running;"
               " elsewhere NCCL_NET_PLUGIN=none keeps the plugin out")
  return out


BESIDE_HEADERS = ("collective", "scope", "dtype", "size (B)", "n", "busbw (GB/s)", "NCCL algorithm/protocol")


def chosen(record: Mapping[str, Any], facts: Mapping[str, Any] | None) -> str:
  """The algorithm/protocol pairs NCCL logged for this point's collective and size ('' where none): the log
  names no communicator, so scopes of one size share their pairs."""
  coll = str(record.get("collective", ""))
  name = next((v for k, v in NCCL_COLLECTIVES.items() if coll == k or coll.startswith(k + "_")), None)
  if not name or not facts:
    return ""
  size, n = int(record.get("bytes") or 0), max(1, int(record.get("group_size") or 1))
  hits = {f"{c['algorithm']}/{c['protocol']}" for c in facts.get("choices", [])
          if c["collective"] == name and c["bytes"] == (size // n if c.get("per_rank") else size)}
  return ", ".join(sorted(hits))


def beside(records: Iterable[Mapping[str, Any]], facts: Mapping[str, Any] | None) -> tuple[list[tuple[Any, ...]], str]:
  """Rows of the run's measured points with NCCL's choice for each, and a note when the log cannot give one."""
  if not facts:
    return [], "no NCCL facts in meta.json: run with --nccl_debug (or NCCL_DEBUG=INFO) to record NCCL's choices"
  rows = [(r["collective"], r.get("scope"), r.get("dtype"), r.get("bytes"), r.get("group_size"),
           tables.fmt(r.get("busbw_gbps")), chosen(r, facts) or "–")
          for r in tables.ok(records)]
  choices = facts.get("choices") or []
  if not choices:
    note = ("the NCCL log holds no algorithm choice: NCCL logs it from 2.21 on, with TUNING in NCCL_DEBUG_SUBSYS"
            f" (NCCL {', '.join(facts.get('versions') or ['version unknown'])})")
  elif any(c["collective"] is None for c in choices):
    note = ("NCCL 2.21/2.22 name no collective in their choice lines: add COLL to NCCL_DEBUG_SUBSYS to pair them"
            " (the choices that could not be paired are in meta.json's nccl.choices)")
  else:
    note = "NCCL's log names no communicator: where two scopes run one size, each shows the choices of both"
  return rows, note


def beside_markdown(runs: Iterable[tuple[str, list[dict[str, Any]], Mapping[str, Any] | None]]) -> str:
  """`microbench-report`'s nccl.md: per run that recorded NCCL's facts, its points beside NCCL's choices."""
  parts = []
  for label, records, facts in runs:
    if not facts or not facts.get("info_lines"):  # no NCCL ran (a CPU run): nothing to set beside
      continue
    rows, note = beside(records, facts)
    parts.append(f"## {label}\n\nNCCL {', '.join(facts.get('versions') or ['?'])}, network"
                 f" {', '.join(facts.get('networks') or ['?'])}; {note}.\n\n" + tables.markdown(BESIDE_HEADERS, rows))
  return "# What NCCL chose beside each point\n\n" + "\n\n".join(parts) + "\n" if parts else ""


def write_beside(sweeps: Sequence[Any], out: str) -> str:
  """OUT/nccl.md from report sweeps (label, records, meta): its text, or "" (and no file) when no run recorded
  NCCL's log."""
  text = beside_markdown([(s.label, s.records, s.meta.get("nccl")) for s in sweeps])
  if text:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "nccl.md"), "w", encoding="utf-8") as f:
      f.write(text)
  return text
