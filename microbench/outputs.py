"""What a run leaves behind: results.jsonl (flushed per point), meta.json, TensorBoard events, the table.

Only process 0 writes; other processes get a writer that does nothing, so callers need no rank checks.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Any, TextIO

from microbench.tensorboard_log import TensorBoardLog

RESULTS = "results.jsonl"
META = "meta.json"

_ROW = "{bytes:>12} {count:>11} {dtype:>8} {scope:>10} {group_size:>4} {num_groups:>4}  {time:>10} {algbw:>8} {busbw:>8} {wrong:>6}{flag}"
HEADER = _ROW.format(bytes="size(B)", count="count", dtype="type", scope="scope", group_size="n",
                     num_groups="grps", time="time(us)", algbw="algbw", busbw="busbw", wrong="#wrong", flag="")
UNITS = _ROW.format(bytes="", count="(elements)", dtype="", scope="", group_size="", num_groups="",
                    time="median", algbw="(GB/s)", busbw="(GB/s)", wrong="", flag="")


def format_row(r: dict[str, Any]) -> str:
  if r["status"] != "ok":
    return (f"{r.get('bytes', r.get('requested_bytes', '')):>12} {r.get('count', ''):>11} {r['dtype']:>8} "
            f"{r['scope']:>10} {r.get('group_size', ''):>4} {r.get('num_groups', ''):>4}  "
            f"{r['status']}: {r.get('reason', '')}")
  flag = ""
  if r.get("straggler"):
    flag = f"  STRAGGLER rank {r['slowest_rank']} (spread {100 * r['time_spread']:.0f}%)"
  wrong = "N/A" if r["wrong"] is None else r["wrong"]
  return _ROW.format(bytes=r["bytes"], count=r["count"], dtype=r["dtype"], scope=r["scope"],
                     group_size=r["group_size"], num_groups=r["num_groups"], time=f"{r['time_us']:.2f}",
                     algbw=f"{r['algbw_gbps']:.3f}", busbw=f"{r['busbw_gbps']:.3f}", wrong=wrong, flag=flag)


def read_results(outdir: str) -> list[dict[str, Any]]:
  """Every complete JSON line of a run's results (a torn last line from a crash is ignored)."""
  path = os.path.join(outdir, RESULTS)
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows


def read_meta(outdir: str) -> dict[str, Any] | None:
  path = os.path.join(outdir, META)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


class RunOutputs:
  """Writes a run folder: one JSON line and TensorBoard points per finished point, as it finishes."""

  def __init__(self, outdir: str, enabled: bool = True, stream: TextIO = sys.stdout):
    self.outdir = outdir
    self.enabled = enabled
    self.stream = stream
    self._results: TextIO | None = None
    self._tb: TensorBoardLog | None = None
    if enabled:
      os.makedirs(outdir, exist_ok=True)
      self._repair_torn_tail()
      self._results = open(os.path.join(outdir, RESULTS), "a")
      self._tb = TensorBoardLog(outdir)

  def _repair_torn_tail(self) -> None:
    """A crash can leave half a line; end it so appended records stay one per line."""
    path = os.path.join(self.outdir, RESULTS)
    if os.path.exists(path) and os.path.getsize(path):
      with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
          f.write(b"\n")

  def print(self, text: str = "") -> None:
    if self.enabled:
      print(text, file=self.stream, flush=True)

  def write_meta(self, meta: dict[str, Any]) -> None:
    if not self.enabled:
      return
    tmp = os.path.join(self.outdir, META + ".tmp")
    with open(tmp, "w") as f:
      json.dump(meta, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, os.path.join(self.outdir, META))

  def text(self, tag: str, text: str) -> None:
    if self._tb:
      self._tb.text(tag, text)

  def record(self, rec: dict[str, Any]) -> None:
    if not self.enabled:
      return
    self._results.write(json.dumps(rec, sort_keys=True) + "\n")
    self._results.flush()
    os.fsync(self._results.fileno())
    if rec["status"] == "ok":
      base = f"{rec['collective']}/{rec['scope']}/{rec['dtype']}"
      self._tb.scalar(f"busbw_gbps/{base}", rec["busbw_gbps"], rec["bytes"])
      self._tb.scalar(f"time_us/{base}", rec["time_us"], rec["bytes"])

  def close(self) -> None:
    if self._results:
      self._results.close()
    if self._tb:
      self._tb.close()


def summary(records: list[dict[str, Any]]) -> str:
  """nccl-tests' "Avg bus bandwidth", per collective and scope (and dtype), over the points that ran."""
  acc: dict[tuple[str, str, str], list[float]] = defaultdict(list)
  for r in records:
    if r["status"] == "ok":
      acc[(r["collective"], r["scope"], r["dtype"])].append(r["busbw_gbps"])
  lines = ["# Avg bus bandwidth (GB/s, mean over sizes)",
           f"# {'collective':<16} {'scope':<11} {'dtype':<9} {'points':>6} {'avg busbw':>10} {'max busbw':>10}"]
  for (c, s, d), vals in acc.items():
    lines.append(f"# {c:<16} {s:<11} {d:<9} {len(vals):>6} {sum(vals) / len(vals):>10.3f} {max(vals):>10.3f}")
  return "\n".join(lines)
