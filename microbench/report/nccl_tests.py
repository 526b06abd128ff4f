"""nccl-tests' text output read into records, so a JAX sweep can be set beside the run every GPU cluster
operator already has.

The reader follows the column header each run prints instead of a fixed layout, so it reads every version's
table: with and without the `redop` and `root` columns, the correctness column as a count (`#wrong`, a number
or `N/A`) or as a maximum error (`error`, `0e+00`), one or two column groups (out-of-place, in-place). A log may
hold several runs (each starts at its `# nThread` line; newer versions name the binary in `# Collective test
starting: all_reduce_perf`) and lines of anything else between them (NCCL INFO, srun, warnings): a line is a
result row only when its first two fields are integers. A row that starts like one but cannot be read is one
error naming its line, and nothing read before it is lost (`read` returns what it read and the errors).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from microbench.report import tables

# nccl-tests binary -> this project's collective name (the others keep their binary's stem).
BINARIES = {"all_reduce_perf": "all_reduce", "all_gather_perf": "all_gather", "reduce_scatter_perf": "reduce_scatter",
            "alltoall_perf": "all_to_all", "broadcast_perf": "broadcast", "sendrecv_perf": "ppermute",
            "reduce_perf": "reduce", "gather_perf": "gather", "scatter_perf": "scatter", "hypercube_perf": "hypercube"}
# nccl-tests' type names -> numpy/JAX dtype names.
DTYPES = {"float": "float32", "half": "float16", "bfloat16": "bfloat16", "double": "float64", "int8": "int8",
          "uint8": "uint8", "int32": "int32", "int": "int32", "uint32": "uint32", "int64": "int64",
          "uint64": "uint64", "f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "fp8_e4m3": "float8_e4m3fn",
          "fp8_e5m2": "float8_e5m2"}
_GROUP = ("time", "algbw", "busbw")
_CHECK = ("#wrong", "error", "wrong")


class NcclTestsError(ValueError):
  """A log that cannot be read; the message is one line naming the file and line."""


@dataclasses.dataclass
class _Run:
  index: int
  collective: str | None
  ranks: int = 0
  devices: list[str] = dataclasses.field(default_factory=list)
  columns: list[str] | None = None


def collective_of(name: str) -> str:
  """`all_reduce_perf`, `all_reduce` or `./build/all_reduce_perf_mpi` -> `all_reduce`."""
  stem = name.strip().rsplit("/", 1)[-1].removesuffix("_mpi")
  return BINARIES.get(stem, stem.removesuffix("_perf"))


def _columns(tokens: list[str], where: str) -> list[str]:
  """The header's columns, each group's named by its place: time, algbw, busbw, wrong; then inplace_*."""
  lead = [t for t in tokens[:5] if t in ("size", "count", "type", "redop", "root")]
  rest = tokens[len(lead):]
  if lead[:3] != ["size", "count", "type"] or not rest or len(rest) % 4:
    raise NcclTestsError(f"{where}: a column header nccl-tests does not print: {' '.join(tokens)}")
  out = list(lead)
  for g in range(len(rest) // 4):
    group = rest[4 * g:4 * g + 4]
    if tuple(group[:3]) != _GROUP or group[3] not in _CHECK:
      raise NcclTestsError(f"{where}: a column header nccl-tests does not print: {' '.join(tokens)}")
    prefix = "" if g == 0 else "inplace_"
    out += [f"{prefix}time_us", f"{prefix}algbw_gbps", f"{prefix}busbw_gbps", f"{prefix}wrong"]
  return out


def _number(text: str, where: str, column: str) -> float | int | None:
  if text == "N/A":
    return None
  try:
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)
  except ValueError:
    raise NcclTestsError(f"{where}: {column} {text!r} is not a number") from None


def read(text: str, collective: str | None = None, source: str = "log") -> tuple[list[dict[str, Any]], list[str]]:
  """(records, errors) of every result row in `text`; `collective` names runs whose log does not."""
  records: list[dict[str, Any]] = []
  errors: list[str] = []
  run: _Run | None = None
  runs = 0
  pending = collective_of(collective) if collective else None
  for no, raw in enumerate(text.splitlines(), 1):
    where = f"{source}:{no}"
    line = raw.strip()
    try:
      if "Collective test starting:" in line:
        pending = collective_of(line.split("Collective test starting:", 1)[1].split()[0])
        if run is not None and not run.columns:
          run.collective = pending
      elif line.startswith("# nThread"):
        run, runs = _Run(runs, pending), runs + 1
      elif run is not None and re.match(r"#\s+Rank\s+\d+", line):
        run.ranks += 1
        device = re.search(r"\[[^\]]*\]\s+(.*)$", line)
        if device:
          run.devices.append(device.group(1).strip())
      elif line.startswith("#") and {"size", "count"} <= set(line.lstrip("#").split()):
        if run is None or run.columns:  # a table without its preamble (a log cut at the top, or -R repeats)
          run, runs = _Run(runs, pending), runs + 1
        run.columns = _columns(line.lstrip("#").split(), where)
      else:
        fields = line.split()
        if len(fields) < 2 or not (fields[0].isdigit() and fields[1].isdigit()):
          continue  # NCCL INFO, srun, warnings, the units line: not a result row
        if run is None or not run.columns:
          raise NcclTestsError(f"{where}: a result row before nccl-tests' column header")
        if len(fields) != len(run.columns):
          raise NcclTestsError(f"{where}: {len(fields)} fields where the header has {len(run.columns)}:"
                               f" {line[:80]}")
        name = run.collective or pending
        if not name:
          raise NcclTestsError(f"{where}: the log does not say which collective this run is (nccl-tests before"
                               f" 'Collective test starting' lines): name it, e.g. all_reduce={source}")
        rec: dict[str, Any] = {"source": "nccl-tests", "collective": name, "run": run.index, "line": no,
                               "ranks": run.ranks or None, "devices": sorted(set(run.devices)) or None}
        for col, value in zip(run.columns, fields):
          if col == "size":
            rec["bytes"] = int(value)
          elif col == "type":
            rec["dtype"] = DTYPES.get(value, value)
          elif col == "redop":
            rec["redop"] = None if value in ("none", "-1") else value
          elif col in ("count", "root"):
            rec[col] = int(value)
          else:
            rec[col] = _number(value, where, col)
        records.append(rec)
    except NcclTestsError as e:
      errors.append(str(e))
  return records, errors


def read_file(path: str, collective: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
  """`read` on a file; a file that cannot be opened, or holds no result row, is one NcclTestsError line."""
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read()
  except OSError as e:
    raise NcclTestsError(f"cannot read nccl-tests log {path}: {e.strerror}") from None
  records, errors = read(text, collective, path)
  if not records and not errors:
    raise NcclTestsError(f"{path}: no nccl-tests result rows (a table under a '#  size  count  type ...' header)")
  return records, errors


COMPARE_HEADERS = ("collective", "dtype", "size (B)", "scope", "n", "JAX busbw (GB/s)", "nccl-tests busbw",
                   "nccl-tests in-place", "JAX / nccl-tests", "95% interval", "verdict")


def compare(jax_records: list[dict[str, Any]], nccl_records: list[dict[str, Any]], seed: int = 0,
            draws: int = tables.BOOTSTRAP) -> list[tuple[Any, ...]]:
  """One row per JAX point that nccl-tests measured too (same collective, dtype and size; the same group size
  where the log says how many ranks it had): the busbw ratio JAX / nccl-tests with a 95% interval.

  nccl-tests prints one average per size, so the interval is the JAX side's alone: the median of its samples
  bootstrapped (each a per-operation time), as busbw; "JAX slower" or "JAX faster" only when the interval
  excludes 1."""
  rng = np.random.default_rng(seed)
  rows = []
  for ref in nccl_records:
    for rec in jax_records:
      if (rec.get("collective"), rec.get("dtype"), rec.get("bytes")) != (ref["collective"], ref.get("dtype"),
                                                                        ref["bytes"]):
        continue
      if ref.get("ranks") and rec.get("group_size") not in (None, ref["ranks"]):
        continue
      jax_busbw, theirs = rec.get("busbw_gbps"), ref.get("busbw_gbps")
      if not jax_busbw or not theirs:
        continue
      lo = hi = None
      samples = np.asarray(rec.get("samples_us") or [], np.float64)
      if samples.size >= 2 and (samples > 0).all() and rec.get("time_us"):
        medians = np.median(samples[rng.integers(0, samples.size, (draws, samples.size))], axis=1)
        ratio_draws = jax_busbw * rec["time_us"] / medians / theirs  # busbw scales as 1 / time
        lo, hi = tables.interval(ratio_draws)
      verdict = ("unknown (no samples)" if lo is None else "JAX slower" if hi < 1 else "JAX faster" if lo > 1
                 else "same within noise")
      rows.append((ref["collective"], ref.get("dtype"), ref["bytes"], rec.get("scope"), rec.get("group_size"),
                   jax_busbw, theirs, ref.get("inplace_busbw_gbps"), jax_busbw / theirs,
                   "-" if lo is None else f"[{lo:.3f}, {hi:.3f}]", verdict))
  return rows
