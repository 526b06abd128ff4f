"""TPU pods as tori, and collective times predicted on them (JAX-free).

A TPU slice is a 2D or 3D torus of chips (`TorusSlice`): each chip has two ICI ports per dimension (- and +), a
dimension of `side` chips closes into a ring where the kind says it wraps around (`TpuKind.wraps`; on 3D kinds
only in slices of whole cubes), a side of 2 is one link between the two chips, a side of 1 has no link. Several
slices (multislice) are joined by the data-center network (DCN), whose rate is per host and shared by the host's
chips.

Per chip and per direction, a dimension gives `lanes` links' worth of bandwidth (`dim_lanes`): 2 on a ring
(a chip sends half of its data each way round, on both ports), 1 on a line (an end chip has one neighbour, so
everything it must receive comes through one port; a pair is a line of 2). So a line is half as fast as a ring
of the same side.

Predictions (S = nccl-tests' message size, `conventions.py`; n_d = a dimension's side, B = one port's rate per
direction, lanes as above), each a `collectives.Prediction` (time, algorithm, bounding resource, assumptions):
- reduce-scatter / all-gather over the group's dimensions D, XLA:TPU's multi-dimensional form (StrategyND:
  reduce-scatter along each dimension in turn, the data shrinking by n_d each time, all-gather back):
  - `nd` (concurrent, the default): the data is split into |D| colours, colour c visiting the dimensions in
    the order rotated by c, so every dimension's ports carry traffic at once; dimension d carries
    sum_c (S / |D|) / prod(sides visited by c before d) x (n_d - 1)/n_d, over lanes_d x B. The colours' phases
    overlap, so the busiest dimension bounds the time. On equal wrapped sides this is (N-1)/N S / (2|D| B):
    every port of every chip busy, the injection bound.
  - `nd_sequential`: all data along x, then y, then z: sum_d (n_d - 1)/n_d S / prod(earlier sides) / (lanes_d B),
    two ports busy at a time.
  One dimension is the ring (or line) itself: (n-1)/n S / (lanes B). All-reduce is both, 2x the volume.
  XLA:TPU reports the concurrent form (`colors` = |D| or 2|D| with rotated `dim_used`) for large messages, so
  `auto` predicts it (at 1 MiB a chip it may run one colour, where latency dominates).
- all-to-all: each dimension carries its share of uniform traffic under shortest-path routing: a ring
  S x mean distance / (2B), a line its middle link's S x floor(n/2) ceil(n/2) / n / B; the busiest bounds it.
- broadcast: pipelined over edge-disjoint trees, one per port of the root (a corner): S / (sum_d lanes_d B).
- ppermute: a shift by one along the group's first dimension: S / B.
- DCN (the same chip across s slices): every chip of a host runs its own group at once (a scope's groups all
  run), so each gets the host's DCN / chips_per_host; a ring across the slices: the ring volume over that.
- ICI and DCN together (all-reduce, reduce-scatter, all-gather): hierarchical, reduce-scatter over ICI, the
  1/N shard across DCN, all-gather over ICI, one after the other.

Latency: `ici_hop_us` per ICI hop (ring steps: 2(n_d - 1) per dimension for all-reduce, n_d - 1 for
all-gather / reduce-scatter; the diameter for all-to-all and broadcast) and `dcn_step_us` per DCN step
(`conventions.latency_steps`). Both are assumptions with defaults (no published figure), printed with every
prediction.

XLA:TPU's own choice is read from compiled HLO (`xla_algorithms`: emitter, strategy, colours, active
dimensions, sides) and compared with the dimensions the model uses (`xla_dims`).
"""

from __future__ import annotations

import dataclasses
import math
import re

from microbench.fabric import conventions
from microbench.fabric.collective_model import Prediction
from microbench.fabric.conventions import COLLECTIVES
from microbench.fabric.tpu_kinds import TpuKind, kinds

AXES = "xyz"
ICI_HOP_US = 1.0  # assumed: no published per-hop ICI latency
DCN_STEP_US = 20.0  # assumed: no published per-step DCN (Megascale) latency
ALGORITHMS = ("auto", "nd", "nd_sequential")
REDUCTIONS = ("all_reduce", "all_gather", "reduce_scatter")
# XLA:TPU's dimension i is the torus coordinate XLA_DIM_COORD[i] (libtpu of jax 0.10.2: dim 0 = y, 1 = x, 2 = z,
# read from psums over axis pairs of v5p 4x4x8, 4x8x4 and 8x4x4; tests/test_torus.py compiles 4x4x8s again).
XLA_DIM_COORD = (1, 0, 2)


