"""What a collective moves and how many steps it takes, defined once for the sweeps, the fabric model, the
fits and the study.

- Bus bandwidth (nccl-tests' convention): busbw = algbw x a factor chosen so that, on a flat fabric, busbw is
  the rate each rank's link runs at whatever the group size: 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
  reduce-scatter and all-to-all, 1 for broadcast and point-to-point. The ragged all-to-all's factor depends on
  its send sizes, not only on n (`ragged_busbw_factor`): the bytes actually sent, counted at the busiest rank.
- Ring volume: what one rank sends in NCCL's ring for a message of S bytes, the same factor times S
  (all-to-all sends S/n to each of the n-1 others directly; broadcast's pipelined chain and a permute send S).
- Latency steps (NCCL's tuning model): a ring runs 2(n-1) steps for all-reduce and n-1 for all-gather,
  reduce-scatter and broadcast; the steps whose transfer crosses a domain boundary (an NVLink domain, a node)
  pay the network hop, the others the scale-up hop. All-to-all and a permute send to every peer at once: one
  step, at the slowest hop they cross.
"""

from __future__ import annotations

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute")
RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}  # x (n - 1) steps


def _known(collective: str) -> str:
  name = "ppermute" if collective == "permute" else collective
  if name not in COLLECTIVES:
    raise ValueError(f"unknown collective {collective!r}; collectives: {', '.join(COLLECTIVES)}")
  return name


def busbw_factor(collective: str, n: int) -> float:
  """busbw / algbw for a group of `n` ranks."""
  name = _known(collective)
  if name == "all_reduce":
    return 2 * (n - 1) / n
  if name in ("all_gather", "reduce_scatter", "all_to_all"):
    return (n - 1) / n
  return 1.0


def ragged_busbw_factor(sizes) -> float:
  """busbw / algbw of a ragged all-to-all whose rank r sends sizes[r][d] elements to rank d (S = what each rank
  sends, its own share included: sum(sizes[r]), the same for every r). Counting the bytes actually sent (no
  padding), at the rank whose link is busiest: the most that any rank sends to or receives from the others,
  over S. Uniform sizes give all-to-all's (n-1)/n; a hot expert's receiver gives up to (n-1) x its share."""
  n = len(sizes)
  s = sum(sizes[0]) if n else 0
  if not s:
    return 0.0
  sent = [sum(row) - row[r] for r, row in enumerate(sizes)]
  received = [sum(sizes[q][d] for q in range(n)) - sizes[d][d] for d in range(n)]
  return float(max(max(sent), max(received)) / s)


def ring_bytes(collective: str, n: int, size_bytes: float) -> float:
  """Bytes one rank sends for a message of `size_bytes` (nccl-tests' S) in NCCL's algorithm."""
  return busbw_factor(collective, n) * size_bytes


def latency_steps(collective: str, n: int, domains: int = 1) -> tuple[int, int]:
  """(steps at the scale-up hop, steps at the network hop) for `n` ranks spread over `domains` domains."""
  name = _known(collective)
  if n < 2:
    return 0, 0
  if name not in RING_STEPS:  # every peer at once: one step
    return (0, 1) if domains > 1 else (1, 0)
  per = RING_STEPS[name]
  network = per * (domains - 1) if domains > 1 else 0
  return per * (n - 1) - network, network


def total_steps(collective: str, n: int) -> int:
  """All latency steps, whatever hop they pay: a fitted alpha over this is a per-hop latency."""
  return sum(latency_steps(collective, n, domains=n))
