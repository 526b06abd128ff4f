"""nccl-tests' text output read into records, so a JAX sweep can be set beside the run every GPU cluster
operator already has.

The reader follows the column header each run prints instead of a fixed layout, so it reads every version's
table: with and without the `redop` and `root` columns, the correctness column as a count (`#wrong`, a number
or `N/A`) or as a maximum error (`error`, `0e+00`), one or two column groups (out-of-place, in-place). A log may
hold several runs (each starts at its `# nThread` line; newer versions name the binary in `# Collective test
starting: all_reduce_perf`) and lines of anything else between them (NCCL INFO, srun, warnings): a line is a
result row only when its first two fields are integers. A row that starts like one but cannot be read is one
error naming its line, and nothing read before it is lost (`read` returns what it read and the errors). The
per-iteration columns of `-I 1` (i_min, i_max, i_p99, i_cv%), `-C`'s cputime and `-S`'s timestamp are read too.

Newer versions (2.17.8 on) also write JSON (`-J file.json`), read by `read_json` into the same records; with
`-I 1` it holds every iteration's time, which gives nccl-tests' side of a comparison an interval of its own.
`compare` sets a sweep's points beside them (the figure and TensorBoard series are in nccl_tests_views.py).
"""

from __future__ import annotations

import dataclasses
import json
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
_GROUP = ("algbw", "busbw")  # after `time` (or `cputime` with -C)
_CHECK = ("#wrong", "error", "wrong")
_PER_ITER = ("i_min", "i_max", "i_p99", "i_cv%")  # 2.19.1 and later with -I 1: per-iteration statistics


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
  """The header's columns, each group's named by its place: time, algbw, busbw, wrong (and the per-iteration
  i_min, i_max, i_p99, i_cv% after them with -I 1); the second group's inplace_*; -S's timestamp as two fields."""
  lead = [t for t in tokens[:5] if t in ("size", "count", "type", "redop", "root")]
  rest = tokens[len(lead):]
  bad = NcclTestsError(f"{where}: a column header nccl-tests does not print: {' '.join(tokens)}")
  stamp = bool(rest) and rest[-1] == "timestamp"
  rest = rest[:-1] if stamp else rest
  if lead[:3] != ["size", "count", "type"] or not rest:
    raise bad
  out = list(lead)
  groups = 0
  while rest:
    if rest[0] not in ("time", "cputime") or tuple(rest[1:3]) != _GROUP or len(rest) < 4 or rest[3] not in _CHECK:
      raise bad
    prefix = "" if groups == 0 else "inplace_"
    out += [f"{prefix}time_us", f"{prefix}algbw_gbps", f"{prefix}busbw_gbps", f"{prefix}wrong"]
    rest = rest[4:]
    if tuple(rest[:4]) == _PER_ITER:
      out += [f"{prefix}iter_min_us", f"{prefix}iter_max_us", f"{prefix}iter_p99_us", f"{prefix}iter_cv_pct"]
      rest = rest[4:]
    groups += 1
  if groups > 2:
    raise bad
  return out + (["timestamp_date", "timestamp_time"] if stamp else [])


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
          elif col.startswith("timestamp"):
            rec["timestamp"] = f"{rec.get('timestamp', '')} {value}".strip()
          else:
            rec[col] = _number(value, where, col)
        records.append(rec)
    except NcclTestsError as e:
      errors.append(str(e))
  return records, errors


def _json_number(value: Any) -> float | int | None:
  """A number as nccl-tests' JSON writes it: null where it has none, "nan" (a string) for NaN."""
  if isinstance(value, bool) or value is None:
    return None
  if isinstance(value, (int, float)):
    return value
  if value == "nan":
    return None
  raise ValueError(f"{value!r} is not a number")


def _json_group(rec: dict[str, Any], group: Any, prefix: str, per_iter: Any) -> None:
  """One of a result's two measurements (out_of_place or in_place) with its -I per-iteration data."""
  if group is None:  # trace replay writes no out-of-place measurement
    return
  if not isinstance(group, dict):
    raise ValueError(f"{prefix or 'out_of_place'} is not an object")
  rec[f"{prefix}time_us"] = _json_number(group.get("time", group.get("cpu_time")))
  rec[f"{prefix}algbw_gbps"] = _json_number(group.get("alg_bw"))
  rec[f"{prefix}busbw_gbps"] = _json_number(group.get("bus_bw"))
  rec[f"{prefix}wrong"] = _json_number(group.get("nwrong"))
  if isinstance(per_iter, dict) and isinstance(per_iter.get("times_us"), list):
    skip = per_iter.get("skipped_iterations") or 0
    times = [_json_number(t) for t in per_iter["times_us"][skip:]]
    rec[f"{prefix}samples_us"] = [t for t in times if t is not None]  # each the slowest process's iteration
    rec[f"{prefix}iter_cv_pct"] = _json_number(per_iter.get("cv_pct"))


