"""A stand-in for `microbench-study proxy` in runner tests: writes the same JSONL records without JAX.

  python tests/_fake_proxy.py OUT ITERS THROUGHPUT [fail|hang]

fail: exit 3 at once. hang: ignore SIGUSR1 (so only SIGKILL ends it). Otherwise SIGUSR1 ends it with
exit 0, as the real proxy does.
"""

import json
import os
import signal
import sys
import time

out, iters, thr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else ""
if mode == "fail":
  sys.exit(3)
signal.signal(signal.SIGUSR1, signal.SIG_IGN if mode == "hang" else (lambda *_: os._exit(0)))
with open(out, "a", encoding="utf-8") as f:
  f.write(json.dumps({"kind": "proxy", "pid": os.getpid()}) + "\n")
  f.flush()
  for i in range(iters + 1):
    time.sleep(0.05)
    t = thr * (1 + 0.01 * (i % 3))
    f.write(json.dumps({"kind": "iter", "iter": i, "warmup": i == 0, "throughput": t, "runtime_s": 1 / t,
                        "comm_share": 0.25 + 0.05 * (i % 2)}) + "\n")
    f.flush()
  while mode == "hang":
    time.sleep(0.1)
