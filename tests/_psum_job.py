"""A tiny distributed JAX job for the launcher/testbed tests: a cross-process psum, checked.

Run by `microbench-launch` / `microbench-testbed`, which append `--distributed
--coordinator_address=... --num_processes=N --process_id=I`. Fault-injection flags let tests make one
rank fail or hang. With `--pass_flags=false` launchers it reads the MICROBENCH_* env vars instead.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, flags  # pylint: disable=g-import-not-at-top

from microbench.cli import cluster_flags  # pylint: disable=g-import-not-at-top
from microbench.cluster import distributed  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_integer("fail_rank", -1, "This rank exits with --fail_code before the collective.")
flags.DEFINE_integer("fail_code", 3, "Exit code of the failing rank.")
flags.DEFINE_integer("hang_rank", -1, "This rank sleeps forever instead of joining.")
flags.DEFINE_float("sleep", 0.0, "Seconds every rank sleeps before exiting (for timeout/SIGINT tests).")
flags.DEFINE_integer("bytes", 0, "If > 0, also time an all-reduce of this many bytes per rank and print busbw.")
flags.DEFINE_integer("iters", 5, "Timed iterations for --bytes.")
flags.DEFINE_string("pid_dir", None, "Write this rank's pid to <pid_dir>/rank<I>.pid at start (tests check it died).")
flags.DEFINE_bool("from_env", False, "Read coordinator/num_processes/process_id from MICROBENCH_* env vars.")


def main(argv: list[str]) -> None:
  del argv
  if FLAGS.from_env:
    FLAGS.distributed = True
    FLAGS.coordinator_address = os.environ["MICROBENCH_COORDINATOR"]
    FLAGS.num_processes = int(os.environ["MICROBENCH_NUM_PROCESSES"])
    FLAGS.process_id = int(os.environ["MICROBENCH_PROCESS_ID"])
  rank = FLAGS.process_id or 0
  if FLAGS.pid_dir:
    with open(os.path.join(FLAGS.pid_dir, f"rank{rank}.pid"), "w", encoding="ascii") as f:
      f.write(str(os.getpid()))
  print(f"rank {rank} host {distributed.hostname()} started", flush=True)
  if rank == FLAGS.fail_rank:
    if FLAGS.pid_dir:  # every rank started (its pid written) before this one fails: the test's premise, not a race
      deadline = time.monotonic() + 60
      while time.monotonic() < deadline and len([f for f in os.listdir(FLAGS.pid_dir)
                                                 if f.endswith(".pid")]) < (FLAGS.num_processes or 1):
        time.sleep(0.05)
    print(f"rank {rank} failing on purpose", flush=True)
    sys.exit(FLAGS.fail_code)
  if rank == FLAGS.hang_rank:
    time.sleep(10_000)
  distributed.initialize(cluster_flags.settings())
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  n = jax.process_count()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
  spec = jax.P("x")
  sharding = jax.NamedSharding(mesh, spec)

  def local(value: float, shape: tuple[int, ...]) -> jax.Array:
    return jax.make_array_from_callback(
        (len(devices) * shape[0],) + shape[1:], sharding,
        lambda idx: np.full(shape, value, np.float32))

  psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "x"), mesh=mesh, in_specs=spec, out_specs=spec))
  # Each device holds (its process index + 1); the sum over all devices is known in closed form.
  x = jax.make_array_from_callback(
      (len(devices),), sharding,
      lambda idx: np.full((1,), devices[idx[0].start].process_index + 1, np.float32))
  out = psum(x)
  got = float(np.asarray(out.addressable_shards[0].data)[0])
  per_proc = jax.local_device_count()
  expected = float(per_proc * n * (n + 1) / 2)
  status = "OK" if got == expected else "WRONG"
  print(f"RESULT rank={rank} processes={n} devices={len(devices)} psum={got} expected={expected} {status}",
        flush=True)
  if FLAGS.bytes > 0:
    elems = FLAGS.bytes // 4
    y = local(1.0, (elems,))
    jax.block_until_ready(psum(y))
    times = []
    for _ in range(FLAGS.iters):
      t0 = time.perf_counter()
      jax.block_until_ready(psum(y))
      times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    g = len(devices)
    busbw = FLAGS.bytes / t / 1e9 * 2 * (g - 1) / g
    print(f"BUSBW rank={rank} bytes={FLAGS.bytes} time_s={t:.4f} busbw_GBps={busbw:.5f}", flush=True)
  if FLAGS.sleep:
    time.sleep(FLAGS.sleep)
  if status != "OK":
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
