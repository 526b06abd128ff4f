"""The inputs every correctness check runs on: integers chosen so that any misrouting or arithmetic error shows.

Two families, both exact in every dtype, so every comparison is exact (no tolerance):

- **data** (all_gather, all_to_all, broadcast, ppermute: data only moves). Element i of group rank r in group
  g is `w - M/2` with `w = (A_j u + B_j + D_j g) mod M`, `j = i mod P`, where M is the dtype's exact integer
  alphabet (2^9 for bfloat16, 2^12 for float16, 2^24 for float32 and int32) and the per-element constants
  (A_j, C_j odd) come from a fixed hash of j. `u` is r's low base-M digit on even j and
  `(high digit + C_j * low digit) mod M` on odd j. So, at every element, `r -> w` is a bijection over ranks
  below M: **every pair of ranks differs at every element** in groups up to M ranks (512 in bfloat16), and in
  larger groups (up to M^2 = 262144 in bfloat16) every pair differs in at least one of any three consecutive
  elements. The constants change pseudo-randomly with j, so no rank's data is a shifted copy of another's (or
  of its own) at any offset below P.
- **sum** (all_reduce, reduce_scatter). Every partial sum of any subset of ranks must be exact in the dtype,
  whatever order the reduction runs in. With E the dtype's largest exact integer (2^8 bfloat16, 2^11
  float16, 2^24 float32 and int32 here) and V = E // n, every rank contributes a non-zero value in
  [-V, V] at every element: a missing or doubled rank changes every element. Where V < 1 (more ranks than E,
  e.g. bfloat16 beyond 256), rank r contributes +-1 only where `(r + j) mod m == 0` with m = ceil(n / E), so
  no element has more than E contributors and every rank still contributes at one element in m. Exact
  inputs therefore exist for every group size; the check never needs a tolerance.

Everything is periodic in i with the prime period P = 65521 (an offset error of exactly a multiple of P
elements is the one blind spot; chunk offsets are multiples of group sizes and powers of two). One period
per rank is computed once and tiled, so inputs and expectations of multi-GiB buffers are built at memcpy
speed, one range at a time.
"""

from __future__ import annotations

import functools

import numpy as np

PERIOD = 65521  # prime: an offset error must be an exact multiple of it to go unseen
ALPHABET = {"float32": 1 << 24, "int32": 1 << 24, "bfloat16": 1 << 9, "float16": 1 << 12}  # M (data)
EXACT = {"float32": 1 << 24, "int32": 1 << 24, "bfloat16": 1 << 8, "float16": 1 << 11}     # E (sums)
KINDS = ("data", "sum")


def _mix(v: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser on uint64: a fixed, well-spread hash of the element index."""
  v = (v + np.uint64(0x9E3779B97F4A7C15))
  v = (v ^ (v >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  v = (v ^ (v >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return v ^ (v >> np.uint64(31))


@functools.lru_cache(maxsize=8)
def _constants(m: int) -> tuple[np.ndarray, ...]:
  """Per-element constants A (odd), B, C (odd), D, each in [0, m), for one period."""
  j = np.arange(PERIOD, dtype=np.uint64) * np.uint64(4)
  with np.errstate(over="ignore"):
    a, b, c, d = (_mix(j + np.uint64(k)) for k in range(4))
  mask = np.uint64(m - 1)
  return tuple((x & mask).astype(np.int64) | odd for x, odd in ((a, 1), (b, 0), (c, 1), (d, 0)))


def _hash(m: int, group_index: int, ranks: np.ndarray, j: np.ndarray) -> np.ndarray:
  """w in [0, m) of ranks [R, 1] at period indices j [J] (the bijective part of the module docstring)."""
  a, b, c, d = (k[j] for k in _constants(m))
  lo, hi = ranks % m, (ranks // m) % m
  u = np.where(j % 2 == 0, lo, (hi + c * lo) % m)
  return (a * u + b + d * (group_index % m)) % m


class GroupInputs:
  """The known inputs of one group (`n` ranks, index `group_index` among its scope's groups) in `dtype`.

  `rank(r, start, stop)` gives elements [start, stop) of rank r's input, `total(start, stop)` the exact sum
  over the group's ranks, both as int64 (exact in the dtype by construction). Short ranges are computed
  directly; long ones tile one cached period.
  """

  def __init__(self, kind: str, dtype: str, n: int, group_index: int = 0):
    if kind not in KINDS:
      raise ValueError(f"unknown input kind {kind!r}: {KINDS}")
    self.kind, self.dtype, self.n, self.group_index = kind, dtype, int(n), int(group_index)
    self._periods: dict[int, np.ndarray] = {}
    self._total: np.ndarray | None = None

  @property
  def magnitude(self) -> int:
    """Largest |value| any rank contributes (sum inputs) or holds (data inputs)."""
    if self.kind == "data":
      return ALPHABET[self.dtype] // 2
    return max(1, EXACT[self.dtype] // self.n)

  def values(self, ranks: np.ndarray, j: np.ndarray) -> np.ndarray:
    """[len(ranks), len(j)] values of the given ranks at period indices j."""
    ranks = np.asarray(ranks, np.int64).reshape(-1, 1)
    j = np.asarray(j, np.int64)
    if self.kind == "data":
      m = ALPHABET[self.dtype]
      return _hash(m, self.group_index, ranks, j) - m // 2
    w = _hash(ALPHABET["float32"], self.group_index, ranks, j)
    sign = np.where(w & 1, 1, -1)
    limit = EXACT[self.dtype] // self.n
    if limit >= 1:
      return sign * (1 + (w >> 1) % limit)
    stride = -(-self.n // EXACT[self.dtype])  # m = ceil(n / E) ranks share each +-1 slot
    return np.where((ranks + j) % stride == 0, sign, 0)

  def rank(self, r: int, start: int, stop: int) -> np.ndarray:
    if stop - start <= _DIRECT:
      return self.values([r], np.arange(start, max(start, stop)) % PERIOD)[0]
    if r not in self._periods:
      if len(self._periods) >= 64:  # big groups: keep host memory bounded
        self._periods.clear()
      self._periods[r] = self.values([r], np.arange(PERIOD))[0]
    return _tile(self._periods[r], start, stop)

  def total(self, start: int, stop: int) -> np.ndarray:
    if stop - start <= _DIRECT and self._total is None:
      return self._sum(np.arange(start, max(start, stop)) % PERIOD)
    if self._total is None:
      self._total = self._sum(np.arange(PERIOD))
    return _tile(self._total, start, stop)

  def _sum(self, j: np.ndarray) -> np.ndarray:
    acc = np.zeros(len(j), np.int64)
    block = max(1, (1 << 22) // max(1, len(j)))  # ranks per step: host memory stays bounded
    for r0 in range(0, self.n, block):
      acc += self.values(np.arange(r0, min(self.n, r0 + block)), j).sum(axis=0)
    return acc


_DIRECT = 4096  # ranges up to this long are computed directly instead of from a cached period


@functools.lru_cache(maxsize=32)
def group_inputs(kind: str, dtype: str, n: int, group_index: int) -> GroupInputs:
  """Shared across points: a period (and a group's sum) is computed once per run."""
  return GroupInputs(kind, dtype, n, group_index)


def _tile(period: np.ndarray, start: int, stop: int) -> np.ndarray:
  count = max(0, stop - start)
  s = start % PERIOD
  return np.resize(np.concatenate([period[s:], period[:s]]), count)
