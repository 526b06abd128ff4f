"""Link rates and delays as people write them (tc's units), and the queue disciplines a shaped link can have.

One parser for everyone who names a rate: the emulated cluster's links (`microbench-testbed`), the fabric
descriptions (`--fabric=testbed:host_rate=...`) and the study's machines. JAX-free, root-free.
"""

from __future__ import annotations

import re

# How a shaped link shares itself among the flows crossing it: one FIFO, or a fair queue per host pair.
QUEUES = ("fifo", "fair")

_RATE_UNITS = {  # tc's units: "bit" suffixes are bits/s, "bps" suffixes are bytes/s; k/m/g are powers of 1000.
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}
_DELAY_UNITS = {"us": 1, "usec": 1, "ms": 1e3, "msec": 1e3, "s": 1e6, "sec": 1e6}


def parse_rate(text: str | None) -> int | None:
  """'200mbit' -> 200_000_000 bits/s (tc units); '', '0', 'none' -> None (unshaped)."""
  if text is None or text.strip().lower() in ("", "0", "none"):
    return None
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
  if not m or m.group(2).lower() not in _RATE_UNITS:
    raise ValueError(f"bad rate {text!r}: use tc units, e.g. 200mbit, 10gbit, 25mbps (bytes/s)")
  bits = int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])
  if bits < 8000:
    raise ValueError(f"rate {text!r} is below 8kbit")
  return bits


def parse_delay(text: str | None) -> int:
  """'1ms' -> 1000 microseconds; '', '0' -> 0."""
  if text is None or text.strip().lower() in ("", "0", "none"):
    return 0
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
  if not m or m.group(2).lower() not in _DELAY_UNITS:
    raise ValueError(f"bad delay {text!r}: use e.g. 500us, 1ms, 0.1s")
  return int(round(float(m.group(1)) * _DELAY_UNITS[m.group(2).lower()]))


def gbytes_per_s(bits: int) -> float:
  """The rate in decimal GB/s, the unit of busbw."""
  return bits / 8 / 1e9