def _json_record(res: Any, head: dict[str, Any], index: int) -> dict[str, Any]:
  if not isinstance(res, dict) or not isinstance(res.get("size"), int):
    raise ValueError("not a result object with an integer size")
  redop = res.get("redop")
  root = str(res.get("root", "")).strip()
  rec: dict[str, Any] = {"source": "nccl-tests", "collective": head["collective"], "run": 0, "result": index,
                         "ranks": head["ranks"], "devices": head["devices"], "bytes": res["size"],
                         "count": res.get("count"), "dtype": DTYPES.get(res.get("type"), res.get("type")),
                         "redop": None if redop in (None, "none", "-1") else redop,
                         "root": int(root) if re.fullmatch(r"-?\d+", root) else None}
  if head["nccl_version"]:
    rec["nccl_version"] = head["nccl_version"]
  _json_group(rec, res.get("out_of_place"), "", res.get("out_of_place_per_iter"))
  _json_group(rec, res.get("in_place"), "inplace_", res.get("in_place_per_iter"))
  return rec


def _json_head(doc: dict[str, Any], collective: str | None) -> dict[str, Any]:
  """What every result of a file shares: the collective (from the binary in `args`), ranks and devices."""
  args = doc.get("args") if isinstance(doc.get("args"), list) else []
  binary = args[0] if args and isinstance(args[0], str) and re.search(r"_perf(_mpi)?$", args[0]) else None
  name = collective_of(collective) if collective else (collective_of(binary) if binary else None)
  config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
  devices = [d for d in config.get("devices") or [] if isinstance(d, dict)]
  per_entry = (config.get("nthreads") or 1) * (config.get("ngpus") or 1)  # MPI: one entry per process
  version = doc.get("nccl_version")
  return {"collective": name, "ranks": len(devices) * per_entry if devices else None,
          "devices": sorted({str(d.get("device_info")) for d in devices if d.get("device_info")}) or None,
          "nccl_version": (f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
                           if isinstance(version, int) and version >= 20900 else None)}


def _partial_json(text: str) -> tuple[dict[str, Any], list[tuple[int, Any]], list[str]]:
  """What can be read of a JSON file cut short or holding a value JSON does not allow (nccl-tests prints an
  infinite bandwidth as `inf`): each top-level value before `results` and each result object on its own."""
  decoder = json.JSONDecoder()
  doc: dict[str, Any] = {}
  errors: list[str] = []
  for key in ("args", "nccl_version", "config"):
    m = re.search(rf'"{key}"\s*:\s*', text)
    if m:
      try:
        doc[key] = decoder.raw_decode(text, m.end())[0]
      except ValueError:
        errors.append(f"'{key}' (character {m.end()})")
  results: list[tuple[int, Any]] = []
  m = re.search(r'"results"\s*:\s*\[', text)
  pos, index = (m.end(), 0) if m else (len(text), 0)
  while pos < len(text):
    while pos < len(text) and text[pos] in " \t\r\n,":
      pos += 1
    if pos >= len(text) or text[pos] == "]":
      break
    try:
      value, end = decoder.raw_decode(text, pos)
      results.append((index, value))
    except ValueError as e:
      errors.append(f"results[{index}] (character {pos}): {e.msg}")
      nxt = text.find('{"size"', pos + 1)
      end = len(text) if nxt < 0 else nxt
    index += 1
    pos = end
  return doc, results, errors


def read_json(text: str, collective: str | None = None, source: str = "json") -> tuple[list[dict[str, Any]],
                                                                                      list[str]]:
  """(records, errors) of nccl-tests' JSON output (`-J file.json`, nccl-tests 2.17.8 and later; format versions
  1-3). With `-I 1` each record also gets the per-iteration times as `samples_us` (the slowest process's time
  per iteration, leading skipped ones dropped), so its side of a comparison has an interval too. A file that is
  not valid JSON (cut short by a crash, `inf` printed as a number) is read result by result: one error line
  names what could not be read, and every result that could is used."""
  errors: list[str] = []
  try:
    doc = json.loads(text)
    if not isinstance(doc, dict):
      return [], [f"{source}: not nccl-tests' JSON output (a top-level object with 'results')"]
    results = list(enumerate(doc.get("results") or [])) if isinstance(doc.get("results"), list) else []
  except json.JSONDecodeError as e:
    doc, results, unread = _partial_json(text)
    errors.append(f"{source}: not valid JSON ({e.msg} at character {e.pos}); could not read "
                  f"{', '.join(unread) if unread else 'the end of the file'}; {len(results)} result(s) read")
  head = _json_head(doc, collective)
  if results and not head["collective"]:
    errors.append(f"{source}: the file does not say which collective it ran (no binary in 'args'): name it, e.g."
                  f" all_reduce={source}")
    return [], errors
  records = []
  for index, res in results:
    try:
      records.append(_json_record(res, head, index))
    except ValueError as e:
      errors.append(f"{source}: results[{index}]: {e}")
  return records, errors


