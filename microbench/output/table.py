"""The sweep's console table, nccl-tests style: one row per point and the "Avg bus bandwidth" summary."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

_HEAD = "{bytes:>12} {count:>11} {dtype:>8} {scope:>10} {group_size:>4} {num_groups:>4}  {time:>10}"
_TAIL = " {algbw:>8} {busbw:>8} {expected:>8} {ratio:>5} {wrong:>6}{flag}"
_ROW = _HEAD + _TAIL
# --command_buffer=both: the time with XLA:GPU's command buffers beside the time without (nccl-tests -G's view)
_ROW_CB = _HEAD + " {cb:>10}" + _TAIL
_NAMES = dict(bytes="size(B)", count="count", dtype="type", scope="scope", group_size="n", num_groups="grps",
              time="time(us)", algbw="algbw", busbw="busbw", expected="expected", ratio="meas/", wrong="#wrong",
              flag="", cb="cmdbuf(us)")
_UNITS = dict(bytes="", count="(elements)", dtype="", scope="", group_size="", num_groups="", time="median",
              algbw="(GB/s)", busbw="(GB/s)", expected="busbw", ratio="exp", wrong="", flag="", cb="median")
HEADER = _ROW.format(**_NAMES)
UNITS = _ROW.format(**_UNITS)


def header(command_buffer: bool = False) -> list[str]:
  """The table's two header lines; `command_buffer` adds the column of times with command buffers."""
  row = _ROW_CB if command_buffer else _ROW
  return [row.format(**_NAMES), row.format(**_UNITS)]


def _short(dtype: str) -> str:
  """The type column is 8 wide: float8_e4m3fn is shown as XLA names it, f8e4m3fn."""
  return dtype.replace("float8_", "f8")


def _command_buffer_text(r: dict[str, Any]) -> str:
  """`, in command buffers: 5/5 collective thunks, 1/1 loop`: what runs inside one in the programs compiled
  with command buffers (--command_buffer=yes or both); empty otherwise."""
  found = [p["command_buffer"] for p in (r.get("programs") or {}).values()
           if (p.get("command_buffer") or {}).get("asked") == "yes"]
  if not found:
    return ""
  colls = f"{sum(f['collectives_inside'] for f in found)}/{sum(f['collectives'] for f in found)} collective thunks"
  loops, inside = sum(f["loops"] for f in found), sum(f["loops_inside"] for f in found)
  return f", in command buffers: {colls}" + (f", {inside}/{loops} loops" if loops else "")


def form_text(f: dict | None) -> str:
  """A record's `form` (the platform's form of the op and what it adds: microbench.bench.program.form) in a few
  words, for tables and reports."""
  if not f:
    return ""
  parts = [f"{f['written_as']} ({f['wire_factor']:g}x the op's link traffic)" if "written_as" in f else "",
           f"packed in {f['packed_in']}" if "packed_in" in f else "",
           f["out_of_place"] if "out_of_place" in f else "",
           f"{f['hbm_passes_per_op']:g} message-sized memory writes per op" if "hbm_passes_per_op" in f else ""]
  return "; ".join(p for p in parts if p)


def _compiled_row(r: dict[str, Any]) -> str:
  """A point compiled for a GPU target: the op as emitted, how often it runs where, memory and fit."""
  ops = "/".join(r.get("op_emitted", [])) or "?"
  where = ""
  if r.get("trip_count"):
    where = f" x{r['iters']} ({r['loop_reps']} in a loop of {r['trip_count']} known trips)"
  mem = r.get("memory_bytes")
  text = f"compiled: {ops}{where}, wire {r.get('wire_dtype', '?')}{_command_buffer_text(r)}"
  if r.get("form"):  # the platform's own form of the op and what it adds (program.form)
    text += f" ({form_text(r['form'])})"
  if r.get("algorithm"):  # the algorithm XLA:TPU chose
    a = r["algorithm"]
    dims = f" over {'x'.join(map(str, a['dim_sizes']))} dims {a.get('active_dims', '?')}" if a.get("dim_sizes") else ""
    text += f", {'/'.join(v for v in (a.get('emitter'), a.get('strategy')) if v)}{dims}"
  if mem is not None:
    text += f", {mem / 2**20:.1f} MiB/device"
  if r.get("fits") is False:
    text += (f"  DOES NOT FIT ({r['usable_bytes'] / 2**30:.1f} GiB usable of {r['device_memory_bytes'] / 2**30:.1f}"
             " GiB)" + (f": {r['reason']}" if r.get("reason") else ""))
  return (f"{r['bytes']:>12} {r['count']:>11} {_short(r['dtype']):>8} {r['scope']:>10} {r['group_size']:>4} "
          f"{r['num_groups']:>4}  {text}")


