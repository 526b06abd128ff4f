"""NCCL INFO logs read into facts (report/nccl_log.py). The fixtures in tests/fixtures/nccl_logs/ are one log per
NCCL era, written in the line formats of that version's source and of the logs users paste into NVIDIA/nccl,
nccl-tests and aws-ofi-nccl issues: the facts are NCCL's, the wording of each line is the version's."""

from __future__ import annotations

import io
import os
import types

import pytest

from microbench.report import nccl_log

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "nccl_logs")


def _log(name: str) -> str:
  with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
    return f.read()


def _choice(coll, size, algo, proto, per_rank=False, calls=1):
  return {"collective": coll, "bytes": size, "algorithm": algo, "protocol": proto, "per_rank": per_rank,
          "calls": calls}


def _comm(ranks, nodes=None, local=None, mnnvl=None):
  return {"ranks": ranks, "nodes": nodes, "local_ranks": local, "mnnvl": mnnvl}


EXPECTED = {
    # 2.12: the version on stdout without a prefix, P2P lines without "/connIndex", SHM as "direct shared
    # memory", no choice lines (TRACE only before 2.21), communicators without nNodes.
    "nccl_2.12_ib_stdout.log": dict(
        versions=["2.12.12+cuda11.7"], processes=4, networks=["IB"], net_devices=["mlx5_0:1/IB"], plugin=[],
        channels=2, nvls_channels=None, transports=["NET/IB/0/GDRDMA", "P2P/IPC/read", "SHM/direct"], trees=True,
        nvls_support=None, nvls=False, collnet=False, communicators=[_comm(4)], choices=[]),
    # 2.18: sockets (no IB device in the container), P2P/CUMEM, "0 nvls channels" but no NVLS support line.
    "nccl_2.18_socket.log": dict(
        versions=["2.18.5+cuda12.2"], processes=1, networks=["Socket"], net_devices=["eth0:192.168.1.3<0>"],
        channels=2, nvls_channels=0, transports=["NET/Socket/0"], nvls_support=None, nvls=False,
        communicators=[_comm(2)], choices=[]),
    # 2.19 with HPC-X's plugin: IBext network, /IB/SHARP ports, a SHARP collnet plugin loaded, NVLS tree.
    "nccl_2.19_hpcx_sharp.log": dict(
        versions=["2.19.3+cuda12.3"], processes=2, networks=["IBext"],
        net_devices=["mlx5_0:1/IB/SHARP", "mlx5_1:1/IB/SHARP"], plugin=["NCCL RDMA Plugin v6"],
        collnet_plugin=["SHARP"], channels=32, nvls_channels=16,
        transports=["NET/IBext/0/GDRDMA", "NET/IBext/1/GDRDMA", "P2P/IPC/read"], nvls_support=True, nvls=True,
        collnet=False, communicators=[_comm(16)], choices=[]),
    # 2.21: choice lines without a collective, paired through COLL lines by size; one with no COLL line left
    # unnamed. nNodes/localRanks/MNNVL comm lines, both printed lines of one communicator counted once.
    "nccl_2.21_nvls_ib_coll.log": dict(
        versions=["2.21.5+cuda12.4"], processes=2, networks=["IB"], channels=24, nvls_channels=16,
        transports=["NET/IB/0/GDRDMA", "P2P/CUMEM/read"], nvls_support=True, nvls=True,
        communicators=[_comm(16, 2, 8, False)],
        choices=[_choice(None, 4096, "tree", "LL"), _choice("AllGather", 16777216, "ring", "Simple"),
                 _choice("AllReduce", 67108864, "nvls_tree", "Simple", calls=2)]),
    # 2.23: named choice lines with algorithm numbers, all-gather counting the whole buffer; NCCL_ALGO set.
    "nccl_2.23_nvls_ring_forced.log": dict(
        versions=["2.23.4+cuda12.6"], processes=1, networks=["IB"], channels=24, nvls_channels=16,
        transports=["P2P/CUMEM/read"], nvls_support=True, communicators=[_comm(8, 1, 8, False)],
        env={"NCCL_SOCKET_IFNAME": "eth0", "NCCL_ALGO": "Ring"},
        choices=[_choice("AllGather", 8388608, "ring", "Simple"), _choice("AllReduce", 8192, "ring", "LL"),
                 _choice("AllReduce", 1048576, "ring", "LL128"), _choice("AllReduce", 67108864, "ring", "Simple"),
                 _choice("AllReduce", 268435456, "ring", "Simple", calls=2)]),
    # 2.27 on EFA: aws-ofi-nccl, the "Libfabric" network, a tuner plugin, NVLS_NCHANNELS, algorithm names,
    # all-gather and reduce-scatter counting one rank's bytes.
    "nccl_2.27_efa.log": dict(
        versions=["2.27.7+cuda12.9"], processes=1, networks=["Libfabric"], net_devices=["efa x32"],
        plugin=["Libfabric", "OFI provider efa", "aws-ofi-nccl 1.14.0"], tuner=["nccl_ofi_tuner"], channels=32,
        nvls_channels=16, transports=["NET/Libfabric/0/GDRDMA/Shared", "NET/Libfabric/1/GDRDMA/Shared",
                                      "P2P/CUMEM/read"],
        nvls_support=True, nvls=True, communicators=[_comm(16, 2, 8, False)],
        choices=[_choice("AllGather", 2097152, "ring", "Simple", per_rank=True),
                 _choice("AllReduce", 8192, "tree", "LL"),
                 _choice("AllReduce", 268435456, "nvls_tree", "Simple", calls=2),
                 _choice("ReduceScatter", 2097152, "pat", "Simple", per_rank=True)]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_nccl_versions_log_reads_into_its_facts(name):
  facts = nccl_log.parse(_log(name))
  for key, want in EXPECTED[name].items():
    assert facts[key] == want, key
  assert facts["unread"] == 0 and facts["problems"] == [] and facts["info_lines"] > 20


def test_the_fixtures_cover_every_era_the_parser_names():
  versions = {nccl_log.parse(_log(n))["versions"][0][:4] for n in EXPECTED}
  assert versions == {"2.12", "2.18", "2.19", "2.21", "2.23", "2.27"}
  assert sorted(os.listdir(FIXTURES)) == sorted(EXPECTED)  # a new fixture needs its expected facts


# Malformed logs: a clear problem line, and every fact the rest of the log holds still read.

def _without(facts, *keys):
  return {k: v for k, v in facts.items() if k not in ("unread", "problems", "info_lines", *keys)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_file_cut_mid_line_loses_only_that_line(name):
  text = _log(name)
  whole = nccl_log.parse({name: text.rstrip("\n").rsplit("\n", 1)[0] + "\n"})  # the log without its last line
  cut = nccl_log.parse({name: text.rstrip("\n")[:-7]})  # the process died writing the last line
  assert cut["unread"] == 1 and len(cut["problems"]) == 1
  assert cut["problems"][0].startswith(f"{name}:{text.count(chr(10))}: cut short at the end of the file")
  assert _without(cut) == _without(whole)


def test_a_known_line_that_stops_short_is_named_not_guessed():
  text = _log("nccl_2.23_nvls_ring_forced.log")
  broken = text.replace("AllReduce: 1048576 Bytes -> Algo 1 proto 1 time 31.456001", "AllReduce: 1048576 Bytes -> Algo")
  broken = broken.replace("[2]mlx5_2:1/IB [3]mlx5_3:1/IB [RO]; OOB eth0:10.7.147.73<0>", "[2]mlx5_2")
  facts = nccl_log.parse(broken)
  assert facts["unread"] == 2
  assert [p.split(": ", 1)[1].split(" line")[0] for p in facts["problems"]] == ["NET/ device", "tuning"]
  assert "mlx5_2" not in facts["net_devices"] and facts["net_devices"] == []  # the cut line adds no NIC
  good = nccl_log.parse(text)
  assert facts["choices"] == [c for c in good["choices"] if c["bytes"] != 1048576]
  assert _without(facts, "choices", "net_devices") == _without(good, "choices", "net_devices")
  (line,) = [w for w in nccl_log.warnings(facts) if "not read" in w]
  assert line.startswith("2 NCCL log line(s) not read, the rest was: log:6: NET/ device line cut short")


def test_binary_junk_is_skipped_and_the_nccl_lines_around_it_read(tmp_path):
  """A crash can leave NULs or bytes that are not UTF-8 in a log (and glued to the start of a line)."""
  from microbench.cluster import nccl_debug  # pylint: disable=g-import-not-at-top
  text = _log("nccl_2.27_efa.log")
  lines = text.encode().split(b"\n")
  junk = lines[:3] + [b"\x00\x00\x00\xff\xfe\x9c garbage \x00"] + [b"\x00\x00\xff" + lines[3]] + lines[4:]
  (tmp_path / "nccl").mkdir()
  (tmp_path / "nccl" / "ip-10-1-2-3.88.log").write_bytes(b"\n".join(junk))
  facts = nccl_log.parse(nccl_debug.read_logs(str(tmp_path)))
  assert facts["problems"] == ["ip-10-1-2-3.88.log: 2 line(s) of binary data skipped (what NCCL lines they held"
                               " were read)"]
  assert _without(facts) == _without(nccl_log.parse(text))  # the version on the junk-prefixed line too


def test_two_processes_interleaved_read_as_their_separate_files():
  a, b = _log("nccl_2.21_nvls_ib_coll.log").splitlines(), _log("nccl_2.27_efa.log").splitlines()
  mixed = [line for pair in zip(a, b) for line in pair] + a[len(b):] + b[len(a):]
  apart = nccl_log.parse({"a.log": "\n".join(a) + "\n", "b.log": "\n".join(b) + "\n"})
  assert nccl_log.parse("\n".join(mixed) + "\n") == apart
  # One process's line cut into by another's (both wrote to one stdout): the cut one is named, the other read.
  i = next(i for i, line in enumerate(a) if "16777216 Bytes -> Algo" in line)  # node 1's all-gather choice
  cut = a[:i] + [a[i][:60] + b[0]] + [a[i][60:]] + a[i + 1:]
  facts = nccl_log.parse("\n".join(cut) + "\n")
  assert facts["unread"] == 1
  assert facts["problems"] == [f"log:{i + 1}: a line another process's line cut into, not read"]
  good = nccl_log.parse("\n".join(a) + "\n")
  assert facts["choices"] == [c for c in good["choices"] if c["collective"] != "AllGather"]  # not guessed
  assert _without(facts, "choices", "processes") == _without(good, "choices", "processes")


def test_an_empty_file_is_named_and_the_others_read():
  text = _log("nccl_2.18_socket.log")
  facts = nccl_log.parse({"gpu-3.4101.log": text, "gpu-4.5202.log": ""})
  assert facts["problems"] == ["gpu-4.5202.log: empty (the process ended before NCCL started, or ran no"
                               " communicator)"] and facts["unread"] == 0
  assert _without(facts) == _without(nccl_log.parse(text))
  assert nccl_log.warnings(facts)[0] == f"NCCL logs: {facts['problems'][0]}"


def test_a_log_without_nccl_lines_gives_empty_facts_and_says_how_to_get_them():
  f = nccl_log.parse("srun: error: node01: task 0: Exited with exit code 1\nrandom text\n")
  assert f["info_lines"] == 0 and f["networks"] == [] and f["choices"] == []
  assert nccl_log.warnings(f) == ["no NCCL INFO lines: set NCCL_DEBUG=INFO to record what NCCL did"]
  assert nccl_log.warnings(nccl_log.parse({}), captured=True)[0].startswith("NCCL wrote no INFO lines")


def test_prefixes_other_launchers_add_do_not_hide_the_lines():
  """mpirun's `[1,0]<stdout>:`, a log shipper's timestamp glued to the host name, a rank prefix `[0] `."""
  text = ("[1,0]<stdout>:node01:20811:20811 [0] NCCL INFO Using network IB\n"
          "2025-05-16T16:39:51.208-07:00ip-10-36-29-253:79:79 [0] NCCL INFO Using network AWS Libfabric\n"
          "[0] NCCL INFO 805306368 Bytes -> Algo 1 proto 2 time 3970.683594\n")
  facts = nccl_log.parse(text)
  assert facts["networks"] == ["AWS Libfabric", "IB"] and facts["info_lines"] == 3 and facts["processes"] == 2
  assert facts["choices"] == [_choice(None, 805306368, "ring", "Simple")]


# Warnings, each with the log that must raise it and the same log healthy (or the other way round).

IB_PORT = {"nics": [{"device": "mlx5_0", "port": "1", "link_layer": "InfiniBand", "state": "4: ACTIVE",
                     "rate": "400 Gb/sec (4X NDR)"}]}


def test_sockets_where_a_fast_network_was_expected_is_one_line():
  why = nccl_log.expected_network(IB_PORT)
  assert why == "the host has active InfiniBand RDMA ports (mlx5_0:1)"
  sockets = nccl_log.parse(_log("nccl_2.18_socket.log"))
  (line,) = nccl_log.warnings(sockets, why)
  assert line.startswith("NCCL used sockets (NET/Socket) although the host has active InfiniBand")
  assert "NCCL_IB_HCA" in line
  assert nccl_log.warnings(sockets, None) == []  # sockets are all an Ethernet cluster has
  ib = _log("nccl_2.12_ib_stdout.log")
  assert nccl_log.warnings(nccl_log.parse(ib), why) == []
  # The mutant: the same 4-rank job with NCCL on sockets.
  fell_back = ib.replace("Using network IB", "Using network Socket").replace("NET/IB/0/GDRDMA", "NET/Socket/0")
  assert nccl_log.warnings(nccl_log.parse(fell_back), why)[0].startswith("NCCL used sockets")
  # Sockets on one node carried nothing: no connection went through the network.
  one_node = "\n".join(l for l in fell_back.splitlines() if "NET/Socket/" not in l) + "\n"
  assert nccl_log.warnings(nccl_log.parse(one_node), why) == []


@pytest.mark.parametrize("environment,why", [
    (IB_PORT, "the host has active InfiniBand RDMA ports (mlx5_0:1)"),
    ({"nics": [{"device": "mlx5_10", "port": "1", "link_layer": "Ethernet", "state": "4: ACTIVE"}]},
     "the host has active RoCE RDMA ports (mlx5_10:1)"),
    ({"nics": [{"device": "cxi0", "port": None, "link_layer": "cxi", "state": None}]},
     "the host has Slingshot (cxi) NICs"),
    ({"variables": {"NCCL_IB_HCA": "=mlx5_0:1"}}, "NCCL_IB_HCA==mlx5_0:1 was set"),
    ({"variables": {"NCCL_NET": "IB"}}, "NCCL_NET=IB was set"),
    ({"nics": [{**IB_PORT["nics"][0], "state": "1: DOWN"}]}, None),  # a port that is down is no expectation
    ({**IB_PORT, "variables": {"NCCL_IB_DISABLE": "1"}}, None),  # the user chose sockets
    ({**IB_PORT, "variables": {"NCCL_NET": "Socket"}}, None),
    ({}, None),
])
def test_what_makes_a_fast_network_expected(environment, why):
  assert nccl_log.expected_network(environment) == why


def test_nvls_available_but_never_chosen_for_large_all_reduces_is_one_line():
  forced = nccl_log.parse(_log("nccl_2.23_nvls_ring_forced.log"))
  (line,) = nccl_log.warnings(forced)
  assert line.startswith("NVLS (NVLink SHARP) was available but NCCL chose ring/Simple for every all-reduce of"
                         " 64M-256M (NCCL_ALGO=Ring was set)")
  healthy = _log("nccl_2.27_efa.log")
  assert nccl_log.warnings(nccl_log.parse(healthy)) == []
  # The mutant: the same run where NCCL's large all-reduces went ring.
  mutant = healthy.replace("Algo NVLS_TREE proto SIMPLE", "Algo RING proto SIMPLE")
  assert "NCCL chose ring/Simple for every all-reduce of 256M" in nccl_log.warnings(nccl_log.parse(mutant))[0]
  # Small all-reduces on ring say nothing: latency decides there.
  small = healthy.replace("AllReduce: 268435456 Bytes -> Algo NVLS_TREE", "AllReduce: 1048576 Bytes -> Algo RING")
  assert nccl_log.warnings(nccl_log.parse(small)) == []
  # Where the support line says "not available", ring is all there is.
  absent = mutant.replace("support is available", "support is not available")
  assert nccl_log.warnings(nccl_log.parse(absent)) == []


def test_nvls_available_with_zero_nvls_channels_is_one_line():
  text = _log("nccl_2.23_nvls_ring_forced.log").replace("16 nvls channels", "0 nvls channels")
  (line,) = nccl_log.warnings(nccl_log.parse(text))
  assert line.startswith("NVLS (NVLink SHARP) multicast was available but NCCL set up 0 NVLS channels")


COLLNET_UP = ("dgx-a:3310:3372 [0] NCCL INFO CollNet 00/0 : 0 [receive] via COLLNET/SHARP/0\n"
              "dgx-a:3310:3372 [0] NCCL INFO Connected collnet + chain\n")


def test_a_sharp_plugin_loaded_but_collnet_off_is_one_line():
  text = _log("nccl_2.19_hpcx_sharp.log")
  (line,) = nccl_log.warnings(nccl_log.parse(text))
  assert line.startswith("CollNet plugin SHARP was loaded but CollNet (SHARP) was not used"
                         " (NCCL_COLLNET_ENABLE is not set)")
  assert "(NCCL_COLLNET_ENABLE=1)" in nccl_log.warnings(nccl_log.parse(text), variables={"NCCL_COLLNET_ENABLE": "1"})[0]
  no_plugin = "\n".join(l for l in text.splitlines() if "Loaded coll plugin" not in l) + "\n"
  assert nccl_log.warnings(nccl_log.parse(no_plugin)) == []
  one_node = "\n".join(l for l in text.splitlines() if "via NET/" not in l) + "\n"  # SHARP cannot help there
  assert nccl_log.warnings(nccl_log.parse(one_node)) == []
  facts = nccl_log.parse(text + COLLNET_UP)  # set up: the plugin is in use
  assert facts["collnet"] and "COLLNET/SHARP/0" in facts["transports"] and nccl_log.warnings(facts) == []


def test_collnet_set_up_but_never_chosen_for_large_all_reduces_is_one_line():
  tuning = ("dgx-a:3310:3310 [0] NCCL INFO AllReduce: 134217728 Bytes -> Algo {} proto SIMPLE"
            " channel{{Lo..Hi}}={{0..7}}\n")
  text = _log("nccl_2.19_hpcx_sharp.log") + COLLNET_UP
  used = nccl_log.parse(text + tuning.format("COLLNET_DIRECT"))
  assert used["choices"][0]["algorithm"] == "collnet_direct" and nccl_log.warnings(used) == []
  nvls, collnet = nccl_log.warnings(nccl_log.parse(text + tuning.format("RING")))  # this node has NVLS too
  assert collnet == "CollNet (SHARP) was set up but NCCL chose ring/Simple for every all-reduce of 128M"
  assert nvls.startswith("NVLS (NVLink SHARP) was available but NCCL chose ring/Simple")
  assert nccl_log.warnings(nccl_log.parse(text + tuning.format("NVLS_TREE"))) == []  # one in-switch reduction


# NCCL's choice beside each measured point.

def _rec(coll, size, n, scope="global"):
  return {"collective": coll, "bytes": size, "group_size": n, "scope": scope, "dtype": "float32", "status": "ok",
          "busbw_gbps": 100.0}


def test_each_point_gets_the_choice_nccl_logged_for_its_collective_and_size():
  new = nccl_log.parse(_log("nccl_2.27_efa.log"))  # 2.24+: all-gather/reduce-scatter count S / n
  assert nccl_log.chosen(_rec("all_reduce", 268435456, 16), new) == "nvls_tree/Simple"
  assert nccl_log.chosen(_rec("all_reduce_max", 8192, 16), new) == "tree/LL"
  assert nccl_log.chosen(_rec("all_gather", 16 * 2097152, 16), new) == "ring/Simple"
  assert nccl_log.chosen(_rec("reduce_scatter", 16 * 2097152, 16), new) == "pat/Simple"
  assert nccl_log.chosen(_rec("all_gather", 2097152, 16), new) == ""  # not the per-rank size taken as S
  assert nccl_log.chosen(_rec("ppermute", 8192, 16), new) == "" and nccl_log.chosen(_rec("all_reduce", 4, 2), new) == ""
  old = nccl_log.parse(_log("nccl_2.23_nvls_ring_forced.log"))  # 2.23: the whole buffer
  assert nccl_log.chosen(_rec("all_gather", 8388608, 8), old) == "ring/Simple"
  assert nccl_log.chosen(_rec("all_gather", 8 * 8388608, 8), old) == ""


def test_the_report_writes_the_points_beside_nccls_choices(tmp_path):
  facts = nccl_log.parse(_log("nccl_2.27_efa.log"))
  records = [_rec("all_reduce", 268435456, 16), _rec("all_gather", 16 * 2097152, 16), _rec("ppermute", 8192, 16),
             {**_rec("all_reduce", 8192, 16), "status": "failed"}]
  sweeps = [types.SimpleNamespace(label="a", records=records, meta={"nccl": facts}),
            types.SimpleNamespace(label="b", records=records, meta={}),  # no --nccl_debug: no section
            types.SimpleNamespace(label="c", records=records, meta={"nccl": nccl_log.parse({})})]  # a CPU run
  written = nccl_log.write_beside(sweeps, str(tmp_path))  # what microbench-report prints and writes
  text = (tmp_path / "nccl.md").read_text()
  assert text == written
  assert "## a" in text and "## b" not in text and "## c" not in text and "NCCL 2.27.7+cuda12.9, network Libfabric" in text
  rows = [l for l in text.splitlines() if l.startswith("| ") and "collective" not in l]
  assert [r.split("|")[-2].strip() for r in rows] == ["nvls_tree/Simple", "ring/Simple", "–"]  # failed: left out
  assert nccl_log.write_beside(sweeps[1:], str(tmp_path / "none")) == ""
  assert not os.path.exists(tmp_path / "none" / "nccl.md")


def test_a_log_without_choices_says_why_beside_the_points():
  rows, note = nccl_log.beside([_rec("all_reduce", 8192, 4)], nccl_log.parse(_log("nccl_2.12_ib_stdout.log")))
  assert rows[0][-1] == "–" and "NCCL logs it from 2.21 on" in note and "2.12.12" in note
  _, note = nccl_log.beside([], nccl_log.parse(_log("nccl_2.21_nvls_ib_coll.log")))
  assert "add COLL to NCCL_DEBUG_SUBSYS" in note
  assert nccl_log.beside([], None)[1].startswith("no NCCL facts in meta.json: run with --nccl_debug")


# The capture during a run.

def test_capture_sets_only_what_the_user_did_not(tmp_path):
  from microbench.cluster import nccl_debug  # pylint: disable=g-import-not-at-top
  env = {"NCCL_DEBUG_SUBSYS": "INIT"}
  assert not nccl_debug.wanted(False, env) and nccl_debug.wanted(True, env)
  folder = nccl_debug.enable(str(tmp_path / "run"), env)
  assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT", "NCCL_DEBUG_FILE": f"{folder}/%h.%p.log"}
  assert os.path.isdir(folder) and nccl_debug.wanted(False, {"NCCL_DEBUG": "WARN"})


def test_a_runs_captured_logs_become_its_nccl_facts_and_warnings(tmp_path):
  """Two processes' logs, on a host whose InfiniBand port is active, that used sockets: meta's `nccl` names
  the network, both files, and the warning is printed; NCCL_IB_DISABLE=1 (the user's choice) silences it."""
  from microbench.bench import run as bench_run  # pylint: disable=g-import-not-at-top
  from microbench.output import run_folder  # pylint: disable=g-import-not-at-top
  text = _log("nccl_2.18_socket.log")
  (tmp_path / "nccl").mkdir()
  (tmp_path / "nccl" / "gpu-3.4101.log").write_text(text)
  (tmp_path / "nccl" / "gpu-4.5202.log").write_text(text.replace("gpu-3:4101", "gpu-4:5202"))
  printed = io.StringIO()
  out = run_folder.RunOutputs(str(tmp_path / "out"), stream=printed)
  meta = {"environment": {**IB_PORT, "variables": {"XLA_FLAGS": "x"}}}
  facts = bench_run._nccl_facts(str(tmp_path), meta, out)  # pylint: disable=protected-access
  out.close()
  assert facts["files"] == ["gpu-3.4101.log", "gpu-4.5202.log"] and facts["networks"] == ["Socket"]
  assert facts["processes"] == 2 and len(facts["warnings"]) == 1
  assert "# NCCL: NCCL used sockets (NET/Socket) although the host has active InfiniBand" in printed.getvalue()
  meta["environment"]["variables"]["NCCL_IB_DISABLE"] = "1"
  assert bench_run._nccl_facts(str(tmp_path), meta, run_folder.RunOutputs(  # pylint: disable=protected-access
      str(tmp_path / "out2"), stream=io.StringIO()))["warnings"] == []
