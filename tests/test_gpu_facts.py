"""The machine facts the toolkit states, pinned to their sources, and the bus-bandwidth bounds pinned to physics.

Every GPU kind (microbench/fabric/gpu_specs/*.toml) states its memory as the device reports it (nvidia-smi's
memory.total, a whole number of MiB) and names a source for every figure. `bus_peak` never claims more than the
links a GPU has can carry: inside one NVLink domain (a DGX node, a whole NVL72 rack) not more than the GPU's
NVLink rate, across levels not more than its NVLink plus its NIC. Fast: no compiles, no subprocesses.
"""

from __future__ import annotations

import os

import pytest

from microbench.meshes.scopes import SCOPE_AXES
from microbench.fabric import description as fd
from microbench.fabric import gpu_kinds
from microbench.fabric import link_peaks
from microbench.aot import gpu_compile
from microbench.train import flops_peaks as mfu_peaks

MIB = 2**20
GIB = 2**30

# nvidia-smi memory.total (MiB) per kind, as the device reports it (rocminfo's pool for an MI250X GCD).
REPORTED_MIB = {"a100": 81920, "h100": 81559, "h100-pcie": 81559, "h100-nvl": 95830, "h200": 143771,
                "h200-nvl": 143771, "gh200": 97871, "b200": 183359, "b300": 275040, "gb200": 189471,
                "gb300": 284208, "mi250x": 65520}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute")


# --------------------------------------------------------------------------------------------- device memory

def test_h200_memory_is_what_the_device_reports():
  h200 = gpu_kinds.kinds()["h200"]
  assert h200.memory_bytes == 143771 * MIB  # 140.4 GiB, not the datasheet's 141 GB (131.3 GiB)
  assert h200.memory_source.startswith("reported") and "nvidia-smi" in h200.memory_source
  assert "143771" in h200.memory_source and "thundergolfer.com" in h200.memory_source
  # The H200 the project borrows reports device kind "NVIDIA H200" and about 139-140 GiB.
  assert gpu_kinds.lookup("NVIDIA H200") is h200 and 139 * GIB < h200.memory_bytes < 141 * GIB
  assert f"device_memory_size: {143771 * MIB}" in h200.target_config()


def test_every_kind_states_its_memory_in_whole_mib_and_how_it_is_known():
  kinds = gpu_kinds.kinds()
  assert {k: v.memory_mib for k, v in kinds.items()} == REPORTED_MIB
  for kind in kinds.values():
    assert kind.memory_bytes % MIB == 0 and kind.memory_bytes == kind.memory_mib * MIB, kind.name
    src = kind.memory_source
    assert src.startswith(("reported", "datasheet, unverified")), kind.name
    if src.startswith("reported"):
      assert str(kind.memory_mib) in src, kind.name  # the reported figure itself, where it was posted
    if kind.xla:  # one place: the compiler is told the same figure
      assert f"device_memory_size: {kind.memory_bytes}\n" in kind.target_config()


def test_every_figure_names_its_source():
  for kind in gpu_kinds.kinds().values():
    figures = kind.figures()
    assert {"memory", "bf16_tflops", "tf32_tflops", "gpus_per_node", "nodes_per_rack"} <= set(figures)
    assert ("nvlink" in figures) == bool(kind.nvlink) and (set(kind.xla or {}) <= set(figures))
    for fig in figures:
      assert len(kind.source(fig)) > 20, (kind.name, fig)
    # The MFU peak's record quotes the same source.
    assert kind.peak_cite in mfu_peaks.table_peak(kind.device_kind, "bfloat16").source


def test_corrected_device_figures_match_the_device_reports():
  k = gpu_kinds.kinds()
  assert k["gb200"].xla["sm_count"] == k["gb300"].xla["sm_count"] == 152  # XLA's device captures, not B200's 148
  assert k["b200"].xla["sm_count"] == k["b300"].xla["sm_count"] == 148
  assert k["h200"].xla["l2_cache_bytes"] == k["gh200"].xla["l2_cache_bytes"] == 60 * MIB  # six-stack GH100
  assert k["h100"].xla["l2_cache_bytes"] == 50 * MIB
  assert k["b200"].xla["l2_cache_bytes"] == 132644864  # 126.5 MiB
  # Memory bandwidth as the device gives it: memory clock x bus width x 2 (DDR) / 8.
  for name, mhz, bits in [("a100", 1593, 5120), ("h100", 2619, 5120), ("gh200", 2619, 6144),
                          ("b200", 3996, 7680), ("b300", 3996, 7680), ("gb200", 3996, 7936)]:
    assert k[name].xla["memory_bandwidth"] == mhz * 10**6 * bits * 2 // 8, name


@pytest.fixture
def specs_dir(tmp_path, monkeypatch):
  """gpu_kinds reading a scratch copy of one spec file; the real table comes back afterwards."""
  monkeypatch.setattr(gpu_kinds, "SPECS", str(tmp_path))
  gpu_kinds.kinds.cache_clear()
  yield tmp_path
  gpu_kinds.kinds.cache_clear()