def format_row(r: dict[str, Any]) -> str:
  if r["status"] == "compiled":
    return _compiled_row(r)
  if r["status"] != "ok":
    return (f"{r.get('bytes', r.get('requested_bytes', '')):>12} {r.get('count', ''):>11} {_short(r['dtype']):>8} "
            f"{r['scope']:>10} {r.get('group_size', ''):>4} {r.get('num_groups', ''):>4}  "
            f"{r['status']}: {r.get('reason', '')}")
  flag = ""
  if r.get("wire_dtype") and r["wire_dtype"] != r["dtype"]:
    flag += f"  wire {r['wire_dtype']}"
  if str(r.get("time_method", "")).startswith("long-arm"):
    flag += "  UNRESOLVED (long-arm average)"
  elif r.get("noisy"):
    flag += f"  NOISY (median +-{100 * r['resolution']:.0f}%)"
  if r.get("timed_wrong"):
    flag += f"  TIMED PROGRAM WRONG ({r['timed_wrong']} rank(s))"
  if r.get("form"):
    flag += f"  FORM: {form_text(r['form'])}"
  if r.get("straggler"):
    flag += f"  STRAGGLER rank {r['slowest_rank']} (spread {100 * r['time_spread']:.0f}%)"
  if r.get("low"):  # fabric.expected: far below the model at a bandwidth-bound size
    flag += f"  LOW ({r['vs_expected']:.2f} x expected, {r['expected_bound']}-bound)"
  wrong = "N/A" if r["wrong"] is None else r["wrong"]
  has = r.get("expected_busbw_gbps") is not None
  cb = r.get("time_us_command_buffer")
  if cb is not None and r.get("noisy_command_buffer"):
    flag += f"  NOISY with command buffers (median +-{100 * r['resolution_command_buffer']:.0f}%)"
  if r.get("timed_wrong_command_buffer") or r.get("wrong_command_buffer"):
    flag += "  WRONG WITH COMMAND BUFFERS"
  return (_ROW if cb is None else _ROW_CB).format(
      bytes=r["bytes"], count=r["count"], dtype=_short(r["dtype"]), scope=r["scope"], group_size=r["group_size"],
      num_groups=r["num_groups"], time=f"{r['time_us']:.2f}", cb="" if cb is None else f"{cb:.2f}",
      algbw=f"{r['algbw_gbps']:.3f}", busbw=f"{r['busbw_gbps']:.3f}",
      expected=f"{r['expected_busbw_gbps']:.3f}" if has else "-",
      ratio=f"{r['vs_expected']:.2f}" if has else "-", wrong=wrong, flag=flag)


def summary(records: list[dict[str, Any]]) -> str:
  """nccl-tests' "Avg bus bandwidth", per collective and scope (and dtype), over the points that ran."""
  acc: dict[tuple[str, str, str], list[float]] = defaultdict(list)
  for r in records:
    if r["status"] == "ok":
      acc[(r["collective"], r["scope"], r["dtype"])].append(r["busbw_gbps"])
  lines = ["# Avg bus bandwidth (GB/s, mean over sizes)",
           f"# {'collective':<19} {'scope':<11} {'dtype':<13} {'points':>6} {'avg busbw':>10} {'max busbw':>10}"]
  for (c, s, d), vals in acc.items():
    lines.append(f"# {c:<19} {s:<11} {d:<13} {len(vals):>6} {sum(vals) / len(vals):>10.3f} {max(vals):>10.3f}")
  return "\n".join(lines)
