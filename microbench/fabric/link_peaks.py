"""Link peaks per fabric level, and the bus bandwidth they allow a collective over a scope.

"How close to the hardware" needs a denominator. Each level of the machine has a link with a peak in
GB/s per direction per rank: `scale_up` (inside a node: NVLink), `rack_scale` (between the nodes of one
rack: an NVLink domain such as NVL72, else the same NICs as scale_out) and `scale_out` (between nodes:
one NIC per GPU). The peaks come from the device kind (NVLink generation) or from
`--link_peaks=scale_up:450,scale_out:ndr`; a level without one has no peak, and no share is claimed.

Levels are physical links, not mesh axes. A GPU has its NVLink ports and its NIC, nothing else: inside an
NVLink domain that spans the rack (`rack_scale` given as an NVLink, as the GB200/GB300 NVL72 kinds and the
`nvl72` fabric do), a GPU reaches the GPUs of its own tray and of the other trays through the same 18 links
into the same switch trays, so the node and gpu axes are ONE level at that link's rate (the whole rack is a
flat fabric of 72 GPUs), never two levels that overlap; axes over the same NICs (nodes and racks without an
NVLink rack_scale) are one level likewise. Only distinct links (NVLink and NIC) overlap.

A scope whose groups cross several levels (rack_scale without NVL72, global) gets the busbw its links allow
when every level runs at its peak and the levels overlap (an upper bound): for ring-style collectives level i
costs (D_i - 1) / (D_i * P_i * W_i) per byte, where D_i is the group's extent at that level, P_i the number
of group ranks inside one unit of the level below (each with its own link) and W_i the link peak; the bound
is (n - 1) / n over the largest cost. This is why busbw over a hierarchy can exceed the slowest link: it is a
flat-fabric equivalent (docs/measuring.md, "How close to the hardware"); it never exceeds the sum of the distinct
links a GPU has (NVLink + NIC), and within one link (one NVLink domain, one NIC rail) never that link's rate.

Each peak assumes an algorithm (`ALGORITHMS`, and `peak_algorithm` in a record): ring or hierarchical ring
for all-reduce, all-gather and reduce-scatter, direct copies (each rank's shard straight to each peer) for
all-to-all, a pipelined chain for broadcast, one copy per rank for ppermute; all without in-network
reduction. An all-reduce through NVLink SHARP (NVLS, NVSwitch reduces in the switch: each GPU sends and
receives S once) or InfiniBand SHARP can legitimately exceed its bound in busbw, by up to 2(n-1)/n. For the
other collectives in-network reduction does not help: every rank still receives (all-gather, all-to-all,
broadcast) or sends (reduce-scatter) its share of the data over its own links, so no algorithm takes their
busbw past the rate of the links a GPU has (tests/test_gpu_facts.py checks every bound against that).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from microbench.fabric import gpu_kinds

LEVELS = ("scale_up", "rack_scale", "scale_out")

# name -> (GB/s per direction per rank, what it is, where the figure comes from)
LINKS: dict[str, tuple[float, str, str]] = {
    "nvlink3": (300.0, "NVLink 3 (A100 SXM): 12 links x 25 GB/s per direction, 600 GB/s bidirectional per GPU",
                "NVIDIA NVLink page (A100: twelve third-generation links, 600 GB/s total)"),
    "nvlink4": (450.0, "NVLink 4 (H100/H200/GH200): 18 links x 25 GB/s per direction, 900 GB/s bidirectional per GPU",
                "NVIDIA Hopper architecture page (900 GB/s bidirectional per GPU)"),
    "nvlink5": (900.0, "NVLink 5 (B200/GB200/B300/GB300): 18 links x 50 GB/s per direction, 1.8 TB/s bidirectional"
                " per GPU",
                "NVIDIA NVLink page (Blackwell: 18 links of 100 GB/s both ways, 1.8 TB/s total)"),
    "edr": (12.5, "InfiniBand EDR, 100 Gb/s per port", "InfiniBand data rates (EDR 4x 25 Gb/s lanes)"),
    "hdr100": (12.5, "InfiniBand HDR100, 100 Gb/s per port (Leonardo: one per GPU)",
               "Leonardo's booster nodes: 2 dual-port HDR100 cards for 4 GPUs (unverified)"),
    "hdr": (25.0, "InfiniBand HDR, 200 Gb/s per port", "NVIDIA Quantum HDR (200 Gb/s ports)"),
    "ndr200": (25.0, "InfiniBand NDR200, 200 Gb/s per port (JUPITER)", "NVIDIA Quantum-2 (NDR200 split ports)"),
    "ndr": (50.0, "InfiniBand NDR, 400 Gb/s per port", "NVIDIA Quantum-2 / ConnectX-7 (400 Gb/s ports)"),
    "xdr": (100.0, "InfiniBand XDR, 800 Gb/s per port (ConnectX-8)", "NVIDIA Quantum-X800 (800 Gb/s ports)"),
    "xgmi": (50.0, "AMD Infinity Fabric between MI250X GCDs (50 GB/s per direction between packages)",
             "AMD CDNA2 white paper: 50-100 GB/s per direction between GCDs (unverified; the slowest pair)"),
    "slingshot11": (25.0, "HPE Slingshot-11, 200 Gb/s per NIC (Cassini)",
                    "HPE Slingshot: 64-port 200 Gb/s Rosetta switches, 200G Cassini NICs (ALCF Aurora docs)"),
}

# Links a rack_scale figure can name that are NICs: a rack whose nodes talk over a network of their own rate.
# Any other rack_scale figure (an NVLink name, or a number) is an NVLink domain spanning the rack, reached over
# the same per-GPU links as scale_up (docs/measuring.md: rack_scale models an NVLink domain such as NVL72).
NIC_LINKS = ("edr", "hdr100", "hdr", "ndr200", "ndr", "xdr", "slingshot11")

# The algorithm each bus_peak assumes, per collective (a record's `peak_algorithm`).
ALGORITHMS: dict[str, str] = {
    "all_reduce": "ring (hierarchical ring across levels), no in-network reduction; an NVLS/SHARP all-reduce"
                  " (the switch reduces) can exceed this bound, by up to 2(n-1)/n",
    "all_gather": "ring (hierarchical ring across levels); in-network reduction does not raise it: every rank"
                  " must receive (n-1)/n of the data over its own links",
    "reduce_scatter": "ring (hierarchical ring across levels); in-network reduction does not raise it: every rank"
                      " must send (n-1)/n of the data over its own links",
    "all_to_all": "direct copies: each rank's shard straight to each peer, every level's share at its link",
    "broadcast": "pipelined chain: each unit's ranks bring the data in over their own links",
    "ppermute": "one direct copy per rank to its neighbour, on the rank's own link",
}

# NVLink per device kind comes from the GPU kinds table (microbench.fabric.gpu_kinds: exact CUDA names first,
# then the kind's short name as a substring, longest first so "gh200" wins over "h200"). NICs are not visible
# from the device kind, and an NVLink domain spanning nodes is only known from the kind (NVL72 racks) or to
# the person who set --nodes_per_rack. PCIe and NVL (bridge) variants get no NVLink default.
_NO_NVLINK_DEFAULT = ("pcie", " nvl")


def _kind_links(device_kind: str) -> dict[str, str]:
  kind = gpu_kinds.lookup(device_kind)
  if kind is None:
    lower = device_kind.lower()
    named = sorted((k for k in gpu_kinds.kinds().values() if k.nvlink), key=lambda k: -len(k.name))
    kind = next((k for k in named if k.name in lower), None)
  if kind is None or not kind.nvlink:
    return {}
  return {"scale_up": kind.nvlink, **({"rack_scale": kind.rack_nvlink} if kind.rack_nvlink else {})}


# Which level each mesh axis crosses (microbench.meshes.topology's rack x node x gpu), inner to outer.
AXIS_LEVEL = {"gpu": "scale_up", "node": "rack_scale", "rack": "scale_out"}
AXIS_ORDER = ("gpu", "node", "rack")


class LinkPeakError(ValueError):
  """A --link_peaks value that can't be used; the message says what is allowed."""