class TorusError(ValueError):
  """A slice, group or collective the torus model can't take; the message says what is allowed."""


@dataclasses.dataclass(frozen=True)
class TorusSlice:
  """`slices` slices of a TPU kind, each `dims` chips along x, y (and z on 3D kinds)."""
  kind: TpuKind
  dims: tuple[int, ...]
  slices: int = 1

  @property
  def chips(self) -> int:
    return math.prod(self.dims)

  @property
  def hosts(self) -> int:
    """Hosts per slice (one JAX process each)."""
    return max(1, self.chips // self.kind.chips_per_host)

  def wraps(self, d: int) -> bool:
    """Whether dimension d closes into a ring. A pair never does (its one link is the whole dimension); on a
    3D kind only a slice of whole cubes does (every side a multiple of `wraparound_from`: v5p's 4x4x4 and
    larger are full 3D tori, 2x2x1 to 2x4x4 meshes), on a 2D kind each side that reaches the pod's."""
    side, kind = self.dims[d], self.kind
    if side <= 2 or not kind.wraps(side):
      return False
    return kind.torus_dims != 3 or all(n % kind.wraparound_from == 0 for n in self.dims)

  def shape_text(self) -> str:
    return "x".join(map(str, self.dims)) + (f",slices:{self.slices}" if self.slices > 1 else "")

  def describe(self) -> tuple[str, ...]:
    k = self.kind
    dims = ", ".join(f"{AXES[d]} {n} ({'ring' if self.wraps(d) else 'no link' if n == 1 else 'line'})"
                     for d, n in enumerate(self.dims))
    out = [f"{k.title} {self.shape_text()}: {self.chips} chips per slice, {self.hosts} hosts of {k.chips_per_host}",
           f"torus {dims}; ICI {k.ici_link_gbytes:g} GB/s per port per direction, {k.ici_ports} ports per chip"]
    if self.slices > 1 and k.dcn_gbytes_per_host is None:
      out.append(f"{self.slices} slices; DCN rate not published for {k.title}")
    elif self.slices > 1:
      out.append(f"{self.slices} slices; DCN {dcn_host_gbytes(self):g} GB/s per host per direction, shared by"
                 f" its {k.chips_per_host} chips")
    return tuple(out)


def make_slice(kind: TpuKind | str, dims: tuple[int, ...] | str, slices: int = 1) -> TorusSlice:
  """A slice of `kind` (a TpuKind or its name) shaped `dims` ((4, 4, 4) or "4x4x4"; 2D kinds: 2 sides)."""
  if isinstance(kind, str):
    if kind.strip().lower() not in kinds():
      raise TorusError(f"unknown TPU kind {kind!r}; kinds: {', '.join(kinds())}")
    kind = kinds()[kind.strip().lower()]
  if isinstance(dims, str):
    if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)*", dims.strip().lower()):
      raise TorusError(f"slice shape {dims!r}: want sides joined by x, e.g. 4x4x4 (3D kinds) or 16x16 (2D)")
    dims = tuple(int(v) for v in dims.strip().lower().split("x"))
  dims = tuple(int(v) for v in dims)
  if len(dims) != kind.torus_dims or min(dims) < 1:
    raise TorusError(f"slice {dims} of {kind.title}: want {kind.torus_dims} positive sides (a"
                     f" {kind.torus_dims}D torus)")
  if slices < 1:
    raise TorusError(f"{slices} slices: want at least 1")
  return TorusSlice(kind, dims, int(slices))


def dim_lanes(slc: TorusSlice, d: int) -> int:
  """Links' worth of bandwidth per chip per direction along dimension d: 2 on a ring (both ports, half the
  data each way), 1 on a line (its end chips have one port), 0 for a side of 1."""
  if slc.dims[d] == 1:
    return 0
  return 2 if slc.wraps(d) else 1


def dcn_host_gbytes(slc: TorusSlice) -> float:
  """A host's DCN, GB/s per direction (the kind's per-chip figure times its chips per host)."""
  gbytes = slc.kind.dcn_gbytes_per_host
  if gbytes is None:
    raise TorusError(f"{slc.kind.title} has no published DCN rate; DCN groups can't be predicted on it")
  return gbytes


