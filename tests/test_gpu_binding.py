"""Which GPUs each process drives (microbench/cluster/binding.py): the decision for every launcher layout, the
wrong mappings it exists to prevent, JAX's side of the contract, the flag's bad values, the record in meta.json,
and SLURM's real variables on the emulated cluster."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from support import ROOT, clean_env
from microbench.cluster import binding, environment

SLURM8 = {"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1"}  # two nodes of 8 tasks, on the second


def _env(**kw: str) -> dict[str, str]:
  return {k: str(v) for k, v in kw.items()}


# (name, --local_device_ids, --distributed, environment, expected ids (None: every GPU seen) or error text, rule)
CASES = [
    ("not distributed: nothing restricted", None, False, _env(SLURM_LOCALID=3, CUDA_VISIBLE_DEVICES="0,1,2,3"),
     None, "single_process"),
    ("not distributed: JAX_LOCAL_DEVICE_IDS is JAX's distributed setting only", None, False,
     _env(JAX_LOCAL_DEVICE_IDS="1"), None, "single_process"),
    ("the flag restricts a single process too", (1,), False, _env(), (1,), "flag"),
    ("distributed without a launcher (microbench-launch, explicit flags)", None, True,
     _env(CUDA_VISIBLE_DEVICES="0,1"), None, "no_launcher"),
    # srun --ntasks-per-node=8 --gpus-per-node=8: every task sees the node's 8 GPUs.
    ("one task per GPU, all GPUs seen", None, True,
     _env(SLURM_LOCALID=3, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7", SLURM_GPUS_ON_NODE=8,
          SLURM_STEP_GPUS="0,1,2,3,4,5,6,7", **SLURM8), (3,), "shared_split"),
    # srun --gpus-per-task=1 (SLURM 22.05 on the emulated cluster: the task's own GPU in every list).
    ("SLURM bound one GPU per task: it is device 0", None, True,
     _env(SLURM_LOCALID=3, CUDA_VISIBLE_DEVICES="3", GPU_DEVICE_ORDINAL="3", SLURM_STEP_GPUS="3",
          SLURMD_TRES_BIND="gpu:per_task:1", SLURM_GPUS_ON_NODE=8, **SLURM8), None, "task_bound"),
    ("a cgroup-constrained task: renumbered from 0", None, True,
     _env(SLURM_LOCALID=5, CUDA_VISIBLE_DEVICES="0", **SLURM8), None, "task_bound"),
    ("--gpus-per-task=2: both of its own", None, True,
     _env(SLURM_LOCALID=1, SLURM_STEP_TASKS_PER_NODE="4", CUDA_VISIBLE_DEVICES="2,3", SLURM_STEP_GPUS="2,3",
          SLURMD_TRES_BIND="gpu:per_task:2", SLURM_GPUS_ON_NODE=8), None, "task_bound"),
    ("a per-task set known only from the node's count", None, True,
     _env(SLURM_LOCALID=1, SLURM_STEP_TASKS_PER_NODE="2", CUDA_VISIBLE_DEVICES="4,5,6,7", SLURM_JOB_GPUS="0-7"),
     None, "task_bound"),
    ("one process per node drives all its GPUs (JAX alone gives it GPU 0)", None, True,
     _env(SLURM_LOCALID=0, SLURM_STEP_TASKS_PER_NODE="1(x4)", SLURM_NODEID=2, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7",
          SLURM_GPUS_ON_NODE=8), None, "one_per_node"),
    ("two tasks per node of 8 GPUs: 4 each", None, True,
     _env(SLURM_LOCALID=1, SLURM_STEP_TASKS_PER_NODE="2", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7",
          SLURM_GPUS_ON_NODE=8), (4, 5, 6, 7), "shared_split"),
    ("a partial node: the 4 GPUs the job got, renumbered", None, True,
     _env(SLURM_LOCALID=2, SLURM_STEP_TASKS_PER_NODE="4", CUDA_VISIBLE_DEVICES="4,5,6,7", SLURM_GPUS_ON_NODE=4,
          SLURM_STEP_GPUS="4,5,6,7"), (2,), "shared_split"),
    ("no CUDA_VISIBLE_DEVICES: GPU_DEVICE_ORDINAL's ids are CUDA's", None, True,
     _env(SLURM_LOCALID=1, SLURM_STEP_TASKS_PER_NODE="2", GPU_DEVICE_ORDINAL="4,5,6,7", SLURM_GPUS_ON_NODE=4),
     (6, 7), "shared_split"),
    ("no CUDA_VISIBLE_DEVICES, a bound ordinal", None, True,
     _env(SLURM_LOCALID=1, SLURM_STEP_TASKS_PER_NODE="4", GPU_DEVICE_ORDINAL="5", SLURMD_TRES_BIND="gpu:single:1"),
     (5,), "task_bound"),
    ("uneven tasks per node: this node's count", None, True,
     _env(SLURM_LOCALID=1, SLURM_STEP_TASKS_PER_NODE="4,2", SLURM_NODEID=1, CUDA_VISIBLE_DEVICES="0,1,2,3"),
     (2, 3), "shared_split"),
    ("no GPU list: JAX's own rule", None, True, _env(SLURM_LOCALID=2, SLURM_STEP_TASKS_PER_NODE="4"),
     (2,), "local_rank"),
    ("Open MPI's local rank beats the SLURM daemon step's", None, True,
     _env(OMPI_COMM_WORLD_LOCAL_RANK=2, OMPI_COMM_WORLD_LOCAL_SIZE=4, SLURM_LOCALID=0,
          SLURM_STEP_TASKS_PER_NODE="1", CUDA_VISIBLE_DEVICES="0,1,2,3"), (2,), "shared_split"),
    ("mpirun_example.sh's one GPU per rank", None, True,
     _env(OMPI_COMM_WORLD_LOCAL_RANK=3, OMPI_COMM_WORLD_LOCAL_SIZE=8, CUDA_VISIBLE_DEVICES="3"), None, "task_bound"),
    ("no GPU visible", None, True, _env(SLURM_LOCALID=1, SLURM_STEP_TASKS_PER_NODE="2", CUDA_VISIBLE_DEVICES=""),
     None, "no_gpus"),
    ("NoDevFiles shows none", None, True, _env(SLURM_LOCALID=0, CUDA_VISIBLE_DEVICES="NoDevFiles"), None, "no_gpus"),
    ("the flag wins", (0, 1), True, _env(SLURM_LOCALID=3, CUDA_VISIBLE_DEVICES="0,1,2,3", **SLURM8), (0, 1), "flag"),
    ("JAX_LOCAL_DEVICE_IDS in a distributed job", None, True, _env(SLURM_LOCALID=3, JAX_LOCAL_DEVICE_IDS="0,2"),
     (0, 2), "jax_env"),
    # Refused, one line each.
    ("ids beyond the GPUs seen", (4,), True, _env(CUDA_VISIBLE_DEVICES="0,1"),
     "--local_device_ids=4 but CUDA_VISIBLE_DEVICES='0,1' shows this process 2 GPU(s)", None),
    ("overlapping per-task sets", None, True,
     _env(SLURM_LOCALID=3, CUDA_VISIBLE_DEVICES="0,1,2,3", SLURMD_TRES_BIND="gpu:closest", SLURM_GPUS_ON_NODE=8,
          **SLURM8), "8 tasks cannot each have 4 GPU(s) of their own", None),
    ("more tasks than GPUs", None, True,
     _env(SLURM_LOCALID=2, SLURM_STEP_TASKS_PER_NODE="3", CUDA_VISIBLE_DEVICES="0,1", SLURM_GPUS_ON_NODE=2),
     "does not split evenly among 3 tasks", None),
    ("GPUs that do not split", None, True,
     _env(SLURM_LOCALID=0, SLURM_STEP_TASKS_PER_NODE="3", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"),
     "does not split evenly among 3 tasks", None),
    ("a garbled local rank", None, True, _env(SLURM_LOCALID="x"), "SLURM_LOCALID='x' is not a non-negative integer",
     None),
    ("a local rank past the task count", None, True, _env(SLURM_LOCALID=4, SLURM_STEP_TASKS_PER_NODE="4"),
     "the local rank must be below the task count", None),
    ("a garbled JAX_LOCAL_DEVICE_IDS", None, True, _env(SLURM_LOCALID=0, JAX_LOCAL_DEVICE_IDS="0;1"),
     "JAX_LOCAL_DEVICE_IDS='0;1'", None),
]


def _outcome(decide, flag, distributed, env):
  try:
    b = decide(flag, distributed, env)
  except binding.BindingError as e:
    return str(e)
  return b.local_device_ids, b.rule


def _wrong(decide) -> list[str]:
  """The cases `decide` gets wrong."""
  bad = []
  for name, flag, distributed, env, want, rule in CASES:
    got = _outcome(decide, flag, distributed, env)
    ok = want in got if isinstance(want, str) else (isinstance(got, tuple) and got == (want, rule))
    if not ok:
      bad.append(f"{name}: {got}")
  return bad


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_launcher_layout_gets_its_gpus(case):
  name, flag, distributed, env, want, rule = case
  got = _outcome(binding.decide, flag, distributed, env)
  if isinstance(want, str):
    assert isinstance(got, str) and want in got and "\n" not in got, (name, got)
  else:
    assert got == (want, rule), name
    assert rule in binding.RULES


def _jax_rule(flag, distributed, env):
  """JAX alone: the local rank's GPU wherever a launcher is found."""
  local = env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("SLURM_LOCALID"))
  if not distributed or local is None:
    return binding.Binding(None, "single_process" if not distributed else "no_launcher", "")
  if not local.isdigit():
    raise binding.BindingError(f"bad local rank {local!r}")
  return binding.Binding((int(local),), "local_rank", "")


