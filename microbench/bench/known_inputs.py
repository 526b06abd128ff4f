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
- **sum** (all_reduce, reduce_scatter). At element i only K ranks contribute, a window of consecutive ranks
  starting at `(i K) mod n` (`((i + s count) K) mod n` in check run s); the others hold 0. The window's first
  K-1 ranks hold the same value q_i in [1, Q], its last rank `T_i - (K-1) q_i`, so the total is exactly
  `T_i = base + ((i mod ch + f(floor(i / ch)) + 7 g) mod L)`, f(c) = c w (the last chunk moved where that
  would equal the first's), or `base + ((i + 7 g) mod L)` when count is not a multiple of n: positive, never more than HALF (so every partial sum,
  in any order, and the total with any one rank doubled or negated are exact integers of the dtype), with
  L = 2P (P prime) and base = HALF - L + 1. So: the total is never 0 and exceeds every single contribution
  (zero, negated, mean- and max-instead-of-sum outputs are wrong everywhere); neighbouring elements differ
  (a shift by one element is wrong everywhere); with ch = count/n the reduce-scatter chunk and w coprime to L,
  the chunks of any two ranks less than L apart, and of ranks n-1 and 0, differ at every offset (a chunk of
  the neighbouring rank, or two swapped, is wrong everywhere), and groups g < L apart differ too. K = ceil(n / count)
  (at least 2, at most KMAX) makes the windows of one run cover every rank, so a dropped, doubled, negated
  or scaled rank changes some element; where KMAX is too small for that (bfloat16, more than 64 x count
  ranks), `check_runs` more check runs, differently seeded, cover the rest. HALF needs the dtype's full
  precision (float16 totals up to 1024, float32 up to 2^23, int32 up to 2^29), so a reduction in a narrower
  type (float16 in bfloat16, int32 in float32, float32 in a 16-bit type) rounds some element.
- **check runs** (data): in groups larger than the alphabet M (bfloat16 beyond 512 ranks) a second run swaps
  the even- and odd-element rules, so every pair of ranks below M^2 differs at every element in one run.

The expected total of a sum is `T_i` itself (no sum over ranks): the check's host cost no longer grows with
the group. The data family is periodic in i with the prime period P = 65521 (an offset error of exactly a
multiple of P elements is its one blind spot); one period per rank is computed once and tiled, so inputs and
expectations of multi-GiB buffers are built at memcpy speed, one range at a time.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

PERIOD = 65521  # prime: an offset error must be an exact multiple of it to go unseen
ALPHABET = {"float32": 1 << 24, "int32": 1 << 24, "bfloat16": 1 << 9, "float16": 1 << 12,  # M (data)
            "float8_e4m3fn": 1 << 6, "float8_e5m2": 1 << 6}
FP8 = ("float8_e4m3fn", "float8_e5m2")  # data only: XLA:GPU hands no fp8 reduction to NCCL
# Sums: the largest total (a doubled rank, up to 2 HALF, must stay exact), the prime P of the residue modulus
# L = 2P, and the most contributors per element (K - 1 contributions of at least 1 must fit under base).
HALF = {"bfloat16": 1 << 7, "float16": 1 << 10, "float32": 1 << 23, "int32": 1 << 29}
RESIDUE_PRIME = {"bfloat16": 31, "float16": 251, "float32": 1048573, "int32": 67108859}
KMAX = {"bfloat16": 64, "float16": 512, "float32": 4096, "int32": 4096}
KINDS = ("data", "sum", "prod", "max", "min")  # data moves; the others: which reduction the values are for
GROUP_STEP = 7  # residue offset between groups (coprime to every L)
# A value no family's input or correct output holds: the dtype's nearest exact integer below every data letter
# (-M/2), product (-HALF) and extreme, so in float32 and int32 one more or less is still exact (and a data
# letter): what an output buffer holds before a collective writes it (the timed carry's output slot, the
# ragged all-to-all's buffer), so an element the collective fails to write can never hold the right value.
FILL = {"float32": -(1 << 23) - 1, "int32": -(1 << 29) - 1, "bfloat16": -258, "float16": -2050,
        "float8_e4m3fn": -256, "float8_e5m2": -1024}