def dcn_flow_gbytes(slc: TorusSlice, flows_per_host: int) -> float:
  """What one chip's DCN flow gets when `flows_per_host` of the host's chips send at once."""
  return dcn_host_gbytes(slc) / max(1, flows_per_host)


def bisection_gbytes(slc: TorusSlice) -> float:
  """One slice's bisection, GB/s per direction: the fewest links a cut into two halves crosses (across the
  longest dimension: chips / side rings, each cut twice where it wraps), at one port's rate."""
  cuts = [slc.chips // n * (2 if slc.wraps(d) else 1) for d, n in enumerate(slc.dims) if n > 1]
  return min(cuts, default=0) * slc.kind.ici_link_gbytes


# ------------------------------------------------------------------------------------------------- groups
@dataclasses.dataclass(frozen=True)
class Group:
  """Torus dimensions a group spans whole (0 = x), and whether it also spans the slices (DCN)."""
  axes: tuple[int, ...]
  dcn: bool = False

  def text(self) -> str:
    ici = "".join(AXES[d] for d in self.axes)
    return "+".join(p for p in (ici, "dcn" if self.dcn else "") if p)


def group(slc: TorusSlice, spec: str) -> Group:
  """`x`, `xy`, `xyz` (torus axes), `all` (every axis), `dcn` (the same chip in every slice), `xyz+dcn`."""
  ici, dcn = [], False
  for part in spec.strip().lower().split("+"):
    if part == "dcn":
      dcn = True
    elif part == "all":
      ici.extend(range(len(slc.dims)))
    elif part and all(c in AXES[:len(slc.dims)] for c in part):
      ici.extend(AXES.index(c) for c in part)
    else:
      raise TorusError(f"group {spec!r}: want torus axes of this slice ({AXES[:len(slc.dims)]}), all, dcn,"
                       f" or axes+dcn (e.g. xy, dcn, all+dcn)")
  if len(set(ici)) != len(ici):
    raise TorusError(f"group {spec!r} names an axis twice")
  if dcn and slc.slices < 2:
    raise TorusError(f"group {spec!r} crosses DCN, but {slc.shape_text()} is one slice (give slices >= 2)")
  return Group(tuple(sorted(ici)), dcn)


def ranks(slc: TorusSlice, grp: Group) -> int:
  return math.prod(slc.dims[d] for d in grp.axes) * (slc.slices if grp.dcn else 1)


# -------------------------------------------------------------------------------------------- bandwidth
def _linked(slc: TorusSlice, grp: Group) -> tuple[int, ...]:
  return tuple(d for d in grp.axes if slc.dims[d] > 1)


def reduce_scatter_volumes(slc: TorusSlice, dims: tuple[int, ...], concurrent: bool) -> dict[int, float]:
  """Bytes per chip (per unit of S) each dimension carries in a reduce-scatter over `dims`.

  Concurrent: colour c (1/k of the data) visits the dimensions rotated by c, as XLA's dim_used {0 1 2},
  {1 2 0}, {2 0 1}; sequential: all data along dims[0] first. Each visit moves (n-1)/n of what is left."""
  k = len(dims)
  orders = [dims[c:] + dims[:c] for c in range(k)] if concurrent else [dims]
  share = 1.0 / len(orders)
  out = {d: 0.0 for d in dims}
  for order in orders:
    left = share
    for d in order:
      n = slc.dims[d]
      out[d] += left * (n - 1) / n
      left /= n
  return out


def _us(volume_bytes: float, gbytes: float) -> float:
  return volume_bytes / (gbytes * 1e3)  # 1 GB/s = 1e3 bytes per microsecond


def _ici_terms(slc: TorusSlice, collective: str, dims: tuple[int, ...], s: float,
               algorithm: str) -> dict[str, float]:
  """Bandwidth term per ICI dimension, microseconds."""
  b = slc.kind.ici_link_gbytes
  cap = {d: dim_lanes(slc, d) * b for d in dims}
  name = {d: f"ici_{AXES[d]}" for d in dims}
  if collective in REDUCTIONS:
    vol = reduce_scatter_volumes(slc, dims, concurrent=algorithm != "nd_sequential")
    times = 2 if collective == "all_reduce" else 1  # all-gather mirrors reduce-scatter
    return {name[d]: _us(times * vol[d] * s, cap[d]) for d in dims}
  if collective == "all_to_all":
    out = {}
    for d in dims:
      n = slc.dims[d]
      if slc.wraps(d):  # uniform traffic, shortest way round: both directions of every link equally loaded
        mean_hops = sum(min(o, n - o) for o in range(n)) / n
        out[name[d]] = _us(s * mean_hops / 2, b)
      else:  # the middle link carries every byte from one half to the other
        out[name[d]] = _us(s * (n // 2) * ((n + 1) // 2) / n, b)
    return out
  if collective == "broadcast":
    ports = sum(dim_lanes(slc, d) for d in dims)
    return {name[d]: _us(s, ports * b) for d in dims}
  if collective == "ppermute":
    return {name[dims[0]]: _us(s, b)}
  raise TorusError(f"no torus model for {collective!r}; collectives: {', '.join(COLLECTIVES)}")


def _ici_hops(slc: TorusSlice, collective: str, dims: tuple[int, ...]) -> int:
  if collective in conventions.RING_STEPS and collective != "broadcast":
    return sum(conventions.RING_STEPS[collective] * (slc.dims[d] - 1) for d in dims)
  diameter = sum(slc.dims[d] // 2 if slc.wraps(d) else slc.dims[d] - 1 for d in dims)
  if collective in ("all_to_all", "broadcast"):
    return diameter
  first = dims[0]  # ppermute: the shift's longest path, the line's way back
  return 1 if slc.wraps(first) or slc.dims[first] == 2 else slc.dims[first] - 1


def _dcn_volume(collective: str, s_slices: int, s: float) -> float:
  if collective in ("broadcast", "ppermute"):
    return s
  return conventions.ring_bytes(collective, s_slices, s)


def predict(slc: TorusSlice, collective: str, size_bytes: float, grp: Group, algorithm: str = "auto",
            ici_hop_us: float = ICI_HOP_US, dcn_step_us: float = DCN_STEP_US,
            dcn_flows_per_host: int | None = None) -> Prediction:
  """The time of one `collective` of `size_bytes` over group `grp` of slice `slc`.

  `dcn_flows_per_host`: how many of a host's chips send over DCN at once (default: all of them, as when every
  chip's group runs, a scope's groups)."""
  if collective == "permute":
    collective = "ppermute"
  if collective not in COLLECTIVES:
    raise TorusError(f"no torus model for collective {collective!r}; collectives: {', '.join(COLLECTIVES)}")
  if algorithm not in ALGORITHMS:
    raise TorusError(f"unknown torus algorithm {algorithm!r}; algorithms: {', '.join(ALGORITHMS)}")
  if algorithm != "auto" and collective not in REDUCTIONS:
    raise TorusError(f"algorithm {algorithm} applies to {', '.join(REDUCTIONS)}, not {collective}")
  if not size_bytes > 0:
    raise TorusError(f"message size {size_bytes:g}: give a positive number of bytes")
  dims = _linked(slc, grp)
  if algorithm != "auto" and not dims:
    raise TorusError(f"algorithm {algorithm} runs over ICI dimensions; group {grp.text()} has none (DCN: auto)")
  n = ranks(slc, grp)
  if n < 2:
    raise TorusError(f"group {grp.text() or '(none)'} of {slc.shape_text()} is one chip: it moves nothing")
  if grp.dcn and dims and collective not in REDUCTIONS:
    raise TorusError(f"{collective} over ICI and DCN together is not modelled; over ICI and DCN apart, or"
                     f" {', '.join(REDUCTIONS)} over both")
  s = float(size_bytes)
  terms: dict[str, float] = {}
  latency = 0.0
  assumed = [f"ICI hop {ici_hop_us:g} us (assumed, not published)"]
  if dims:
    terms.update(_ici_terms(slc, collective, dims, s, algorithm))
    latency += _ici_hops(slc, collective, dims) * ici_hop_us
  if grp.dcn:
    flows = dcn_flows_per_host or slc.kind.chips_per_host
    # Hierarchical: the DCN step moves the 1/N shard the ICI reduce-scatter left on each chip.
    shard = s / math.prod(slc.dims[d] for d in dims) if dims else s
    terms["dcn"] = _us(_dcn_volume(collective, slc.slices, shard), dcn_flow_gbytes(slc, flows))
    latency += sum(conventions.latency_steps(collective, slc.slices, slc.slices)) * dcn_step_us
    assumed.append(f"DCN step {dcn_step_us:g} us (assumed, not published)")
    assumed.append(f"{flows} of a host's {slc.kind.chips_per_host} chips send over DCN at once, sharing its"
                   f" {dcn_host_gbytes(slc):g} GB/s")
  ici = {k: v for k, v in terms.items() if k != "dcn"}
  if dims and algorithm == "nd_sequential" and collective in REDUCTIONS:
    ici_time = sum(ici.values())  # one dimension at a time
  else:
    ici_time = max(ici.values(), default=0.0)  # the dimensions' links run at once
  bandwidth = ici_time + terms.get("dcn", 0.0)  # hierarchical: ICI then DCN, not overlapped
  name = _algorithm_name(slc, collective, dims, grp.dcn, algorithm)
  assumed.extend(_assumptions(collective, dims, grp.dcn, algorithm))
  bottleneck = max(terms, key=terms.get) if max(terms.values()) >= latency else "latency"
  return Prediction(collective, name, n, f"{slc.kind.name} {slc.shape_text()} group {grp.text()}", s,
                    latency + bandwidth, latency, bottleneck, terms, tuple(assumed))


def _algorithm_name(slc: TorusSlice, collective: str, dims: tuple[int, ...], dcn: bool, algorithm: str) -> str:
  if collective not in REDUCTIONS:
    ici = {"all_to_all": "dimension-ordered all-to-all", "broadcast": "pipelined trees",
           "ppermute": "neighbour shift"}[collective]
    return "dcn ring" if not dims else ici
  if not dims:
    return "dcn ring"
  if len(dims) == 1:
    ici = "bidirectional ring" if slc.wraps(dims[0]) else "line"
  else:
    ici = "nd sequential" if algorithm == "nd_sequential" else "nd concurrent"
  ici += f" ({''.join(AXES[d] for d in dims)})"
  return f"hierarchical: {ici} + dcn ring" if dcn else ici


def _assumptions(collective: str, dims: tuple[int, ...], dcn: bool, algorithm: str) -> tuple[str, ...]:
  out = ["link-rate bound: ICI ports at their published rate"]
  if collective in REDUCTIONS and len(dims) > 1 and algorithm != "nd_sequential":
    out.append("nd concurrent: one colour per dimension, each starting on its own; colours overlap, the busiest"
               " dimension bounds it")
  if collective == "all_to_all" and dims:
    out.append("uniform all-to-all, shortest-path routing")
  if collective == "broadcast" and dims:
    out.append("root at a corner; pipelined over edge-disjoint trees, one per root port")
  if collective == "ppermute" and dims:
    out.append("a shift by one along the group's first dimension")
  if dcn and dims:
    out.append("hierarchical: ICI reduce-scatter, DCN ring on the shard, ICI all-gather, not overlapped")
  return tuple(out)


def busbw_limit_gbytes(slc: TorusSlice, collective: str, grp: Group, algorithm: str = "auto") -> float:
  """The bus bandwidth the model tends to for large messages (no latency): busbw factor x S / bandwidth term."""
  p = predict(slc, collective, 1e12, grp, algorithm, ici_hop_us=0.0, dcn_step_us=0.0)
  return p.busbw_gbps


def pod_figures(kind: TpuKind | str, dims: tuple[int, ...] | str) -> dict[str, float]:
  """The model's aggregate figures of a slice, in the units Google's TPU pages give (GB/s):
  all-reduce bandwidth per pod (chips x the whole slice's all-reduce busbw), bisection per direction, ICI per
  chip both ways (ports x 2 x a port's rate), DCN per pod (hosts x a host's DCN; 0 where not published)."""
  slc = make_slice(kind, dims)
  grp = Group(tuple(range(len(slc.dims))))
  return {"all_reduce_gbytes": slc.chips * busbw_limit_gbytes(slc, "all_reduce", grp),
          "bisection_gbytes": bisection_gbytes(slc),
          "ici_chip_bidirectional_gbytes": slc.kind.ici_ports * 2 * slc.kind.ici_link_gbytes,
          "dcn_gbytes": slc.hosts * (slc.kind.dcn_gbytes_per_host or 0.0)}


# --------------------------------------------------------------------------------- XLA:TPU's algorithm
@dataclasses.dataclass(frozen=True)
class XlaAlgorithm:
  """What XLA:TPU says about one all-reduce: its `collective_algorithm_config` and the debug text's fields."""
  emitter: str
  strategy: str
  colors: int | None
  num_dims: int | None  # None for a 1D ring strategy, which names no dimensions
  active_dims: str | None  # a bit per XLA dimension, dimension 0 rightmost ("011": XLA dims 0 and 1)
  dim_sizes: tuple[int, ...]
  cores: tuple[tuple[int, ...], ...]  # the sides each colour visits, in its order

  @property
  def sides(self) -> tuple[int, ...]:
    """The group's sides, smallest first (colour 0's, whatever its order)."""
    return tuple(sorted(self.cores[0])) if self.cores else ()


_CONFIG = re.compile(r'"collective_algorithm_config"\s*:\s*\{(.*?)"debug"\s*:\s*"((?:[^"\\]|\\.)*)"')


def parse_xla_algorithm(line: str) -> XlaAlgorithm | None:
  """The algorithm of one HLO instruction line, or None when it carries no collective_algorithm_config."""
  m = _CONFIG.search(line)
  if not m:
    return None
  head, debug = m.group(1), m.group(2)

  def field(pattern: str, text: str) -> str | None:
    f = re.search(pattern, text)
    return f.group(1) if f else None

  cores = field(r"cores:((?:\{[0-9 ]+\},?)+)", debug)
  sizes = field(r"dim_sizes:([0-9,]+)", debug)
  colors, num_dims = field(r"colors:([0-9]+)", debug), field(r"num_dims:([0-9]+)", debug)
  return XlaAlgorithm(
      emitter=field(r'"emitter"\s*:\s*"([^"]*)"', head) or "",
      strategy=field(r'"strategy"\s*:\s*"([^"]*)"', head) or "",
      colors=int(colors) if colors else None, num_dims=int(num_dims) if num_dims else None,
      active_dims=field(r"active_dims:([01]+)", debug),
      dim_sizes=tuple(int(v) for v in sizes.strip(",").split(",")) if sizes else (),
      cores=tuple(tuple(int(v) for v in c.split()) for c in re.findall(r"\{([0-9 ]+)\}", cores or "")))


def xla_algorithms(hlo_text: str) -> list[XlaAlgorithm]:
  """Every all-reduce's (and all-reduce-start's) algorithm in an HLO module's text, in order."""
  out = []
  for line in hlo_text.splitlines():
    if re.search(r"\ball-reduce(-start)?\(", line):
      alg = parse_xla_algorithm(line)
      if alg is not None:
        out.append(alg)
  return out


@dataclasses.dataclass(frozen=True)
class TorusDims:
  """The dimensions the model runs a group's all-reduce on, in XLA:TPU's terms."""
  num_dims: int  # dimensions with links the group spans
  active_dims: str | None  # XLA's mask (dimension 0 rightmost); None for one dimension (a 1D ring)
  sides: tuple[int, ...]  # smallest first


def xla_dims(slc: TorusSlice, grp: Group) -> TorusDims:
  """Which torus dimensions the model's all-reduce over `grp` uses, written as XLA:TPU reports them: XLA's
  dimension i is coordinate XLA_DIM_COORD[i]; a dimension of side 1 counts as spanned (it is whole)."""
  dims = _linked(slc, grp)
  coords = tuple(slc.dims) + (1,) * (3 - len(slc.dims))
  spanned = [c in grp.axes or coords[c] == 1 for c in XLA_DIM_COORD]
  mask = "".join("1" if on else "0" for on in reversed(spanned)) if len(dims) > 1 else None
  return TorusDims(len(dims), mask, tuple(sorted(slc.dims[d] for d in dims)))


def disagreements(model: TorusDims, xla: XlaAlgorithm) -> list[str]:
  """Where XLA:TPU's reported dimensions differ from the model's (empty when they agree)."""
  out = []
  xla_dims_n = xla.num_dims if xla.num_dims is not None else len(xla.cores[0]) if xla.cores else 0
  if xla_dims_n != model.num_dims:
    out.append(f"dimensions: XLA {xla_dims_n} ({xla.strategy}), model {model.num_dims}")
  if model.active_dims != xla.active_dims:
    out.append(f"active_dims: XLA {xla.active_dims}, model {model.active_dims}")
  if xla.sides != model.sides:
    out.append(f"sides: XLA {xla.sides}, model {model.sides}")
  return out