@dataclasses.dataclass(frozen=True)
class LevelPeak:
  gbps: float
  link: str  # e.g. "nvlink4", "ndr", "450 GB/s"
  source: str  # where the figure came from: the device kind, --link_peaks, or another level


def parse(text: str | None) -> dict[str, LevelPeak]:
  """`scale_up:450,scale_out:ndr` -> peaks per level (numbers in GB/s per direction per rank, or a link name)."""
  out: dict[str, LevelPeak] = {}
  if not text:
    return out
  for item in text.split(","):
    level, sep, value = item.strip().partition(":")
    if not sep or level not in LEVELS:
      raise LinkPeakError(f"--link_peaks item {item.strip()!r}: expected LEVEL:VALUE with LEVEL one of"
                          f" {', '.join(LEVELS)}, e.g. scale_up:450,scale_out:ndr")
    value = value.strip().lower()
    if value in LINKS:
      out[level] = LevelPeak(LINKS[value][0], value, "--link_peaks")
      continue
    try:
      gbps = float(value)
    except ValueError:
      gbps = float("nan")
    if not math.isfinite(gbps) or gbps <= 0:
      raise LinkPeakError(f"--link_peaks {level}:{value}: give GB/s per direction per rank (a positive"
                          f" number) or a link name: {', '.join(LINKS)}")
    out[level] = LevelPeak(gbps, f"{gbps:g} GB/s", "--link_peaks")
  return out


