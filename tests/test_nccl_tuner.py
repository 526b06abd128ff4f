"""NCCL settings measured side by side (`microbench --nccl_env`) and NCCL's tuner table written from them
(`microbench-report --nccl_tuner_conf`): the combinations NCCL refuses, the runs per setting, and the winner per
size band only where it is beyond noise and tolerance."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from microbench.bench import nccl_runs
from microbench.cluster import nccl_settings as ns
from microbench.tuning import nccl_tuner
from support import ROOT, clean_env, made_once, run_cli

SWEEP = ["--topology=nodes:2,gpus:4", "--scopes=scale_up,scale_out", "--min_bytes=64K", "--max_bytes=1M",
         "--step_factor=4", "--samples=3", "--store=none"]


# ------------------------------------------------------------------------------------------------ settings

def test_nccls_table_holds_what_nccl_says():
  """The facts the refusals stand on (NCCL's tuning.cc): no tree all-gather or reduce-scatter, NVLS and PAT
  with Simple only, no PAT all-reduce."""
  assert "tree" not in ns.VALID["allgather"] and "tree" not in ns.VALID["reducescatter"]
  assert ns.VALID["allreduce"]["nvls"] == ("simple",) and ns.VALID["allgather"]["pat"] == ("simple",)
  assert "pat" not in ns.VALID["allreduce"] and set(ns.VALID["allreduce"]["ring"]) == set(ns.PROTOCOLS)


REQUESTS = [("all_reduce",), ("all_gather",), ("reduce_scatter",), ("all_reduce", "all_gather"),
            ("all_gather", "reduce_scatter", "all_to_all"), ("all_reduce_max", "reduce_scatter_inplace")]


@pytest.mark.parametrize("request_", REQUESTS)
def test_every_pair_runs_where_nccl_has_it_and_nowhere_else(request_):
  """Over every algorithm x protocol x request: a pair no requested collective has is refused in one line; one
  some have runs for exactly those (the others said left out); what no tuner decides is measured once."""
  tuned = [c for c in request_ if ns.base(c) in ns.FUNCTIONS]
  for algo, proto in itertools.product(ns.ALGORITHMS, ns.PROTOCOLS):
    have = [c for c in tuned if proto in ns.VALID[ns.FUNCTIONS[ns.base(c)]].get(algo, ())]
    by_var = {"NCCL_ALGO": [algo], "NCCL_PROTO": [proto]}
    if not have:
      with pytest.raises(ns.NcclSettingError, match="not an algorithm/protocol NCCL implements"):
        ns.combinations(by_var, request_)
      continue
    settings, notes = ns.combinations(by_var, request_)
    assert settings[0] == ns.Setting(collectives=tuple(request_))  # NCCL's own choice, measured first
    assert settings[1].collectives == tuple(have) and settings[1].label == f"{algo}-{proto}"
    assert sum("left out" in n for n in notes) == len(tuned) - len(have)
    assert sum("measured once" in n for n in notes) == len(request_) - len(tuned)


@pytest.mark.parametrize("values,message", [
    (["NCCL_ALGO=^tree"], "each value is one algorithm"),
    (["NCCL_ALGO=allreduce:tree"], "each value is one algorithm"),
    (["NCCL_ALGO=Ringg"], "not Ringg"),
    (["NCCL_PROTO="], "give one or more values"),
    (["NCCL_MAX_NCHANNELS=four"], "whole numbers"),
    (["NCCL_IB_HCA=mlx5_0"], "VAR one of"),
    (["NCCL_ALGO=Ring", "NCCL_ALGO=Tree"], "twice"),
    (["everything"], "a preset"),
])
def test_bad_values_are_one_line(values, message):
  with pytest.raises(ns.NcclSettingError, match=message):
    ns.parse(values)


def test_presets_and_spellings():
  assert ns.parse(["ring-tree-protocols"]) == {"NCCL_ALGO": ["ring", "tree"], "NCCL_PROTO": ["ll", "ll128", "simple"]}
  assert ns.parse(["NCCL_ALGO=NVLS_Tree,collnetdirect"])["NCCL_ALGO"] == ["nvlstree", "collnetdirect"]
  s = ns.Setting("nvlstree", "simple", 8)
  assert s.env() == {"NCCL_ALGO": "NVLSTree", "NCCL_PROTO": "Simple", "NCCL_MAX_NCHANNELS": "8"}


def test_nothing_a_tuner_decides_is_refused():
  with pytest.raises(ns.NcclSettingError, match="decided by NCCL's tuner"):
    ns.combinations({"NCCL_ALGO": ["ring"]}, ["all_to_all", "ppermute"])


def test_variables_that_override_a_tuner_are_named():
  lines = ns.overriding({"NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "4", "NCCL_IB_HCA": "mlx5"})
  assert len(lines) == 2 and any(l.startswith("NCCL_ALGO=Ring is set") for l in lines)
  assert ns.overriding({"NCCL_ALGO": "Ring"}, own=("NCCL_ALGO",)) == []


def test_each_settings_run_gets_its_own_folder_collectives_and_env():
  argv = ["--nccl_env=NCCL_ALGO=Ring", "--nccl_env", "NCCL_PROTO=LL", "--outdir", "x", "--collectives=all",
          "--samples=3", "--min_bytes=1K"]
  assert nccl_runs.child_args(argv) == ["--samples=3", "--min_bytes=1K"]


# ------------------------------------------------------------------------------------------- runs and table

@pytest.fixture(scope="module")
def settings_run(tmp_path_factory):
  """A sweep run under NCCL's own choice, Ring and Tree by the toolkit, made once and shared by every worker
  (CPU devices: NCCL is not used, so the settings' times differ by noise only); with what the command printed."""
  def make(out):
    r = run_cli([*SWEEP, "--collectives=all_reduce,all_gather", "--nccl_env=NCCL_ALGO=Ring,Tree", f"--outdir={out}"],
                timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out.with_suffix(".stdout").write_text(r.stdout, encoding="utf-8")  # beside the run folder
  out = made_once(tmp_path_factory, "nccl_settings_run", make)
  return str(out), out.with_suffix(".stdout").read_text(encoding="utf-8")


def test_the_sweep_runs_once_per_setting_and_lists_them(settings_run):
  out, stdout = settings_run
  listing = json.load(open(os.path.join(out, "nccl_settings.json"), encoding="utf-8"))["settings"]
  assert [s["label"] for s in listing] == ["default", "ring", "tree"] and all(s["exit"] == 0 for s in listing)
  assert listing[2]["collectives"] == ["all_reduce"] and "NCCL_ALGO=Tree: all_gather left out" in stdout
  for s in listing:
    meta = json.load(open(os.path.join(out, s["folder"], "meta.json"), encoding="utf-8"))
    env = meta["environment"]["variables"]
    assert {k: v for k, v in env.items() if k in ns.VARIABLES} == s["env"]


def test_a_pair_nccl_lacks_is_refused_before_anything_runs(tmp_path):
  out = tmp_path / "run"
  r = run_cli([*SWEEP, "--collectives=all_gather", "--nccl_env=NCCL_ALGO=Tree", f"--outdir={out}"])
  assert r.returncode == 2 and "not an algorithm/protocol NCCL implements" in r.stderr.strip().splitlines()[-1]
  assert not out.exists() and "Traceback" not in r.stderr


def _arm(src: str, dest, env: dict[str, str], seed: int, factor: float = 1.0, band=(0, 0), spread: float = 0.02):
  """A setting's run made from NCCL's default run (labelled: constructed, not measured): each point's measured
  time, x `factor` inside `band`, with eight samples about it of a lognormal spread (2%: a quiet machine; the
  CPU's own samples by difference can be <= 0, which leaves a point without an interval)."""
  shutil.copytree(src, dest)
  meta = json.load(open(os.path.join(dest, "meta.json"), encoding="utf-8"))
  meta["environment"]["variables"].update(env)
  meta["constructed"] = f"from {src}: x{factor} in {band}, spread {spread}"
  json.dump(meta, open(os.path.join(dest, "meta.json"), "w", encoding="utf-8"))
  rng = np.random.default_rng(seed)
  path = os.path.join(dest, "results.jsonl")
  recs = [json.loads(l) for l in open(path, encoding="utf-8")]
  with open(path, "w", encoding="utf-8") as f:
    for r in recs:
      t = r["time_us"] * (factor if band[0] <= r["bytes"] <= band[1] else 1.0)
      s = t * np.exp(spread * rng.standard_normal(8))
      f.write(json.dumps({**r, "samples_us": s.tolist(), "time_us": float(np.median(s)), "samples": 8}) + "\n")
  return str(dest)


def _default(settings_run, tmp_path) -> str:
  """NCCL's own choice, constructed like the other settings from the measured default run."""
  return _arm(os.path.join(settings_run[0], "nccl_settings", "default"), tmp_path / "default", {}, 0)


def _conf(tmp_path, *runs, tolerance=0.05) -> tuple[str, subprocess.CompletedProcess]:
  out = tmp_path / "nccl_tuner.conf"
  r = subprocess.run([sys.executable, "-m", "microbench.cli.report", *runs, f"--nccl_tuner_conf={out}",
                      f"--tolerance={tolerance}"], capture_output=True, text=True, timeout=300, env=clean_env(),
                     cwd=ROOT)
  assert r.returncode == 0, r.stderr[-2000:]
  return out.read_text(), r


def _rules(text: str) -> list[list[str]]:
  return [l.split(",") for l in text.splitlines() if l and not l.startswith("#")]


def test_the_winner_of_a_band_gets_the_line_and_nowhere_else(settings_run, tmp_path):
  """Ring/LL 1.6x faster at 256K and 1M in the constructed run: one line per (collective, nodes, ranks) for that
  band, its bounds from the middle between measured sizes to the largest; Tree/Simple (the same times) none."""
  base = _default(settings_run, tmp_path)
  fast = _arm(base, tmp_path / "ring-ll", {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}, 1, 0.6, (200_000, 1 << 20))
  same = _arm(base, tmp_path / "tree-simple", {"NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple"}, 2)
  text, r = _conf(tmp_path, base, fast, same)
  rules = _rules(text)
  assert rules and all(len(x) == 10 for x in rules)
  assert {(x[0], x[3], x[4]) for x in rules} <= {("allreduce", "ring", "ll"), ("allgather", "ring", "ll")}
  for x in rules:
    lo, hi = int(x[1]), int(x[2])
    assert lo == int((65536 * 262144) ** 0.5) + 1 and hi == 1 << 20, x
    assert x[5] == "-1" and x[8:] == ["-1", "-1"]
  keys = {(x[0], x[6], x[7]) for x in rules}
  assert keys == {("allreduce", "1", "4"), ("allreduce", "2", "2"), ("allgather", "1", "4"), ("allgather", "2", "2")}
  assert "NCCL's own choice (no setting faster" in r.stdout and "tree-simple" in r.stdout


@pytest.mark.parametrize("factor,spread", [(0.97, 0.02), (0.9, 0.8)])
def test_a_gain_within_tolerance_or_noise_keeps_nccls_choice(settings_run, tmp_path, factor, spread):
  """Mutations of the rule: 3% faster (inside the 5% tolerance), or 10% faster with samples spread so wide the
  interval holds 1: no line (a rule that took the faster median would write one)."""
  base = _default(settings_run, tmp_path)
  arm = _arm(base, tmp_path / "ring-ll", {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}, 3, factor, (0, 1 << 30), spread)
  text, _ = _conf_here(base, arm)
  assert _rules(text) == []


def _conf_here(*runs: str, tolerance: float = 0.05) -> tuple[str, list[str]]:
  """What --nccl_tuner_conf writes, in this process (the command's own run is tested above)."""
  arms = nccl_tuner.arms(list(runs))
  return nccl_tuner.render(nccl_tuner.bands(nccl_tuner.results(arms), tolerance), tolerance, list(runs))


def test_settings_that_cannot_make_a_line_are_said(settings_run, tmp_path):
  base = _default(settings_run, tmp_path)
  proto_only = _arm(base, tmp_path / "ll", {"NCCL_PROTO": "LL"}, 4, 0.5, (0, 1 << 30))
  text, unwritten = _conf_here(base, proto_only)
  assert _rules(text) == [] and unwritten and all("names an algorithm and a protocol" in u for u in unwritten)
  with pytest.raises(nccl_tuner.TunerError, match="no run without NCCL_ALGO"):
    nccl_tuner.arms([proto_only])
  listing = subprocess.run([sys.executable, "-m", "microbench.cli.report", proto_only, "--nccl_tuner_conf=x"],
                           capture_output=True, text=True, timeout=300, env=clean_env(), cwd=ROOT)
  assert listing.returncode == 2 and "no run without NCCL_ALGO" in listing.stderr.strip().splitlines()[-1]


def test_the_folder_nccl_env_wrote_is_read_whole(settings_run, tmp_path):
  text, r = _conf(tmp_path, settings_run[0])
  assert "3 NCCL settings (default, ring, tree)" in r.stdout
  assert text.startswith("# NCCL tuner configuration") and "*nChannels = 0" in text
