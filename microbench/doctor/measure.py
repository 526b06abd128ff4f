"""The doctor's programs on the allocation: every pair of a round in one program, timed by each process.

One process per node. A program of kind p2p (a ppermute swap inside each pair) or all_reduce (a psum inside
each pair) runs on a mesh `pair x peer` built from rail r's device of each node of the round's pairs, so all
pairs run at once and their traffic meets on the links as it would in a job; nodes without a pair this round
do not call it. A scale_up program is a psum over the node's own devices. Each calling process times its own
calls (`samples` after `warmup`, each `reps` operations back to back; the median for p2p, the fastest of
4 x `samples` for the latency-bound kinds) and checks the result (the partner's value after a swap, the pair's
mean after a psum; a wrong one counts as infinitely slow); every test's time, the slower of its two nodes', is
then gathered to every process, so every process takes the same next step.

Each p2p test also yields a `loss` test: the share of the TCP segments its two nodes sent during the timed
calls that were retransmissions (/proc/net/snmp of each node's network namespace). At a LAN's sub-millisecond
round trips TCP recovers a 2% loss so fast that the time barely moves (1.05-1.45x on the testbed), while the
retransmissions say it plainly. They count only where the transfers run over TCP (gloo, NCCL's socket
transport); over InfiniBand or RoCE they stay 0 and the time is the only signal.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from microbench.doctor.fleet import Test, median


WRONG: list[str] = []  # wrong results seen by this process (each also makes its test infinitely slow)


@dataclasses.dataclass(frozen=True)
class Plan:
  sizes: dict[str, int]  # bytes per rank by kind
  warmup: int = 1
  samples: int = 5
  reps: int = 1  # operations per call


def node_devices() -> list[list[jax.Device]]:
  """Each process's devices, by process index then device id: node i's rail r device is [i][r]."""
  out: list[list[jax.Device]] = [[] for _ in range(jax.process_count())]
  for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
    out[d.process_index].append(d)
  return out


def _pair_program(kind: str, mesh: jax.sharding.Mesh, reps: int):
  spec = jax.P(("pair", "peer"))

  def step(x):
    if kind == "p2p":
      return jax.lax.ppermute(x, "peer", [(0, 1), (1, 0)])
    return jax.lax.psum(x, "peer") * 0.5

  def body(x):
    return jax.lax.fori_loop(0, reps, lambda _, y: step(y), x) if reps > 1 else step(x)

  # check_vma=False: a psum's result is invariant over the axis and the loop carries it back in (as bench/program)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def _local_program(mesh: jax.sharding.Mesh, reps: int):
  spec = jax.P("gpu")

  def body(x):
    return jax.lax.fori_loop(0, reps, lambda _, y: jax.lax.psum(y, "gpu") / mesh.size, x)

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


LATENCY_SAMPLES = 4  # latency-bound kinds take this many times the samples: they cost microseconds each


def _time(fn, x, plan: Plan, kind: str) -> tuple[float, jax.Array]:
  """Seconds per operation, and the last output: the median call for p2p (bandwidth-bound: its spread is the
  links'); the fastest call for the latency-bound kinds, whose spread is the hosts' scheduling (a busy CPU
  only adds to a call; a slow or delayed link adds to every call, the fastest too)."""
  y = None
  for _ in range(plan.warmup):
    y = jax.block_until_ready(fn(x))
  times = []
  for _ in range(plan.samples * (1 if kind == "p2p" else LATENCY_SAMPLES)):
    t0 = time.perf_counter()
    y = jax.block_until_ready(fn(x))
    times.append((time.perf_counter() - t0) / plan.reps)
  return (median(times) if kind == "p2p" else min(times)), y


SNMP = "/proc/net/snmp"


def tcp_counters() -> tuple[int, int] | None:
  """(OutSegs, RetransSegs) of this process's network namespace, or None where /proc/net/snmp is unreadable."""
  try:
    with open(SNMP, encoding="ascii") as f:
      rows = [line.split() for line in f if line.startswith("Tcp:")]
    fields = dict(zip(rows[0][1:], rows[1][1:]))
    return int(fields["OutSegs"]), int(fields["RetransSegs"])
  except (OSError, IndexError, KeyError, ValueError):
    return None


def _mine(y: jax.Array) -> float:
  return float(np.asarray(y.addressable_shards[0].data).ravel()[0])


def run_group(tests: Sequence[Test], plan: Plan) -> dict[Test, float]:
  """Runs one program (one kind, one rail) and returns every test's seconds per operation, on every process."""
  me = jax.process_index()
  devices = node_devices()
  kind = tests[0].kind
  mine = [k for k, t in enumerate(tests) if me in t.nodes]
  own = np.full(len(tests), np.nan)
  segments = np.zeros((len(tests), 2))  # TCP segments this process sent and resent during its timed calls
  count = max(1, plan.sizes[kind] // 4)
  multihost_utils.sync_global_devices(f"doctor-{kind}-{tests[0].round}-{tests[0].rail}")
  if kind == "scale_up":
    if mine:
      local = devices[me]
      mesh = jax.sharding.Mesh(np.array(local), ("gpu",))
      sharding = jax.NamedSharding(mesh, jax.P("gpu"))
      x = jax.make_array_from_callback((len(local) * count,), sharding,
                                       lambda idx: np.full((count,), 1.0, np.float32))
      seconds, y = _time(_local_program(mesh, plan.reps), x, plan, kind)
      own[mine[0]] = seconds
      if _mine(y) != 1.0:
        WRONG.append(f"scale-up all-reduce on node {me} gave {_mine(y)}, expected 1.0")
        own[mine[0]] = np.inf
  elif mine:
    rail = tests[0].rail
    grid = np.array([[devices[t.a][rail], devices[t.b][rail]] for t in tests])
    mesh = jax.sharding.Mesh(grid, ("pair", "peer"))
    sharding = jax.NamedSharding(mesh, jax.P(("pair", "peer")))
    value = {d: float(i + 1) for i, devs in enumerate(devices) for d in devs}
    x = jax.make_array_from_callback(
        (grid.size * count,), sharding,
        lambda idx: np.full((count,), value[grid.flat[idx[0].start // count]], np.float32))
    fn = _pair_program(kind, mesh, plan.reps)
    jax.block_until_ready(fn(x))  # compiled and connected before the counters start
    before = tcp_counters()
    seconds, y = _time(fn, x, plan, kind)
    after = tcp_counters()
    if before and after:
      segments[mine[0]] = (after[0] - before[0], after[1] - before[1])
    test = tests[mine[0]]
    partner = test.b if test.a == me else test.a
    if kind == "p2p":
      want = float(partner + 1) if plan.reps % 2 else float(me + 1)
    else:
      want = (test.a + test.b + 2) / 2
    own[mine[0]] = seconds
    if _mine(y) != want:  # broken, not slow: a time no reference can excuse, so its parts are suspected
      WRONG.append(f"{kind} between nodes {test.a} and {test.b} on rail {rail} gave {_mine(y)} on node {me},"
                   f" expected {want}")
      own[mine[0]] = np.inf
  rows = np.concatenate([own[:, None], segments], axis=1)
  everyone = np.asarray(multihost_utils.process_allgather(rows)).reshape(jax.process_count(), len(tests), 3)
  out = {t: float(np.nanmax(everyone[list(t.nodes), k, 0])) for k, t in enumerate(tests)}
  if kind == "p2p":  # the share of the pair's TCP segments that were resent: a lossy link's own signature
    for k, t in enumerate(tests):
      sent, resent = everyone[list(t.nodes), k, 1].sum(), everyone[list(t.nodes), k, 2].sum()
      if sent > 0:
        out[dataclasses.replace(t, kind="loss")] = float(resent / sent)
  return out
