"""NCCL INFO logs read into facts (report/nccl_log.py). Fixtures follow the line formats public NCCL 2.x logs
show; the facts are NCCL's, the wording of each line is the version's."""

from __future__ import annotations

import io
import os

from microbench.report import nccl_log

IB_2_21 = """\
node01:6899:6899 [0] NCCL INFO Bootstrap : Using ib0:10.0.0.1<0>
node01:6899:6899 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
node01:6899:6930 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.1<0>
node01:6899:6930 [0] NCCL INFO Using network IB
node01:6899:6930 [0] NCCL INFO Channel 00/24 :    0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15
node01:6899:6930 [0] NCCL INFO Trees [0] 1/8/-1->0->-1 [1] 1/-1/-1->0->8
node01:6899:6930 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
node01:6899:6930 [0] NCCL INFO Channel 00/0 : 15[7] -> 0[0] [receive] via NET/IB/0/GDRDMA
node01:6899:6930 [0] NCCL INFO NVLS multicast support is available on dev 0
node01:6899:6899 [0] NCCL INFO AllReduce: 1048576 Bytes -> Algo 1 proto 2 time 23.400000
node01:6899:6899 [0] NCCL INFO AllGather: 8192 Bytes -> Algo 1 proto 0 time 11.2
"""

SOCKETS_2_18 = """\
gpu-3:4101:4101 [0] NCCL INFO NCCL version 2.18.3+cuda12.2
gpu-3:4101:4101 [0] NCCL INFO NET/Socket : Using [0]eth0:192.168.1.3<0>
gpu-3:4101:4101 [0] NCCL INFO Using network Socket
gpu-3:4101:4120 [0] NCCL INFO Channel 00/02 :    0   1
gpu-3:4101:4120 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
gpu-3:4101:4101 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo
"""

OFI = """\
ip-10-1-2-3:88:88 [0] NCCL INFO NCCL version 2.20.3+cuda12.3
ip-10-1-2-3:88:88 [0] NCCL INFO NET/OFI Using aws-ofi-nccl 1.7.4-aws
ip-10-1-2-3:88:88 [0] NCCL INFO Using network AWS Libfabric
ip-10-1-2-3:88:95 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/AWS Libfabric/0/GDRDMA
ip-10-1-2-3:88:95 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/IPC
"""


def test_an_infiniband_run_says_network_devices_channels_transports_and_choices():
  f = nccl_log.parse(IB_2_21)
  assert f["versions"] == ["2.21.5+cuda12.4"] and f["networks"] == ["IB"]
  assert f["net_devices"] == ["mlx5_0:1/IB", "mlx5_1:1/IB"] and f["channels"] == 24
  assert f["transports"] == ["NET/IB/0/GDRDMA", "P2P/CUMEM/read"] and f["trees"] and f["nvls"]
  assert f["choices"] == [{"collective": "AllReduce", "bytes": 1048576, "algorithm": "ring", "protocol": "Simple"},
                          {"collective": "AllGather", "bytes": 8192, "algorithm": "ring", "protocol": "LL"}]
  assert nccl_log.warnings(f, expect_ib=True) == []


def test_sockets_where_infiniband_was_expected_is_said_and_a_cut_line_is_counted_not_guessed():
  f = nccl_log.parse(SOCKETS_2_18)
  assert f["networks"] == ["Socket"] and f["channels"] == 2 and f["transports"] == ["NET/Socket/0"]
  assert f["choices"] == [] and f["unread"] == 1
  (line,) = nccl_log.warnings(f, expect_ib=True)
  assert line.startswith("NCCL used sockets") and "NCCL_IB_HCA" in line
  assert nccl_log.warnings(f, expect_ib=False) == []  # sockets are all an Ethernet cluster has


def test_a_network_plugin_is_named():
  f = nccl_log.parse(OFI)
  assert f["networks"] == ["AWS Libfabric"] and f["plugin"] == ["Using aws-ofi-nccl 1.7.4-aws"]
  assert f["transports"] == ["NET/AWS Libfabric/0/GDRDMA", "P2P/IPC"]
  assert nccl_log.warnings(f, expect_ib=True) == []


def test_a_log_without_nccl_lines_gives_empty_facts_and_says_how_to_get_them():
  f = nccl_log.parse("srun: error: node01: task 0: Exited with exit code 1\nrandom text\n")
  assert f["info_lines"] == 0 and f["networks"] == [] and f["choices"] == []
  assert nccl_log.warnings(f, expect_ib=True) == ["no NCCL INFO lines: set NCCL_DEBUG=INFO to record what NCCL did"]


def test_capture_sets_only_what_the_user_did_not(tmp_path):
  from microbench.cluster import nccl_debug  # pylint: disable=g-import-not-at-top
  env = {"NCCL_DEBUG_SUBSYS": "INIT"}
  assert not nccl_debug.wanted(False, env) and nccl_debug.wanted(True, env)
  folder = nccl_debug.enable(str(tmp_path / "run"), env)
  assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT", "NCCL_DEBUG_FILE": f"{folder}/%h.%p.log"}
  assert os.path.isdir(folder) and nccl_debug.wanted(False, {"NCCL_DEBUG": "WARN"})


def test_a_runs_captured_logs_become_its_nccl_facts_and_warnings(tmp_path):
  """Two processes' logs, on a host whose InfiniBand port is active, that used sockets: meta's `nccl` names
  the network, both files, and the warning is printed."""
  from microbench.bench import run as bench_run  # pylint: disable=g-import-not-at-top
  from microbench.output import run_folder  # pylint: disable=g-import-not-at-top
  (tmp_path / "nccl").mkdir()
  (tmp_path / "nccl" / "gpu-3.4101.log").write_text(SOCKETS_2_18)
  (tmp_path / "nccl" / "gpu-3.4102.log").write_text(SOCKETS_2_18.replace("4101", "4102"))
  printed = io.StringIO()
  out = run_folder.RunOutputs(str(tmp_path / "out"), stream=printed)
  meta = {"environment": {"nics": [{"device": "mlx5_0", "port": "1", "link_layer": "InfiniBand",
                                    "state": "4: ACTIVE", "rate": "400 Gb/sec (4X NDR)"}]}}
  facts = bench_run._nccl_facts(str(tmp_path), meta, out)  # pylint: disable=protected-access
  out.close()
  assert facts["files"] == ["gpu-3.4101.log", "gpu-3.4102.log"] and facts["networks"] == ["Socket"]
  assert facts["warnings"] and "# NCCL: NCCL used sockets" in printed.getvalue()
  meta["environment"]["nics"][0]["state"] = "1: DOWN"  # a port that is down is not an expectation
  assert bench_run._nccl_facts(str(tmp_path), meta, run_folder.RunOutputs(  # pylint: disable=protected-access
      str(tmp_path / "out2"), stream=io.StringIO()))["warnings"] == []