def as_dtype(values, dtype: str) -> np.ndarray:
  """`values` as a NumPy array of the dtype named `dtype` (16-bit and fp8 types through ml_dtypes, under the
  names jax.numpy gives them); no copy when it already is."""
  return np.asarray(values, np.dtype(getattr(jnp, dtype)))


def _modulus(dtype: str) -> int:
  return 2 * RESIDUE_PRIME[dtype]


def _base(dtype: str) -> int:
  return HALF[dtype] - _modulus(dtype) + 1


def contributors(dtype: str, n: int, count: int | None, kind: str = "sum") -> int:
  """K: ranks contributing at each element of a reduction of `n` ranks over `count` elements per rank (max
  and min: 1, the rank holding the extreme value; any other rank's error is invisible at that element)."""
  if kind in ("max", "min"):
    return 1
  want = 2 if not count else -(-n // count)
  return max(2, min(KMAX[dtype], n, want)) if n >= 2 else 1


def check_runs(kind: str, dtype: str, n: int, count: int | None) -> int:
  """Check runs a point needs so that every single-rank error shows somewhere (see the module docstring)."""
  if kind == "data":
    return 2 if n > ALPHABET[dtype] else 1
  if n < 2 or not count:
    return 1
  return -(-n // (count * contributors(dtype, n, count, kind)))


def chunk_step(dtype: str, n: int, count: int | None) -> tuple[int, int]:
  """(ch, w): the reduce-scatter chunk length and the residue step from one chunk to the next ((0, 0) when
  count is not a multiple of n). w is coprime to L, so two chunks less than L apart differ at every offset,
  and w differs from ch - 1 and from 1 - ch mod L, so the elements on either side of a chunk boundary differ."""
  if not count or n < 2 or count % n:
    return 0, 0
  ch, modulus = count // n, _modulus(dtype)
  w = 1
  while math.gcd(w, modulus) != 1 or (w - (ch - 1)) % modulus == 0 or (w + (ch - 1)) % modulus == 0:
    w += 1
  return ch, w


def data_value(dtype: str, w: np.ndarray) -> np.ndarray:
  """The data family's value of alphabet letter w in [0, M): w - M/2, or for fp8 the w-th of the M
  representable integers nearest zero (fp8 holds every integer only up to 8 or 16)."""
  return _fp8_letters(dtype)[w] if dtype in FP8 else w - ALPHABET[dtype] // 2


@functools.lru_cache(maxsize=None)
def _fp8_letters(dtype: str) -> np.ndarray:
  m = ALPHABET[dtype]
  ints = np.arange(-1024, 1025, dtype=np.int64)
  held = ints[as_dtype(ints, dtype).astype(np.float64) == ints]
  mid = int(np.searchsorted(held, 0))
  return held[mid - m // 2: mid + m // 2]

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


def _hash(m: int, group_index: int, ranks: np.ndarray, j: np.ndarray, run: int = 0, shift: int = 0) -> np.ndarray:
  """w in [0, m) of ranks [R, 1] at period indices j [J] (the data family's bijection; `run` 1 swaps the
  even- and odd-element rules; `shift` moves every letter by that much mod m: with m/2, a second input that
  differs from the first at every element)."""
  a, b, c, d = (k[j] for k in _constants(m))
  lo, hi = ranks % m, (ranks // m) % m
  u = np.where((j + run) % 2 == 0, lo, (hi + c * lo) % m)
  return (a * u + b + d * (group_index % m) + shift) % m


class GroupInputs:
  """The known inputs of one group (`n` ranks, index `group_index` among its scope's groups) in `dtype`, for
  messages of `count` elements per rank (sums: it sets K and the chunk step; None: K = 2, no chunks) and
  check run `run`.

  `rank(r, start, stop)` gives elements [start, stop) of rank r's input, `total(start, stop)` the exact sum
  over the group's ranks, both as int64 (exact in the dtype by construction).
  """

  def __init__(self, kind: str, dtype: str, n: int, group_index: int = 0, count: int | None = None,
               run: int = 0, shift: int = 0):
    if kind not in KINDS:
      raise ValueError(f"unknown input kind {kind!r}: {KINDS}")
    if shift and kind != "data":
      raise ValueError("only the data family has shifted letters")
    self.kind, self.dtype, self.n, self.group_index = kind, dtype, int(n), int(group_index)
    self.count, self.run, self.shift = count, int(run), int(shift)
    self._periods: dict[int, np.ndarray] = {}
    self._cache: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    if kind != "data":
      if dtype in FP8:
        raise ValueError(f"no {kind} inputs in {dtype}: fp8 is checked on data-moving collectives only")
      self.k = contributors(dtype, self.n, count, kind)
      self.chunk, self.step = chunk_step(dtype, self.n, count)
      self.q_max = {"max": _base(dtype) - 2, "min": HALF[dtype]}.get(kind) or max(
          1, (_base(dtype) - 1) // max(1, self.k - 1))

  def chunk_residue(self, c: np.ndarray) -> np.ndarray:
    """f(c): the residue offset of reduce-scatter chunk c, c w mod L, the last chunk moved off the first's
    residue where c w would equal it (sums whose count is a multiple of n)."""
    c, w, modulus = np.asarray(c, np.int64), self.step, _modulus(self.dtype)
    f = (c * w) % modulus
    if (self.n - 1) * w % modulus == 0:
      f = np.where(c == self.n - 1, (-2 * w) % modulus, f)
    return f

  def target(self, i: np.ndarray) -> np.ndarray:
    """T_i: the exact total at elements i (sums)."""
    i = np.asarray(i, np.int64)
    residue = i
    if self.chunk:  # offset in the chunk + the chunk's step
      residue = i % self.chunk + self.chunk_residue(i // self.chunk)
    return _base(self.dtype) + (residue + GROUP_STEP * self.group_index) % _modulus(self.dtype)

  def _rule(self, i: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(window start, free value q, last value) at elements i: what every rank's value there follows from."""
    offset = self.run * (self.count or 0)
    start = ((i + offset) * self.k) % self.n
    h = _constants(1 << 24)[0][(i + 977 * self.group_index) % PERIOD]
    q = 1 + h % self.q_max
    return start, q, self.target(i) - (self.k - 1) * q

  def _rule_range(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule over elements [a, b), from a cache of the whole message when it is at most _CACHED long (the
    group's ranks all read the same rule)."""
    if self.count and self.count <= _CACHED and 0 <= a <= b <= self.count:
      if self._cache is None:
        self._cache = self._whole_rule()
      return tuple(x[a:b] for x in self._cache)
    return self._rule(np.arange(a, max(a, b), dtype=np.int64))

  def _whole_rule(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_rule` over the whole message in int32, from its periodic parts tiled at memcpy speed: the window
    start repeats every n elements, q every PERIOD, T every L (or chunk by chunk): the same values (tests
    compare them) several times faster for multi-MiB messages."""
    count, n, k = self.count, self.n, self.k
    offset = self.run * count
    start = _repeat((((np.arange(n, dtype=np.int64) + offset) * k) % n).astype(np.int32), count)
    h = _constants(1 << 24)[0][(np.arange(min(PERIOD, count)) + 977 * self.group_index) % PERIOD]  # no more than used
    q = _repeat((1 + h % self.q_max).astype(np.int32), count)
    modulus, g = _modulus(self.dtype), GROUP_STEP * self.group_index
    if self.chunk:
      f = self.chunk_residue(np.arange(n))
      residue = (np.arange(self.chunk, dtype=np.int64)[None, :] + (f + g)[:, None]) % modulus
      target = (_base(self.dtype) + residue).astype(np.int32).reshape(-1)
    else:
      period = min(modulus, count)  # L is up to 1.3e8 (int32): never build more than the message
      target = _repeat((_base(self.dtype) + (np.arange(period, dtype=np.int64) + g) % modulus).astype(np.int32),
                       count)
    return start, q, target - np.int32(self.k - 1) * q

  def sum_at(self, ranks: np.ndarray, i: np.ndarray) -> np.ndarray:
    """Reductions: the values of `ranks` at elements `i`, broadcast against each other (any shapes)."""
    ranks, i = np.asarray(ranks, np.int64), np.asarray(i, np.int64)
    return self._values_from(ranks, *self._rule(i))

  def _values_from(self, ranks, start, q, last) -> np.ndarray:
    """Each rank's value from its slot in the element's window (see the module docstring, per kind)."""
    if np.ndim(ranks) == 0:
      ranks = np.asarray(ranks, np.asarray(start).dtype)  # int32 rules stay int32
    slot = (ranks - start) % self.n
    k = self.k
    if self.kind == "sum":  # K-1 ranks hold q, the last T - (K-1) q, the others 0
      return np.where(slot < k - 1, q, np.where(slot == k - 1, last, 0))
    target = last + (k - 1) * q
    if self.kind == "prod":  # K-2 ranks hold -1, one 2, the last +-T (product 2T), the others 1
      sign = 1 - 2 * ((k - 2) % 2)
      return np.where(slot < k - 2, -1, np.where(slot == k - 2, 2, np.where(slot == k - 1, sign * target, 1)))
    if self.kind == "max":  # one rank holds T, the others 1 + q in [2, base - 1] (below every T)
      return np.where(slot == 0, target, 1 + q)
    return np.where(slot == 0, target, HALF[self.dtype] + q)  # min: the others in [HALF + 1, 2 HALF]

  def reduced(self, start: int, stop: int) -> np.ndarray:
    """The exact result of the kind's reduction over the group at elements [start, stop) (int64)."""
    total = self.total(start, stop)
    return 2 * total if self.kind == "prod" else total

  def values(self, ranks: np.ndarray, i: np.ndarray) -> np.ndarray:
    """[len(ranks), len(i)] values of the given ranks at elements i (data: period indices)."""
    ranks = np.asarray(ranks, np.int64).reshape(-1, 1)
    i = np.asarray(i, np.int64)
    if self.kind != "data":
      return self.sum_at(ranks, i)
    m = ALPHABET[self.dtype]
    return data_value(self.dtype, _hash(m, self.group_index, ranks, i, self.run, self.shift))

  def rank(self, r: int, start: int, stop: int) -> np.ndarray:
    if self.kind != "data":
      return self._values_from(np.int64(r), *self._rule_range(start, stop))
    if stop - start <= _DIRECT:
      return self.values([r], np.arange(start, max(start, stop)) % PERIOD)[0]
    if r not in self._periods:
      if len(self._periods) >= 64:  # big groups: keep host memory bounded
        self._periods.clear()
      self._periods[r] = self.values([r], np.arange(PERIOD))[0]
    return _tile(self._periods[r], start, stop)

  def total(self, start: int, stop: int) -> np.ndarray:
    """The exact sum over the group's ranks of elements [start, stop) (reductions: T itself, computed
    directly; `reduced` gives the kind's result)."""
    if self.kind != "data":
      start_, q, last = self._rule_range(start, stop)
      return last + (self.k - 1) * q
    return self.values(np.arange(self.n), np.arange(start, max(start, stop)) % PERIOD).sum(axis=0)


_DIRECT = 4096  # data ranges up to this long are computed directly instead of from a cached period
_CACHED = 1 << 22  # sums: messages up to this many elements per rank keep their rule (3 x 4 B per element)


@functools.lru_cache(maxsize=16)
def group_inputs(kind: str, dtype: str, n: int, group_index: int, count: int | None = None,
                 run: int = 0, shift: int = 0) -> GroupInputs:
  """Shared across points: a period is computed once per run."""
  return GroupInputs(kind, dtype, n, group_index, count, run, shift)


def alt_shift(dtype: str) -> int:
  """The letter shift of a data family's second input (M/2): every element differs from the first's."""
  return ALPHABET[dtype] // 2


def _repeat(pattern: np.ndarray, count: int) -> np.ndarray:
  """`pattern` repeated to `count` elements (np.resize concatenates one copy per repeat: slow for short
  patterns; np.tile copies in one go)."""
  return np.tile(pattern, -(-count // len(pattern)))[:count]


def _tile(period: np.ndarray, start: int, stop: int) -> np.ndarray:
  count = max(0, stop - start)
  s = start % PERIOD
  return np.resize(np.concatenate([period[s:], period[:s]]), count)