def _blind_to_slurm_binding(flag, distributed, env):
  """A decision that never reads SLURM's binding variables."""
  return binding.decide(flag, distributed, {k: v for k, v in env.items()
                                            if k not in ("SLURMD_TRES_BIND", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS")})


def _one_gpu_each(flag, distributed, env):
  """Shared GPUs always split one per task (the block size lost)."""
  b = binding.decide(flag, distributed, env)
  if b.rule == "shared_split":
    return binding.Binding(b.local_device_ids[:1], b.rule, b.reason)
  return b


def _ids_of_the_node(flag, distributed, env):
  """GPU_DEVICE_ORDINAL's ids taken as indices from 0 (CUDA's renumbering assumed where nothing renumbers)."""
  b = binding.decide(flag, distributed, env)
  if "CUDA_VISIBLE_DEVICES" not in env and "GPU_DEVICE_ORDINAL" in env and b.local_device_ids:
    return binding.Binding(tuple(range(len(b.local_device_ids))), b.rule, b.reason)
  return b


@pytest.mark.parametrize("wrong", [_jax_rule, _blind_to_slurm_binding, _one_gpu_each, _ids_of_the_node],
                         ids=lambda f: f.__name__)
def test_wrong_mappings_are_caught(wrong):
  """The case table is proven by the bugs it catches: each of these mappings gets at least one case wrong,
  and the real decision none."""
  assert _wrong(binding.decide) == []
  assert _wrong(wrong), f"{wrong.__name__} passes every case: the table cannot tell it from the real rules"


def test_jax_keeps_our_choice_and_would_otherwise_apply_its_own(monkeypatch):
  """Why the decision is always passed: given None, JAX under SLURM fills in [SLURM_LOCALID] (the rule that
  breaks bound tasks); given [] (every GPU seen) or ids, it keeps them."""
  from jax._src import clusters  # pylint: disable=g-import-not-at-top
  for k, v in {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "16", "SLURM_PROCID": "11",
               "SLURM_LOCALID": "3"}.items():
    monkeypatch.setenv(k, v)

  def detect(ids):
    return clusters.ClusterEnv.auto_detect_unset_distributed_params("n1:1234", 16, 11, ids, None, 10)[3]
  assert detect(None) == [3]
  assert detect(binding.Binding(None, "task_bound", "").jax_argument()) == []
  assert detect(binding.Binding((0, 1), "flag", "").jax_argument()) == [0, 1]


@pytest.mark.parametrize("text,ok", [("0,1,2,3", (0, 1, 2, 3)), (" 3 ", (3,)), ("a", None), ("0,0", None),
                                     ("-1", None), ("", None), ("0,", None)])
def test_flag_values(text, ok):
  if ok:
    assert binding.parse_ids(text) == ok
  else:
    with pytest.raises(binding.BindingError, match="--local_device_ids"):
      binding.parse_ids(text)


def test_slurm_lists_and_task_counts():
  assert binding.gpu_list("0-3,6") == ["0", "1", "2", "3", "6"]
  assert binding.tasks_on_node("8(x2)", 1) == 8 and binding.tasks_on_node("4,2(x2)", 2) == 2
  assert binding.tasks_on_node("4,2", None) is None and binding.tasks_on_node("junk", 0) is None
  assert [binding.visible_count(v) for v in ("0,1", "GPU-a,MIG-b", "", "-1", "0,x,2")] == [2, 2, 0, 0, 1]


def test_the_binding_is_in_the_environment_record_and_header():
  b = binding.decide(None, True, _env(SLURM_LOCALID=1, SLURM_STEP_TASKS_PER_NODE="2",
                                      CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"))
  binding.remember(b)
  try:
    rec = environment.gpu_binding()
    assert rec["local_device_ids"] == [4, 5, 6, 7] and rec["rule"] == "shared_split"
    assert rec["inputs"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_LOCALID": "1",
                             "SLURM_STEP_TASKS_PER_NODE": "2"}
    line = [x for x in environment.header({"gpu_binding": rec}) if "GPU binding" in x]
    assert line == ["# GPU binding (process 0): 4,5,6,7 by rule shared_split: " + rec["reason"]]
  finally:
    binding.remember(None)


def test_the_environment_record_survives_a_failing_binding_fact(monkeypatch):
  def broken():
    raise OSError("no such thing")
  monkeypatch.setattr(binding, "current", broken)
  env = environment.capture(gpu=False)
  assert env["gpu_binding"] is None and env["python"]
  assert not [x for x in environment.header(env) if "GPU binding" in x]


@pytest.mark.parametrize("args,env,says", [
    (["--local_device_ids=a"], {}, "--local_device_ids='a'"),
    (["--distributed", "--local_device_ids=2"], {"CUDA_VISIBLE_DEVICES": "0"}, "shows this process 1 GPU(s)"),
    (["--distributed"], {"SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "3", "CUDA_VISIBLE_DEVICES": "0,1",
                          "SLURM_GPUS_ON_NODE": "2"},
     "does not split evenly among 3 tasks"),
])
def test_bad_bindings_are_one_line(args, env, says, tmp_path):
  r = subprocess.run([sys.executable, "-m", "microbench", *args, f"--outdir={tmp_path / 'run'}"],
                     capture_output=True, text=True, timeout=120, env=clean_env(**env), cwd=ROOT, check=False)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
  assert len(lines) == 1 and says in lines[0], r.stderr
  assert not (tmp_path / "run").exists()


def test_a_run_records_its_binding(tmp_path):
  """A one-process job that SLURM's variables place as local rank 1 of 2 tasks sharing 8 GPUs: the binding is
  decided, handed to jax.distributed (CPU devices ignore it) and recorded in meta.json and the header."""
  from microbench.cluster.launch import free_port  # pylint: disable=g-import-not-at-top
  out = tmp_path / "run"
  env = clean_env(JAX_NUM_CPU_DEVICES="2", SLURM_LOCALID="1", SLURM_STEP_TASKS_PER_NODE="2",
                  CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
  r = subprocess.run([sys.executable, "-m", "microbench", "--distributed",
                      f"--coordinator_address=127.0.0.1:{free_port()}",
                      "--num_processes=1", "--process_id=0", "--collectives=all_reduce", "--scopes=global",
                      "--min_bytes=1K", "--max_bytes=1K", "--iters=6", "--samples=2", f"--outdir={out}"],
                     capture_output=True, text=True, timeout=240, env=env, cwd=ROOT, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  meta = json.loads((out / "meta.json").read_text())
  bound = meta["environment"]["gpu_binding"]
  assert bound["local_device_ids"] == [4, 5, 6, 7] and bound["rule"] == "shared_split"
  assert "# GPU binding (process 0): 4,5,6,7 by rule shared_split" in r.stdout


# SLURM's own variables: a real SLURM (22.05 in CI) on the emulated cluster, its GPUs character devices so that
# slurmd accepts them and sets CUDA_VISIBLE_DEVICES and the rest as it does on a GPU node.
@pytest.mark.cluster
@pytest.mark.usefixtures("needs_slurm")
def test_slurm_binding_options_map_each_task_to_its_own_gpus():
  from microbench.cluster import slurm_testbed as stb  # pylint: disable=g-import-not-at-top
  from microbench.cluster import testbed as tbm  # pylint: disable=g-import-not-at-top
  bed = tbm.Testbed.new(hosts=2, racks=1, host_rate=400_000_000, uplink_rate=100_000_000)
  work = tempfile.mkdtemp(prefix="binding")
  os.makedirs(os.path.join(work, "dev"))
  for g in range(8):  # like /dev/nvidiaN: slurmd refuses GPU files that are not devices
    os.mknod(os.path.join(work, "dev", f"gpu{g}"), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
  probe = ("import json, os; from microbench.cluster import binding\n"
           "try:\n  b = binding.decide(None, True, os.environ); out = [b.rule, b.jax_argument()]\n"
           "except binding.BindingError as e:\n  out = ['error', str(e)]\n"
           "print(json.dumps([int(os.environ['SLURM_PROCID']), os.environ.get('CUDA_VISIBLE_DEVICES'), *out]))")
  bed.up()
  cluster = stb.SlurmTestbed(bed, work, gpus=8, slurmd_timeout=10)
  try:
    cluster.up()

    def run(*opts):
      r = cluster.run(["srun", *opts, sys.executable, "-c", probe], env=cluster.env(clean_env()), cwd=ROOT,
                      timeout=120)
      assert r.returncode == 0, r.stderr[-2000:]
      return sorted(json.loads(line) for line in r.stdout.splitlines() if line.startswith("["))
    # One task per GPU, every task seeing the node's 4: GPU L.
    assert run("-N2", "--ntasks-per-node=4", "--gpus-per-node=4") == [
        [p, "0,1,2,3", "shared_split", [p % 4]] for p in range(8)]
    # Bound per task: each sees its own GPU(s) only, and drives all it sees (JAX's rule would ask for GPU L).
    assert run("-N1", "--ntasks-per-node=4", "--gpus-per-task=1") == [
        [p, str(p), "task_bound", []] for p in range(4)]
    assert run("-N1", "--ntasks-per-node=2", "--gpus-per-task=2") == [
        [0, "0,1", "task_bound", []], [1, "2,3", "task_bound", []]]
    assert run("-N1", "--ntasks-per-node=4", "--gpus-per-node=8", "--gpu-bind=map_gpu:4,5,6,7") == [
        [p, str(4 + p), "task_bound", []] for p in range(4)]
    # One process per node: all 8 (JAX's rule would give it GPU 0 only).
    assert run("-N2", "--ntasks-per-node=1", "--gpus-per-node=8") == [
        [p, "0,1,2,3,4,5,6,7", "one_per_node", []] for p in range(2)]
    # Two processes per node share 8: 4 each.
    assert run("-N1", "--ntasks-per-node=2", "--gpus-per-node=8") == [
        [0, "0,1,2,3,4,5,6,7", "shared_split", [0, 1, 2, 3]], [1, "0,1,2,3,4,5,6,7", "shared_split", [4, 5, 6, 7]]]
    # Three tasks on two GPUs: refused.
    assert {tuple(x[2:3]) for x in run("-N1", "-n3", "--gres=gpu:2")} == {("error",)}
    # The one-process-per-node template as written (2 CPU devices stand in for each node's GPUs).
    out = os.path.join(work, "per-node")
    job = cluster.submit(["--nodes=2", "--cpus-per-task=1", f"--output={work}/per-node.out",
                          "scripts/slurm_per_node.sbatch", "--collectives=all_reduce", "--min_bytes=64K",
                          "--max_bytes=64K", "--iters=6", "--samples=2", f"--outdir={out}"],
                         cwd=ROOT, env=clean_env(JAX_NUM_CPU_DEVICES="2"))
    state = cluster.wait(job, timeout=240)
    assert state == ("COMPLETED", "0:0"), open(f"{work}/per-node.out", encoding="utf-8").read()[-3000:]
    meta = json.load(open(os.path.join(out, "meta.json"), encoding="utf-8"))
    assert meta["process_count"] == 2 and meta["topology"] == {"racks": 1, "nodes": 2, "gpus": 2}
    assert meta["environment"]["gpu_binding"]["rule"] == "one_per_node"
  finally:
    cluster.down()
    bed.down()
    shutil.rmtree(work, ignore_errors=True)
