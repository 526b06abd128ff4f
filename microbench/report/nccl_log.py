"""What NCCL did, read from its INFO log (NCCL_DEBUG=INFO): version, network, devices, channels, rings and
trees, NVLS and CollNet, the transport of each peer connection, and the algorithm and protocol it chose per
collective where the log says (NCCL_DEBUG_SUBSYS including TUNING).

Only lines holding " NCCL INFO " are read; a log of anything else yields empty facts, never an error, and a
line whose known pattern is cut off is counted in `unread` rather than guessed at. The patterns are the
formats NCCL 2.x prints (kept loose where versions differ: `NET/IB : Using [0]mlx5_0:1/IB`, `Using network
IB`, `Channel 00/24 :`, `via P2P/CUMEM/read`, `AllReduce: 1048576 Bytes -> Algo 1 proto 2 time 23.4`).
"""

from __future__ import annotations

import re
from typing import Any

ALGORITHMS = {"0": "tree", "1": "ring", "2": "collnet_direct", "3": "collnet_chain", "4": "nvls", "5": "nvls_tree",
              "6": "pat"}  # NCCL's algorithm numbers (ncclAlgo order)
PROTOCOLS = {"0": "LL", "1": "LL128", "2": "Simple"}

_VERSION = re.compile(r"NCCL version (\S+)")
_USING_NET = re.compile(r"Using network (.+?)\s*$")
_NET_DEVICES = re.compile(r"NET/(\w+)\s*:\s*Using (.+?)(?:\s*;\s*OOB.*)?$")
_PLUGIN = re.compile(r"NET/(?:Plugin|OFI)\s*:?\s*(.*)$")
_CHANNELS = re.compile(r"Channel \d+/(\d+) :")
_VIA = re.compile(r"via ((?:P2P|SHM|NET|NVLS|COLLNET)/.+?)\s*$")  # to the line's end: plugin names hold spaces
_TREE = re.compile(r"Trees? \[")
_NVLS = re.compile(r"NVLS", re.IGNORECASE)
_COLLNET = re.compile(r"CollNet", re.IGNORECASE)
_TUNING = re.compile(r"(\w+): (\d+) Bytes -> Algo (\d+) proto (\d+)")


def parse(text: str) -> dict[str, Any]:
  """The facts of one process's (or several processes') NCCL INFO lines."""
  facts: dict[str, Any] = {"versions": set(), "networks": set(), "net_devices": set(), "plugin": set(),
                           "channels": 0, "transports": set(), "trees": False, "nvls": False, "collnet": False,
                           "choices": [], "info_lines": 0, "unread": 0}
  for line in text.splitlines():
    if " NCCL INFO " not in line:
      continue
    facts["info_lines"] += 1
    body = line.split(" NCCL INFO ", 1)[1].strip()
    if m := _VERSION.search(body):
      facts["versions"].add(m.group(1))
    elif m := _USING_NET.search(body):
      facts["networks"].add(m.group(1))
    elif m := _NET_DEVICES.search(body):
      facts["networks"].add(m.group(1))
      facts["net_devices"].update(d.split("]", 1)[1] for d in m.group(2).split() if "]" in d)
    elif body.startswith(("NET/Plugin", "NET/OFI")) and (m := _PLUGIN.search(body)):
      facts["plugin"].add(m.group(1).strip())
    elif m := _CHANNELS.search(body):
      facts["channels"] = max(facts["channels"], int(m.group(1)))
      if v := _VIA.search(body):
        facts["transports"].add(v.group(1))
    elif m := _VIA.search(body):
      facts["transports"].add(m.group(1))
    elif m := _TUNING.search(body):
      facts["choices"].append({"collective": m.group(1), "bytes": int(m.group(2)),
                               "algorithm": ALGORITHMS.get(m.group(3), m.group(3)),
                               "protocol": PROTOCOLS.get(m.group(4), m.group(4))})
    elif "Bytes -> Algo" in body:
      facts["unread"] += 1  # a tuning line cut short: counted, not guessed
    if _TREE.search(body):
      facts["trees"] = True
    if _NVLS.search(body):
      facts["nvls"] = True
    if _COLLNET.search(body) and "disabled" not in body.lower():
      facts["collnet"] = True
  return {k: sorted(v) if isinstance(v, set) else v for k, v in facts.items()}


def warnings(facts: dict[str, Any], expect_ib: bool, captured: bool = False) -> list[str]:
  """One line per thing a cluster user must know: sockets where InfiniBand was expected, no NCCL lines
  (`captured`: the run set NCCL's variables itself, so none means no communicator ran)."""
  out = []
  if not facts["info_lines"]:
    out.append("NCCL wrote no INFO lines: no NCCL communicator ran (a CPU run), or NCCL_DEBUG_FILE points"
               " elsewhere" if captured else "no NCCL INFO lines: set NCCL_DEBUG=INFO to record what NCCL did")
    return out
  nets = {n.lower() for n in facts["networks"]}
  if expect_ib and nets and nets <= {"socket"}:
    out.append("NCCL used sockets (NET/Socket) on a machine with InfiniBand ports: check NCCL_IB_HCA, the IB"
               " driver inside the job, or a missing network plugin")
  return out