def _h100_text() -> str:
  with open(os.path.join(os.path.dirname(gpu_kinds.__file__), "gpu_specs", "h100.toml"), encoding="utf-8") as f:
    return f.read()


@pytest.mark.parametrize("change, complaint", [
    (("bytes = 85520809984", "bytes = 85000000000"), "bytes = mib x 1048576"),
    (("source = \"\"\"reported:", "source = \"\"\"trust me:"), "must begin with"),
    (('figures = ["cudnn"]', 'figures = []'), "without: cudnn"),
    (('figures = ["nvlink"]', 'figures = ["nvlink", "hbm_stacks"]'), "not figures of this kind: hbm_stacks"),
])
def test_a_spec_without_its_sources_is_refused(specs_dir, change, complaint):
  text = _h100_text()
  assert text.count(change[0]) == 1
  (specs_dir / "h100.toml").write_text(text.replace(*change), encoding="utf-8")
  with pytest.raises(ValueError, match=complaint):
    gpu_kinds.kinds()


def test_a_50_gib_all_reduce_fits_an_h200(monkeypatch):
  """Its argument and output (100 GiB, no aliasing) fit the 75% JAX takes of 143771 MiB (105.3 GiB); against the
  datasheet's 141 GB (98.5 GiB usable) the verdict was DOES NOT FIT, 7% pessimistic."""
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
  need = 2 * 50 * GIB
  f = gpu_compile.fit(need, gpu_kinds.target("h200").memory_bytes)
  assert f["fits"] is True and f["usable_bytes"] == int(0.75 * 143771 * MIB)
  assert round(f["usable_bytes"] / GIB, 1) == 105.3
  old = gpu_compile.fit(need, 141_000_000_000)
  assert old["fits"] is False and round(old["usable_bytes"] / GIB, 1) == 98.5


@pytest.mark.parametrize("name", ["XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"])
def test_the_fit_uses_the_memory_fraction_under_either_name(monkeypatch, name):
  """Current JAX reads XLA_CLIENT_MEM_FRACTION, older JAX XLA_PYTHON_CLIENT_MEM_FRACTION: a run under either
  gets that share of the device, so the fit verdict must too."""
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.setenv(name, "0.5")
  assert gpu_compile.mem_fraction() == 0.5


# ------------------------------------------------------------------------------------ bus peaks vs the links

def _cases():
  """(label, scope, axes, extents, peaks, NVLink GB/s per GPU, NIC GB/s per GPU, NVLink domain spans the rack):
  every GPU kind with NVLink (its default peaks plus an NDR NIC per GPU) and every described fabric."""
  nic = link_peaks.LINKS["ndr"][0]
  for kind in gpu_kinds.kinds().values():
    peaks = link_peaks.resolve(kind.device_kind, link_peaks.parse("scale_out:ndr"))
    if not kind.nvlink:
      continue
    extents = {"rack": 2, "node": kind.nodes_per_rack if kind.nodes_per_rack > 1 else 4, "gpu": kind.gpus_per_node}
    for scope, axes in SCOPE_AXES.items():
      yield (kind.name, scope, axes, extents, peaks, link_peaks.LINKS[kind.nvlink][0], nic, bool(kind.rack_nvlink))
  for name in fd.SYSTEMS:
    fab = fd.system(name)
    peaks = fab.level_peaks()
    extents = {"rack": 2, "node": fab.nodes_per_domain if fab.nodes_per_domain > 1 else 4, "gpu": fab.gpus_per_node}
    per_rank_nic = fab.nic_gbps * fab.nics_per_node / fab.gpus_per_node
    for scope, axes in SCOPE_AXES.items():
      yield (f"fabric {name}", scope, axes, extents, peaks, fab.scale_up_gbps, per_rank_nic, fab.nodes_per_domain > 1)


def link_budget(axes, extents, nvlink_gbps, nic_gbps, rack_is_nvlink) -> float:
  """What a GPU's links can carry for a group spanning `axes`, from the machine alone: its NVLink if the group
  has peers in its NVLink domain, plus its NIC if it has peers beyond; the same links count once."""
  crossed = {a for a in axes if extents.get(a, 1) > 1}
  uses_nvlink = "gpu" in crossed or ("node" in crossed and rack_is_nvlink)
  uses_nic = "rack" in crossed or ("node" in crossed and not rack_is_nvlink)
  return (nvlink_gbps if uses_nvlink else 0.0) + (nic_gbps if uses_nic else 0.0)


def violations() -> list[tuple[str, str, str, float, float]]:
  """Every (kind or fabric, scope, collective) whose bus_peak exceeds what the links can physically carry."""
  out = []
  for label, scope, axes, extents, peaks, nvlink, nic, rack_is_nvlink in _cases():
    budget = link_budget(axes, extents, nvlink, nic, rack_is_nvlink)
    for coll in COLLECTIVES:
      peak = link_peaks.bus_peak(coll, axes, extents, peaks)
      if peak is not None and peak > budget * (1 + 1e-9):
        out.append((label, scope, coll, peak, budget))
  return out


