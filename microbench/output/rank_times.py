"""Every process's per-sample times of a point, kept compact in its record.

A job of 1024 processes x 20 samples has 20,480 times per point. As JSON numbers at 4 significant digits that
is ~160 KB a point; here they are float16 ratios to the point's median (10 mantissa bits: <= 0.05% relative
error, the same as 4 significant digits, and any sign), base64 in one string: 2 bytes a time, ~55 KB a point.
The per-process medians stay readable beside them (`rank_median_us`)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

FIELD = "rank_samples"          # {"scale_us", "shape": [process, sample], "f16_b64"}
MEDIANS = "rank_median_us"      # per-process median per-operation time, 4 significant digits
F16_MAX = float(np.finfo(np.float16).max)


class RankTimesError(ValueError):
  """A record's rank_samples field cannot be read."""


def _sig4(x: float) -> float:
  return float(f"{x:.4g}")


def encode(per_proc_us: np.ndarray) -> dict[str, Any]:
  """The record fields for [process, sample] per-operation times in microseconds."""
  t = np.asarray(per_proc_us, np.float64)
  scale = float(abs(np.median(t))) or 1.0
  ratio = np.clip(t / scale, -F16_MAX, F16_MAX).astype("<f2")
  return {FIELD: {"scale_us": scale, "shape": list(t.shape),
                  "f16_b64": base64.b64encode(ratio.tobytes()).decode("ascii")},
          MEDIANS: [_sig4(v) for v in np.median(t, axis=1)]}


def decode(rec: dict[str, Any]) -> np.ndarray | None:
  """[process, sample] per-operation times (us) of a record; None when it has none (recorded before the field
  existed, or not a measured point). RankTimesError when the field is there but malformed."""
  field = rec.get(FIELD)
  if field is None:
    return None
  try:
    shape = tuple(int(n) for n in field["shape"])
    raw = base64.b64decode(field["f16_b64"], validate=True)
    ratio = np.frombuffer(raw, "<f2").astype(np.float64)
    if len(shape) != 2 or ratio.size != shape[0] * shape[1] or min(shape) < 1:
      raise ValueError(f"{ratio.size} values for shape {list(shape)}")
    return ratio.reshape(shape) * float(field["scale_us"])
  except (KeyError, TypeError, ValueError) as e:
    raise RankTimesError(f"{FIELD} of {rec.get('collective')} {rec.get('scope')} {rec.get('bytes')} B cannot be"
                         f" read: {e}") from None
