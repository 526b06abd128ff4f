"""Send sizes of the ragged all-to-all: who sends how many elements to whom, as a mixture of experts routes
tokens (one expert per rank: a rank's "tokens" are the elements of its send buffer).

Each distribution gives integer weights w[r][d] (source r, destination d); rank r's `count` elements are
split over destinations by cumulative rounding (destination d gets floor(count W_d / W) - floor(count W_{d-1}
/ W), W_d the running sum of r's weights), so every rank sends exactly `count` elements, its own share
included, and the sizes are a deterministic function of (distribution, n, count): every rank builds the same
tables and indexes them by `axis_index` inside shard_map, with no size exchange.

- `uniform`: every weight 1 (with n | count, the plain all-to-all's split).
- `skewed`: Zipf(1) over destinations (destination d weighted 1/(d+1): the first experts popular), times a
  per-pair factor 16..32 so that sources split differently (no two alike up to 17 ranks).
- `hot_expert`: 3/4 of every rank's elements go to one rank (n // 2, not rank 0, whose special cases hide
  bugs), the rest spread over the others with factors 1..3.
- `empty_sends`: the pairs with (2r + d) mod 3 = 2 send nothing (up to a third of every row, never a whole
  row), the others factors 1..4.

The layout (`Layout`): rank r reads its run for d at input_offsets[r][d] (runs in destination order), and
writes it into d's output at output_offsets[r][d] = the sizes earlier sources send to d (runs in source
order, packed from 0, as an MoE receiver groups its tokens). Every output holds n x the largest single run
(`out_count`): at least the largest receive, and the padded layout of a dense all-to-all, which is how XLA:CPU
(no ragged-all-to-all) runs it. Elements past a rank's received total are left as the output buffer had
them (zeros: the buffer the op is given).
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction

import numpy as np

DISTRIBUTIONS = ("uniform", "skewed", "hot_expert", "empty_sends")
HOT_SHARE = Fraction(3, 4)


def weights(dist: str, n: int) -> np.ndarray:
  """[n, n] int64: source r's weight for destination d (every row has a positive weight)."""
  if dist not in DISTRIBUTIONS:
    raise ValueError(f"unknown send-size distribution {dist!r}: choose from {', '.join(DISTRIBUTIONS)}")
  r, d = np.meshgrid(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64), indexing="ij")
  if dist == "uniform":
    return np.ones((n, n), np.int64)
  if dist == "skewed":
    return (720720 // (d + 1)) * (16 + (37 * r + 11 * d + 7 * r * d) % 17)  # 720720 = lcm(1..16)
  if dist == "hot_expert":
    if n == 1:
      return np.ones((1, 1), np.int64)
    hot = n // 2
    cold = 1 + (r + 2 * d) % 3  # 1..3
    cold = np.where(d == hot, 0, cold)
    cold_sum = cold.sum(axis=1, keepdims=True)
    # hot / (hot + cold_sum) = 3/4: hot = 3 cold_sum
    return np.where(d == hot, 3 * cold_sum, cold)
  return np.where((2 * r + d) % 3 == 2, 0, 1 + (r + 3 * d) % 4)


def split(w: np.ndarray, count: int) -> np.ndarray:
  """Rows of weights -> [n, n] sizes summing to `count` per row (cumulative floor rounding)."""
  run = np.cumsum(w, axis=1)
  total = run[:, -1:]
  bounds = (count * run) // total
  return np.diff(np.concatenate([np.zeros_like(total), bounds], axis=1), axis=1)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The send sizes of one (distribution, n, count) and the offsets derived from them, [source, destination]."""
  dist: str
  n: int
  count: int
  sizes: np.ndarray           # [n, n] elements r sends to d
  input_offsets: np.ndarray   # [n, n] where r's run for d starts in r's input
  output_offsets: np.ndarray  # [n, n] where r's run lands in d's output
  received: np.ndarray        # [n] elements each rank receives

  @property
  def block(self) -> int:
    """The largest single run (at least 1)."""
    return max(1, int(self.sizes.max()))

  @property
  def out_count(self) -> int:
    """Per-rank output elements: n x the largest run (>= the largest receive)."""
    return self.n * self.block


@functools.lru_cache(maxsize=64)
def layout(dist: str, n: int, count: int) -> Layout:
  sizes = split(weights(dist, n), count)
  input_offsets = np.cumsum(sizes, axis=1) - sizes
  output_offsets = np.cumsum(sizes, axis=0) - sizes
  for a in (sizes, input_offsets, output_offsets):
    a.setflags(write=False)
  return Layout(dist, n, count, sizes, input_offsets, output_offsets, sizes.sum(axis=0))


def weight_shares(dist: str, n: int) -> list[list[Fraction]]:
  """The exact share of each source's elements each destination gets, from the weights (the sizes at any
  count round these by less than one element per pair)."""
  w = weights(dist, n)
  return [[Fraction(int(v), int(row.sum())) for v in row] for row in w]