def test_no_bus_peak_exceeds_what_the_links_carry():
  """Property over every kind x scope x collective (and every described fabric): within one NVLink domain the
  bound is the GPU's NVLink rate, across NVLink and NIC their sum (the bounds assume no in-network reduction:
  ALGORITHMS)."""
  assert list(_cases()) and violations() == []


def test_the_property_catches_nvl72_levels_counted_twice(monkeypatch):
  """Mutation: trays and racks of one NVLink domain treated as two overlapping levels again (the old model)."""
  monkeypatch.setattr(link_peaks, "nvlink_rack", lambda peaks: False)
  found = {(label, scope, coll): round(peak) for label, scope, coll, peak, _ in violations()}
  assert found[("gb200", "rack_scale", "all_gather")] == 1183  # above the 900 GB/s a GPU receives over NVLink 5
  assert ("gb300", "rack_scale", "all_reduce") in found and ("fabric nvl72", "rack_scale", "all_to_all") in found


def test_nvl72_and_dgx_peaks_are_their_nvlink():
  nvl72 = {"rack": 1, "node": 18, "gpu": 4}
  for kind in ("NVIDIA GB200", "NVIDIA GB300"):
    peaks = link_peaks.resolve(kind)
    for coll in COLLECTIVES:
      assert link_peaks.bus_peak(coll, SCOPE_AXES["rack_scale"], nvl72, peaks) == pytest.approx(900), (kind, coll)
  dgx = {"rack": 1, "node": 2, "gpu": 8}
  for coll in COLLECTIVES:
    assert link_peaks.bus_peak(coll, ("gpu",), dgx, link_peaks.resolve("NVIDIA H100 80GB HBM3")) == 450
  # A NIC given for rack_scale is a network of its own, not the NVLink domain: levels still overlap.
  nic_rack = link_peaks.parse("scale_up:nvlink4,rack_scale:ndr,scale_out:hdr")
  assert not link_peaks.nvlink_rack(nic_rack) and link_peaks.nvlink_rack(link_peaks.resolve("NVIDIA GB200"))
  assert link_peaks.bus_peak("all_reduce", ("node", "gpu"), dgx, nic_rack) == pytest.approx(
      (15 / 16) / max(7 / (8 * 450), 1 / (2 * 8 * 50)))


def test_every_peak_names_the_algorithm_it_assumes():
  assert set(link_peaks.ALGORITHMS) == set(COLLECTIVES)
  assert "NVLS" in link_peaks.ALGORITHMS["all_reduce"] and "ring" in link_peaks.ALGORITHMS["all_gather"]
  assert "direct" in link_peaks.ALGORITHMS["all_to_all"]
  rec = link_peaks.share(450.0, 900.0, "all_reduce")
  assert rec["busbw_pct_of_peak"] == 50.0 and rec["peak_algorithm"] == link_peaks.ALGORITHMS["all_reduce"]
  assert link_peaks.share(1.0, None, "ppermute")["peak_algorithm"] == link_peaks.ALGORITHMS["ppermute"]
  assert set(link_peaks.share(1.0, 2.0)) == {"peak_gbps", "busbw_pct_of_peak"}  # records without it unchanged


def test_the_studys_machines_and_gpus_are_the_fabrics():
  """One vocabulary: a study machine's nodes, L1 switches (leaves) and groups are its fabric description's,
  and the study's GPU peaks are the kinds' except the seed study's named calibration."""
  from microbench.study import machines as mm  # pylint: disable=g-import-not-at-top
  from microbench.study import workloads as wl  # pylint: disable=g-import-not-at-top
  for name in fd.SYSTEMS:
    if name not in mm.PRESETS:
      continue
    m, f = mm.parse(name), fd.system(name)
    assert (m.gpus_per_node, m.nodes_per_l1, m.l1_per_group, m.gpu) == (
        f.gpus_per_node, f.nodes_per_leaf, f.leaves_per_group, f.gpu), name
  kinds = gpu_kinds.kinds()
  from microbench.fabric import tpu_kinds  # pylint: disable=g-import-not-at-top
  for name, g in wl.GPUS.items():
    if name in wl.CALIBRATION:
      continue
    if name.lower() in tpu_kinds.kinds():  # a TPU chip's roofline: its bf16 peak and HBM bandwidth
      tpu = tpu_kinds.kinds()[name.lower()]
      assert g.peak_flops == tpu.bf16_tflops * 1e12 and g.bandwidth == tpu.hbm_gbytes_s * 1e9, name
      continue
    kind = kinds[name.lower()]
    assert g.peak_flops == kind.bf16_tflops * 1e12 and g.bandwidth == kind.xla["memory_bandwidth"], name
  assert wl.GPUS["B300"].peak_flops == 2250e12  # the kind's dense bf16, not the seed's 3.5 PFLOP/s