def read_file(path: str, collective: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
  """`read` (the text log) or `read_json` (a `-J` file: a .json name or a text starting with '{') on a file; a
  file that cannot be opened, or holds no result, is one NcclTestsError line."""
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read()
  except OSError as e:
    raise NcclTestsError(f"cannot read nccl-tests log {path}: {e.strerror}") from None
  if path.lower().endswith(".json") or text.lstrip().startswith("{"):
    records, errors = read_json(text, collective, path)
    if not records and not errors:
      raise NcclTestsError(f"{path}: no nccl-tests results (an empty 'results' list)")
    return records, errors
  records, errors = read(text, collective, path)
  if not records and not errors:
    raise NcclTestsError(f"{path}: no nccl-tests result rows (a table under a '#  size  count  type ...' header)")
  return records, errors


COMPARE_HEADERS = ("collective", "dtype", "size (B)", "scope", "n", "JAX busbw (GB/s)", "nccl-tests busbw",
                   "nccl-tests in-place", "JAX / nccl-tests", "interval (95% together)", "verdict")


def _busbw_draws(busbw: float, samples: Any, stat, rng: np.random.Generator, draws: int) -> np.ndarray | None:
  """Bootstrap draws of a busbw figure from the per-operation times it came from (busbw scales as 1 / time):
  `stat` is what the figure was computed from (the sweep's median, nccl-tests' mean). None without at least
  two positive samples."""
  t = np.asarray(samples or [], np.float64)
  if t.size < 2 or not (t > 0).all():
    return None
  return busbw * stat(t) / stat(t[rng.integers(0, t.size, (draws, t.size))], axis=1)


def matches(jax_records: list[dict[str, Any]], nccl_records: list[dict[str, Any]], seed: int = tables.SEED,
            draws: int = tables.BOOTSTRAP) -> list[dict[str, Any]]:
  """Every JAX point that nccl-tests measured too (same collective, dtype and size; the same group size where
  the log says how many ranks it had), with the busbw ratio JAX / nccl-tests and its interval.

  The interval holds the noise each side shows: the JAX point's samples (its median, bootstrapped) and, where
  nccl-tests wrote every iteration (JSON with -I 1), theirs (their mean, as nccl-tests averages); a text log
  gives one average per size, so only the JAX side's noise is in it (`noise` says which). The intervals hold
  at 95% together (Bonferroni over the points, as the report's run comparisons): "JAX slower" or "JAX faster"
  only when a point's interval excludes 1."""
  rng = np.random.default_rng(seed)
  pairs = []
  for ref in nccl_records:
    for rec in jax_records:
      if (rec.get("collective"), rec.get("dtype"), rec.get("bytes")) != (ref["collective"], ref.get("dtype"),
                                                                        ref["bytes"]):
        continue
      if ref.get("ranks") and rec.get("group_size") not in (None, ref["ranks"]):
        continue
      if rec.get("busbw_gbps") and ref.get("busbw_gbps"):
        pairs.append((rec, ref))
  tail = tables._tail(len(pairs))  # pylint: disable=protected-access  # the report's one Bonferroni rule
  out = []
  for rec, ref in pairs:
    ours, theirs = rec["busbw_gbps"], ref["busbw_gbps"]
    ours_d = _busbw_draws(ours, rec.get("samples_us"), np.median, rng, draws)
    theirs_d = _busbw_draws(theirs, ref.get("samples_us"), np.mean, rng, draws)
    lo = hi = None
    if ours_d is not None or theirs_d is not None:
      lo, hi = tables.interval((ours if ours_d is None else ours_d) / (theirs if theirs_d is None else theirs_d),
                               tail)
    noise = ("none (no samples)" if lo is None else "both sides' samples" if ours_d is not None and theirs_d is
             not None else "JAX samples only" if ours_d is not None else "nccl-tests samples only")
    verdict = ("unknown (no samples)" if lo is None else "JAX slower" if hi < 1 else "JAX faster" if lo > 1
               else "same within noise")
    out.append({"collective": ref["collective"], "dtype": ref.get("dtype"), "bytes": ref["bytes"],
                "scope": rec.get("scope"), "n": rec.get("group_size"), "jax_busbw_gbps": ours,
                "nccl_busbw_gbps": theirs, "nccl_inplace_busbw_gbps": ref.get("inplace_busbw_gbps"),
                "ratio": ours / theirs, "lo": lo, "hi": hi, "noise": noise, "verdict": verdict})
  return out


def compare_rows(points: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
  """`matches` as COMPARE_HEADERS rows, for the table."""
  return [(m["collective"], m["dtype"], m["bytes"], m["scope"], m["n"], m["jax_busbw_gbps"], m["nccl_busbw_gbps"],
           m["nccl_inplace_busbw_gbps"], m["ratio"], "-" if m["lo"] is None else f"[{m['lo']:.3f}, {m['hi']:.3f}]",
           m["verdict"]) for m in points]


def compare(jax_records: list[dict[str, Any]], nccl_records: list[dict[str, Any]], seed: int = tables.SEED,
            draws: int = tables.BOOTSTRAP) -> list[tuple[Any, ...]]:
  """The table's rows of `matches`."""
  return compare_rows(matches(jax_records, nccl_records, seed, draws))