def resolve(device_kind: str, overrides: Mapping[str, LevelPeak] | None = None) -> dict[str, LevelPeak]:
  """Peaks per level for this device kind, with `overrides` (from --link_peaks) taking precedence."""
  peaks: dict[str, LevelPeak] = {}
  if not any(s in device_kind.lower() for s in _NO_NVLINK_DEFAULT):
    for level, link in _kind_links(device_kind).items():
      peaks[level] = LevelPeak(LINKS[link][0], link, f"default for {device_kind}")
  peaks.update(overrides or {})
  return peaks


def describe(peaks: Mapping[str, LevelPeak]) -> dict[str, dict[str, object] | None]:
  """meta.json's view: every level, null where unknown (rack_scale says when it uses scale_out's NICs)."""
  out: dict[str, dict[str, object] | None] = {}
  for level in LEVELS:
    p = peaks.get(level)
    if p is None and level == "rack_scale" and "scale_out" in peaks:
      out[level] = {"gbps": peaks["scale_out"].gbps, "link": peaks["scale_out"].link,
                    "source": "same NICs as scale_out (no rack_scale peak given)"}
    else:
      out[level] = None if p is None else dataclasses.asdict(p)
  return out


def nvlink_rack(peaks: Mapping[str, LevelPeak]) -> bool:
  """Whether rack_scale is an NVLink domain spanning the rack: then a GPU reaches every GPU of the rack,
  in its tray or another, over the same links into the same switches, so gpus and nodes are one level."""
  p = peaks.get("rack_scale")
  return p is not None and p.link not in NIC_LINKS


def _levels(axes: Sequence[str], extents: Mapping[str, int],
            peaks: Mapping[str, LevelPeak]) -> list[tuple[int, float | None]]:
  """(extent, GB/s) per physical link the scope's groups cross, inner to outer: axes over the same link are
  one level (nodes and racks over the same NICs; gpus and nodes inside one rack-wide NVLink domain, at the
  slower of the two figures given for those links)."""
  one_domain = nvlink_rack(peaks)
  domain = min(peaks[lv].gbps for lv in ("scale_up", "rack_scale") if lv in peaks) if one_domain else None
  levels: list[tuple[str, int, float | None]] = []
  for axis in AXIS_ORDER:
    d = int(extents.get(axis, 1))
    if axis not in axes or d < 2:
      continue
    level = AXIS_LEVEL[axis]
    if level == "rack_scale" and level not in peaks:
      level = "scale_out"  # no NVLink domain across nodes was given: the nodes of a rack talk over NICs
    if one_domain and level in ("scale_up", "rack_scale"):
      level, w = "nvlink_domain", domain
    else:
      w = peaks[level].gbps if level in peaks else None
    if levels and levels[-1][0] == level:
      levels[-1] = (level, levels[-1][1] * d, w)
    else:
      levels.append((level, d, w))
  return [(d, w) for _, d, w in levels]


def bus_peak(collective: str, axes: Sequence[str], extents: Mapping[str, int],
             peaks: Mapping[str, LevelPeak]) -> float | None:
  """The highest busbw (GB/s) the links allow `collective` over groups spanning `axes` of a mesh with
  `extents` per axis, or None when a crossed level has no peak (or the collective has no model here). The
  algorithm it assumes is ALGORITHMS[collective] (no in-network reduction: see the module docstring)."""
  levels = _levels(axes, extents, peaks)
  if not levels or any(w is None for _, w in levels):
    return None
  n = math.prod(d for d, _ in levels)
  inner = [math.prod(d for d, _ in levels[:i]) for i in range(len(levels))]  # P_i
  if collective in ("all_reduce", "all_gather", "reduce_scatter"):
    cost = max((d - 1) / (d * p * w) for (d, w), p in zip(levels, inner))
    return (n - 1) / n / cost
  if collective == "all_to_all":  # the share of each rank's data that leaves its unit at each level
    return (n - 1) / max(p * (d - 1) / w for (d, w), p in zip(levels, inner))
  if collective == "broadcast":  # every rank receives S; a unit's P ranks bring it in through their links
    return min(p * w for (_, w), p in zip(levels, inner))
  if collective == "ppermute":  # rank i sends to i+1: one rank per unit crosses each level, on its own link
    return min(w for _, w in levels)
  return None


def share(busbw_gbps: float, peak_gbps: float | None, collective: str | None = None) -> dict[str, object]:
  """The record fields: the peak and busbw as a percentage of it (null without a peak), and, given the
  collective, `peak_algorithm`: the algorithm the peak assumes (ALGORITHMS)."""
  algo = {} if collective is None else {"peak_algorithm": ALGORITHMS.get(collective)}
  if peak_gbps is None or not peak_gbps > 0:
    return {"peak_gbps": None, "busbw_pct_of_peak": None, **algo}
  return {"peak_gbps": peak_gbps, "busbw_pct_of_peak": 100.0 * busbw_gbps / peak_gbps, **algo}
