"""The bus bandwidth a TPU pod's links allow a collective over a scope: busbw's denominator on TPUs.

A GPU scope crosses fabric levels with one link each (microbench.fabric.link_peaks); a TPU scope runs on a torus,
where what the links allow depends on which dimensions the group spans, whether they wrap around, and whether
it crosses slices over the data-center network. The torus model (microbench.fabric.torus) gives that bound:
its prediction for a very large message without latency, for the group each scope of `microbench.meshes.tpu_slice` forms
(a host's block, one dimension's ring, the whole slice, the same chip across slices, or all of them).
"""

from __future__ import annotations

from collections.abc import Mapping

from microbench.meshes import tpu_slice
from microbench.fabric import torus, tpu_kinds

# scope -> the torus group it forms (torus.group's spec; `host` is a slice of one host's block)
PEAK_ALGORITHM = "torus model (microbench.fabric.torus): both directions of each spanned ring, dimensions at once"
_GROUP = {"ici_x": "x", "ici_y": "y", "ici_z": "z", "slice": "all", "dcn": "dcn", "global": "all+dcn", "host": "all"}


def is_tpu_mesh(axis_names) -> bool:
  return tuple(axis_names) == tpu_slice.AXES


def scope_peak(collective: str, scope: str, extents: Mapping[str, int], device_kind: str) -> float | None:
  """The highest busbw (GB/s) the torus allows `collective` over `scope` on a TPU mesh with `extents` per axis,
  None where the kind is unknown, the model has no form for it, or the scope is degenerate."""
  kind = tpu_kinds.lookup(device_kind)
  spec = _GROUP.get(scope)
  if kind is None or spec is None:
    return None
  dims = tuple(extents[f"{a}_host"] * extents[f"{a}_chip"] for a in "xyz")
  if scope == "host":
    dims = tuple(extents[f"{a}_chip"] for a in "xyz")
  slices = extents["slice"] if scope in ("dcn", "global") else 1
  if scope == "global" and slices < 2:
    spec = "all"
  try:
    slc = torus.make_slice(kind, dims[:kind.torus_dims], slices)
    grp = torus.group(slc, spec)
    if torus.ranks(slc, grp) < 2:
      return None
    return torus.busbw_limit_gbytes(slc, collective, grp)
  except torus.TorusError:
    return None
