"""NCCL settings to measure side by side (`microbench --nccl_env`): which combinations exist, which NCCL refuses.

NCCL picks an algorithm, a protocol and a channel count per call from its own cost model; a tuner plugin (or
NCCL_ALGO / NCCL_PROTO / NCCL_MAX_NCHANNELS) overrides it. To find where the model is wrong on a machine, the
same points run under each setting and the report keeps a setting only where it wins beyond noise
(`report/nccl_tuner.py`). Why refuse pairs here: NCCL marks an algorithm/protocol pair it does not implement for
a collective as ignored and runs something else without a word (NVIDIA/nccl#1661), so a sweep "under" such a
pair measures NCCL's default under the pair's name. The table below is NCCL's own (src/graph/tuning.cc,
2.23 to 2.30): before hardware gating (NVLS needs NVSwitch, CollNet a SHARP plugin, PAT one GPU per node),
which only a run on the machine can see (`--nccl_debug` records what NCCL chose).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

# NCCL's spellings (env values are case-insensitive; these are how NCCL prints them) and the tuner file's.
ALGORITHMS = {"tree": "Tree", "ring": "Ring", "collnetdirect": "CollNetDirect", "collnetchain": "CollNetChain",
              "nvls": "NVLS", "nvlstree": "NVLSTree", "pat": "PAT"}
TUNER_ALGORITHM = {"tree": "tree", "ring": "ring", "collnetdirect": "collnet_direct",
                   "collnetchain": "collnet_chain", "nvls": "nvls", "nvlstree": "nvls_tree", "pat": "pat"}
PROTOCOLS = {"ll": "LL", "ll128": "LL128", "simple": "Simple"}
CHANNELS = "NCCL_MAX_NCHANNELS"  # the tuner's channel count is a ceiling too (NCCL's nMaxChannels)
VARIABLES = ("NCCL_ALGO", "NCCL_PROTO", CHANNELS)

# The toolkit's collectives NCCL's tuner decides, by NCCL function (all-to-all and permutes are send/recv, which
# no tuner sees; the toolkit's broadcast compiles to an all-reduce).
FUNCTIONS = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter"}

_ANY = tuple(PROTOCOLS)
_SIMPLE = ("simple",)
VALID = {  # NCCL function -> algorithm -> protocols NCCL implements for it
    "allreduce": {"tree": _ANY, "ring": _ANY, "collnetdirect": _SIMPLE, "collnetchain": _SIMPLE,
                  "nvls": _SIMPLE, "nvlstree": _SIMPLE},
    "allgather": {"ring": _ANY, "pat": _SIMPLE, "nvls": _SIMPLE, "collnetdirect": _SIMPLE},
    "reducescatter": {"ring": _ANY, "pat": _SIMPLE, "nvls": _SIMPLE, "collnetdirect": _SIMPLE},
}

# Variables that decide before a tuner does (its choices dropped or capped): NCCL applies them when a
# communicator starts and marks what they exclude as ignored in the table the tuner sees.
OVERRIDING = {"NCCL_ALGO": "excludes every other algorithm", "NCCL_PROTO": "excludes every other protocol",
              "NCCL_MAX_NCHANNELS": "caps the tuner's channels", "NCCL_MIN_NCHANNELS": "sets the channels",
              "NCCL_MAX_CTAS": "caps the tuner's channels", "NCCL_MIN_CTAS": "sets the channels",
              "NCCL_NVLS_ENABLE": "decides whether NVLS exists", "NCCL_COLLNET_ENABLE": "decides whether CollNet"
              " exists", "NCCL_PAT_ENABLE": "decides whether PAT exists", "NCCL_TUNER_PLUGIN": "chooses the tuner"}

PRESETS = {"algorithms": ("NCCL_ALGO=Ring,Tree",), "protocols": ("NCCL_PROTO=LL,LL128,Simple",),
           "ring-tree-protocols": ("NCCL_ALGO=Ring,Tree", "NCCL_PROTO=LL,LL128,Simple")}


class NcclSettingError(ValueError):
  """A --nccl_env value or combination NCCL would not run as named; one line."""


@dataclasses.dataclass(frozen=True)
class Setting:
  """One combination: NCCL_ALGO, NCCL_PROTO, NCCL_MAX_NCHANNELS (None: NCCL's own), the collectives it runs."""
  algorithm: str | None = None  # lower case key of ALGORITHMS
  protocol: str | None = None
  channels: int | None = None
  collectives: tuple[str, ...] = ()

  @property
  def label(self) -> str:
    parts = [p for p in (self.algorithm, self.protocol) if p] + ([f"ch{self.channels}"] if self.channels else [])
    return "-".join(parts) or "default"

  def env(self) -> dict[str, str]:
    out = {}
    if self.algorithm:
      out["NCCL_ALGO"] = ALGORITHMS[self.algorithm]
    if self.protocol:
      out["NCCL_PROTO"] = PROTOCOLS[self.protocol]
    if self.channels:
      out[CHANNELS] = str(self.channels)
    return out


def _values(var: str, text: str) -> list:
  items = [v.strip() for v in text.split(",") if v.strip()]
  if not items:
    raise NcclSettingError(f"--nccl_env={var}=: give one or more values, e.g. {var}={_example(var)}")
  if var == CHANNELS:
    try:
      out = [int(v) for v in items]
    except ValueError:
      out = [0]
    if any(v < 1 for v in out):
      raise NcclSettingError(f"--nccl_env={var}={text}: channel counts are whole numbers >= 1")
    return out
  names = ALGORITHMS if var == "NCCL_ALGO" else PROTOCOLS
  bad = [v for v in items if v.lower().replace("_", "") not in names]
  if bad or any(v.startswith("^") or ":" in v for v in items):
    raise NcclSettingError(f"--nccl_env={var}={text}: each value is one {'algorithm' if var == 'NCCL_ALGO' else 'protocol'}"
                           f" to measure on its own ({', '.join(names.values())}); not {', '.join(bad) or text}")
  return [v.lower().replace("_", "") for v in items]


def _example(var: str) -> str:
  return {"NCCL_ALGO": "Ring,Tree", "NCCL_PROTO": "LL,LL128,Simple"}.get(var, "4,8,16")


def parse(values: Sequence[str]) -> dict[str, list]:
  """--nccl_env's values (VAR=v1,v2 or a preset name) as the values per variable, each variable once."""
  out: dict[str, list] = {}
  for text in values:
    for item in PRESETS.get(text.strip(), (text,)):
      var, sep, rest = item.partition("=")
      var = var.strip()
      if not sep or var not in VARIABLES:
        raise NcclSettingError(f"--nccl_env={text}: expected VAR=v1,v2 with VAR one of {', '.join(VARIABLES)}, or"
                               f" a preset: {', '.join(PRESETS)}")
      if var in out:
        raise NcclSettingError(f"--nccl_env names {var} twice: give its values once, comma-separated")
      out[var] = _values(var, rest)
  return out


def _collectives_of(setting: Setting, requested: Sequence[str]) -> tuple[str, ...]:
  """The requested tuned collectives NCCL runs this algorithm/protocol pair for."""
  out = []
  for name in requested:
    valid = VALID[FUNCTIONS[base(name)]]
    if setting.algorithm and setting.algorithm not in valid:
      continue
    if setting.protocol and not any(setting.protocol in protos for algo, protos in valid.items()
                                    if setting.algorithm in (None, algo)):
      continue
    out.append(name)
  return tuple(out)


def base(collective: str) -> str:
  """all_reduce_max -> all_reduce, reduce_scatter_inplace -> reduce_scatter (the NCCL function's collective)."""
  for name in FUNCTIONS:
    if collective == name or collective.startswith(name + "_"):
      return name
  return collective


def combinations(by_var: Mapping[str, list], requested: Sequence[str]) -> tuple[list[Setting], list[str]]:
  """NCCL's own choice first, then every combination, each with the requested collectives NCCL implements it
  for; and one line per collective left out of a combination or the sweep. Raises NcclSettingError for a
  combination no requested collective has, or when no requested collective is one NCCL's tuner decides."""
  tuned = [c for c in requested if base(c) in FUNCTIONS]
  notes = [f"{c}: not an NCCL collective a tuner decides (send/recv or compiled to another); measured once"
           for c in requested if c not in tuned]
  if not tuned:
    raise NcclSettingError(f"--nccl_env: none of --collectives={','.join(requested)} is decided by NCCL's tuner;"
                           f" choose among {', '.join(FUNCTIONS)} (and their operators)")
  out = [Setting(collectives=tuple(requested))]
  keys = [v for v in VARIABLES if v in by_var]
  for values in itertools.product(*(by_var[k] for k in keys)):
    given = dict(zip(keys, values))
    s = Setting(given.get("NCCL_ALGO"), given.get("NCCL_PROTO"), given.get(CHANNELS))
    runs = _collectives_of(s, tuned)
    if not runs:
      raise NcclSettingError(f"--nccl_env: {_pair(s)} is not an algorithm/protocol NCCL implements for"
                             f" {', '.join(sorted({base(c) for c in tuned}))} (NCCL would silently run its default"
                             f" under that name); {_allowed(tuned)}")
    left = [c for c in tuned if c not in runs]
    notes += [f"{_pair(s)}: {c} left out (NCCL has no such {FUNCTIONS[base(c)]})" for c in left]
    out.append(dataclasses.replace(s, collectives=runs))
  return out, notes


def _pair(s: Setting) -> str:
  return " ".join(f"{k}={v}" for k, v in s.env().items())


def _allowed(tuned: Sequence[str]) -> str:
  funcs = sorted({FUNCTIONS[base(c)] for c in tuned})
  return "; ".join(f"{f}: " + ", ".join(f"{ALGORITHMS[a]}/{'|'.join(PROTOCOLS[p] for p in ps)}"
                                        for a, ps in VALID[f].items()) for f in funcs)


def overriding(environ: Mapping[str, str], own: Sequence[str] = ()) -> list[str]:
  """One line per NCCL variable in `environ` (not among `own`, the combinations' own) that decides before a
  tuner does."""
  return [f"{k}={environ[k]} is set: NCCL applies it before any tuner ({why}); unset it where the tuner should"
          " decide" for k, why in OVERRIDING.items() if k in environ and k not in own]
