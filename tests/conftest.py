"""Shared test set-up: 8 virtual CPU devices for in-process tests, and helpers to run the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

# Must happen before JAX's backend starts: every in-process test sees 8 CPU devices.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

# The CLI's --compilation_cache=auto is off in the suite: every test's sweep compiles what it checks, nothing lands
# in ~/.cache, and no test depends on another's entries. The cache's own test names a folder.
os.environ.setdefault("MICROBENCH_COMPILATION_CACHE", "none")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env(**extra: str) -> dict[str, str]:
  """The environment for a child process: no inherited device-count choices unless given."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.update(extra)
  return env


def doubling(args: list[str]) -> list[str]:
  """The tests' size ranges were chosen for nccl-tests' doubling (`-f 2`); the sweep's default factor (4) is
  the newcomer's quick run. Added unless a test sets the factor itself."""
  return args if any(a.startswith("--step_factor") for a in args) else [*args, "--step_factor=2"]


def run_cli(args: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
  """Runs `python -m microbench ARGS` and returns the finished process (text output)."""
  return subprocess.run([sys.executable, "-m", "microbench", *doubling(args)], capture_output=True, text=True,
                        timeout=timeout, env=clean_env(**env), cwd=ROOT)


def start_job(args: list[str], num_processes: int, devices_per_process: int = 1,
              hosts: list[str] | None = None, module: str = "microbench") -> list[subprocess.Popen]:
  """Starts a job of several local processes (gloo) of `python -m MODULE`, without any launcher script."""
  from microbench.cluster.launch import free_port  # pylint: disable=g-import-not-at-top
  port = free_port()
  procs = []
  for i in range(num_processes):
    env = clean_env(JAX_NUM_CPU_DEVICES=str(devices_per_process))
    if hosts:
      env["MICROBENCH_HOSTNAME"] = hosts[i]
    cmd = [sys.executable, "-m", module, *(doubling(args) if module == "microbench" else args), "--distributed",
           f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}", f"--process_id={i}"]
    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                  cwd=ROOT))
  return procs


def finish_job(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str, str]]:
  results = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    results.append((p.returncode, out, err))
  return results


def interrupt_when_ready(proc: subprocess.Popen, ready, timeout: float = 60) -> str:
  """Waits until `ready()` holds while `proc` runs, sends SIGINT, and returns its stderr."""
  import signal
  import time
  try:
    deadline = time.monotonic() + timeout
    while not ready():
      assert time.monotonic() < deadline and proc.poll() is None, "job did not start"
      time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  return err


def netns_problem() -> str | None:
  """Why the emulated cluster (network namespaces) cannot run here, or None."""
  from microbench.cluster import testbed as tbm  # pylint: disable=g-import-not-at-top
  if not sys.platform.startswith("linux"):
    return "network namespaces need Linux"
  return tbm.permission_problem() or (None if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode
                                      == 0 else "`ip netns` does not work here")


# ------------------------------------------------------------------------------------------- test groups
# README's `python -m pytest -q tests` runs the fast suite: every layer, in minutes on two cores. The rest is
# behind markers (pyproject.toml deselects them by default; `.ci/run` runs them all):
#   cluster      needs root and Debian's slurm-wlm / munge / Open MPI: the emulated cluster, SLURM, mpirun.
#                Derived from the test's own skip condition, so a new test of that kind is marked by itself.
#   gpu_compile  needs the gpu-compile extra (XLA:GPU through JAX's CUDA plugin); always slow too.
#   tpu_compile  needs the tpu-compile extra (XLA:TPU through libtpu); always slow too.
#   slow         end-to-end runs, multi-process launches, exhaustive property tests, GPU-target compiles:
#                the tests below: every test function that took 4 s or more (all its parameters together) in
#                a --durations run of the whole suite on the 2-core VM, but for one end-to-end test per command
#                (sweep, training, launcher) and the bad-input lines, which stay in the fast suite.
SLOW = (
    "tests/test_ragged.py::test_the_sweep_records_every_distribution_ok_and_checked",
    "tests/test_ragged.py::test_an_expert_parallel_run_reports_its_dispatch",
    "tests/test_overlap.py::test_overlap_mode_end_to_end_on_8_cpu_devices",
    "tests/test_overlap.py::test_on_gpus_the_matmul_runs_between_the_collectives_start_and_done",
    "tests/test_overlap.py::test_target_sweep_records_the_schedule_read_from_xlas_own_dump",
    "tests/test_command_buffer.py::test_a_target_sweep_with_both_compiles_and_checks_both_arms",
    "tests/test_inplace.py::test_cli_refuses_what_has_no_meaning_in_one_line_and_skips_small_groups",
    "tests/test_cli.py::test_a_flag_absl_rejects_is_one_clear_line",
    "tests/test_cli.py::test_a_hang_in_a_single_process_is_recorded_and_ends_the_run",
    "tests/test_cli.py::test_crash_keeps_finished_points_and_resume_completes_the_sweep",
    "tests/test_cli.py::test_explicit_topology_two_dtypes_and_flagfile",
    "tests/test_cli.py::test_max_bytes_auto_is_4m_on_cpu_and_never_below_min_bytes",
    "tests/test_cli.py::test_reduction_operators_and_fp8_in_one_sweep",
    "tests/test_cli.py::test_sizes_rounding_to_one_count_make_one_point",
    "tests/test_context.py::test_context_parallel_attention_matches_one_device",
    "tests/test_distributed.py::test_a_hung_rank_ends_the_job_and_the_point_is_recorded",
    "tests/test_distributed.py::test_a_slow_rank_is_flagged_as_straggler",
    "tests/test_distributed.py::test_a_study_preset_runs_across_processes_with_the_launcher",
    "tests/test_distributed.py::test_dead_rank_ends_the_job_and_resume_finishes_it",
    "tests/test_distributed.py::test_four_processes_on_two_interleaved_hosts",
    "tests/test_distributed.py::test_training_runs_as_a_distributed_job",
    "tests/test_distributed.py::test_two_hosts_two_devices_each",
    "tests/test_equivalence.py::test_grad_accumulation_equals_the_big_batch",
    "tests/test_equivalence.py::test_gradients_and_sgd_losses_match_single_device",
    "tests/test_equivalence.py::test_layout_and_remat_choices_leave_gradients_unchanged",
    "tests/test_equivalence.py::test_pipeline_expert_and_context_parallel_gradients_match_single_device",
    "tests/test_equivalence.py::test_planted_pipeline_context_and_expert_bugs_fail_the_gradient_check",
    "tests/test_fabric.py::test_report_fabric_bad_input_is_one_line",
    "tests/test_fabric.py::test_report_fits_the_fabric_from_a_run_folder",
    "tests/test_golden_comm.py::test_comm_fingerprint_matches_golden",
    "tests/test_golden_comm.py::test_preset_comm_fingerprint_matches_golden",
    "tests/test_gpcnet.py::test_an_alltoall_across_the_canary_uplink_raises_its_impact_factor_on_the_testbed",
    "tests/test_gpcnet.py::test_bad_gpcnet_input_is_one_line",
    "tests/test_gpcnet.py::test_the_proxy_runs_a_congestor_program",
    "tests/test_gpu_check.py::test_gpu_check_smoke_on_cpu",
    "tests/test_gpu_compile.py::test_gpu_preset_fingerprint_matches_golden",
    "tests/test_gpu_compile.py::test_study_schedule_derived_from_gpu_hlo",
    "tests/test_gpu_compile.py::test_sweep_compiles_every_collective_and_scope_for_h100_with_every_check_passing",
    "tests/test_gpu_compile.py::test_train_target_reports_gpu_memory_fit_and_fsdp_reduce_scatter",
    "tests/test_known_inputs.py::test_every_operator_catches_every_broken_reduction_at_every_group_size",
    "tests/test_known_inputs.py::test_sum_inputs_catch_every_broken_reduction_at_every_group_size",
    "tests/test_launch_local.py::test_failed_rank_is_named_and_others_stopped",
    "tests/test_launch_local.py::test_four_processes_as_two_fake_hosts",
    "tests/test_launch_local.py::test_mpirun_example_on_localhost",
    "tests/test_launch_local.py::test_sigint_stops_all_children",
    "tests/test_launch_local.py::test_timeout_stops_everything",
    "tests/test_launch_local.py::test_usage_errors_are_one_line",
    "tests/test_layout.py::test_console_scripts_start_from_the_install",
    "tests/test_moe.py::test_expert_parallel_gradients_match_one_device",
    "tests/test_moe.py::test_overflowing_tokens_are_dropped_and_counted",
    "tests/test_moe.py::test_planted_ragged_offset_bug_fails_the_check",
    "tests/test_moe.py::test_ragged_dispatch_matches_one_device",
    "tests/test_moe.py::test_trainer_runs_expert_parallel_like_one_device",
    "tests/test_moe_reference.py::test_layer_drops_the_assignments_the_reference_drops",
    "tests/test_moe_reference.py::test_layer_gradients_match_the_reference",
    "tests/test_moe_reference.py::test_planted_bugs_fail_the_reference",
    "tests/test_mutations.py::test_every_wrong_collective_is_caught_and_every_real_one_passes",
    "tests/test_overheads.py::test_pipelined_run_reports_the_bubble_with_its_interval",
    "tests/test_pipeline.py::test_pipelined_gradients_match_one_device",
    "tests/test_pipeline.py::test_planted_schedule_bugs_fail_the_check",
    "tests/test_pipeline.py::test_planted_transfer_off_by_one_fails_the_check",
    "tests/test_pipeline.py::test_schedule_and_mesh_must_agree",
    "tests/test_pipeline.py::test_stage_transfers_in_the_compiled_program",
    "tests/test_pipeline.py::test_summary_counts_loops_nested_in_the_tick_loop_per_step",
    "tests/test_presets.py::test_every_preset_trains_on_8_cpu_devices",
    "tests/test_report.py::test_report_bad_run_folder_or_out_is_one_line",
    "tests/test_report.py::test_report_command_line",
    "tests/test_report.py::test_report_sets_a_run_beside_nccl_tests",
    "tests/test_nccl_tests_logs.py::test_report_draws_json_output_beside_a_sweep_in_a_figure_and_tensorboard",
    "tests/test_expected.py::test_fabric_none_and_a_bad_fabric",
    "tests/test_tensorboard_views.py::test_sweep_views_as_opened_in_a_browser",
    "tests/test_ranks.py::test_the_delayed_process_is_named_in_a_real_run_and_none_without_delay",
    "tests/test_doctor.py::test_doctor_names_the_planted_part_on_the_testbed",
    "tests/test_doctor.py::test_doctor_names_nothing_on_a_healthy_testbed_under_load",
    "tests/test_doctor.py::test_doctor_through_slurm_names_the_planted_part",
    "tests/test_doctor.py::test_doctor_job_runs_every_rail_and_the_scale_up_with_correct_results",
    "tests/test_testbed_faults.py::test_planted_faults_on_a_real_testbed",
    "tests/test_cli.py::test_nccl_debug_captures_into_the_run_folder_and_says_when_there_is_nothing",
    "tests/test_report.py::test_runs_from_one_distribution_mark_no_point_changed",
    "tests/test_report.py::test_the_interval_covers_the_true_ratio_in_most_seeds",
    "tests/test_slurm.py::test_distributed_detects_slurm_under_srun",
    "tests/test_slurm.py::test_failed_node_requeues_the_study_and_it_resumes",
    "tests/test_slurm.py::test_sbatch_study",
    "tests/test_slurm.py::test_sbatch_templates",
    "tests/test_study_artifact.py::test_readme_plans_are_the_artifacts_experiments",
    "tests/test_study_hlo.py::test_derived_bytes_equal_the_training_steps_fingerprint",
    "tests/test_study_predict.py::test_jobs_whose_proxies_come_from_hlo_are_derived_and_predicted",
    "tests/test_study_proxy.py::test_bad_input_is_one_line",
    "tests/test_study_proxy.py::test_derived_proxy_runs_the_training_steps_collectives",
    "tests/test_study_proxy.py::test_local_study_end_to_end",
    "tests/test_study_proxy.py::test_proxy_records_every_rank_and_the_slowest",
    "tests/test_study_proxy.py::test_shared_uplink_slows_jobs_down_on_the_testbed",
    "tests/test_study_proxy.py::test_slurm_backend_runs_steps_in_one_allocation",
    "tests/test_study_slurm_plan.py::test_sbatch_plans_inside_the_allocation",
    "tests/test_tensorboard_views.py::test_hparams_parallel_coordinates_draw_every_run_in_a_browser",
    "tests/test_testbed.py::test_oneshot_shaped_rate_and_cleanup",
    "tests/test_testbed.py::test_sigint_removes_everything",
    "tests/test_testbed.py::test_up_run_concurrent_jobs_racks_and_down",
    "tests/test_testbed.py::test_usage_errors_are_one_line",
    "tests/test_tied_embedding.py::test_planted_dropped_head_gradient_fails_the_reference",
    "tests/test_tied_embedding.py::test_table_gradient_is_lookup_plus_head",
    "tests/test_train.py::test_bad_input_one_clear_line",
    "tests/test_train.py::test_bfloat16_compute_matches_within_bf16_tolerance",
    "tests/test_train.py::test_summary_figures_are_consistent",
    "tests/test_train_scale.py::test_clipping_scales_the_update_to_the_clip_norm",
    "tests/test_train_scale.py::test_comm_fingerprint_counts_loop_iterations",
    "tests/test_train_scale.py::test_fsdp_gathers_each_layer_in_bfloat16_in_forward_and_backward",
    "tests/test_collectives.py::test_the_timed_check_compares_what_was_timed_and_says_so",
    "tests/test_train_scale.py::test_fsdp_shards_the_working_memory",
    "tests/test_train_scale.py::test_program_size_is_flat_in_depth",
    "tests/test_train_scale.py::test_remat_policies_trade_memory_in_order",
)
_CLUSTER_REASONS = ("emulated cluster", "testbed cannot run", "SLURM", "mpirun", "needs root")
_PLUGIN_REASONS = ("CUDA PJRT plugin",)
_LIBTPU_REASONS = ("libtpu is not installed",)


def _skip_reasons(item) -> str:
  return " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    reasons = _skip_reasons(item)
    if any(r in reasons for r in _CLUSTER_REASONS):
      item.add_marker(pytest.mark.cluster)
    if any(r in reasons for r in _PLUGIN_REASONS) or "gpu_mesh" in getattr(item, "fixturenames", ()):
      item.add_marker(pytest.mark.gpu_compile)
      item.add_marker(pytest.mark.slow)
    if any(r in reasons for r in _LIBTPU_REASONS):
      item.add_marker(pytest.mark.tpu_compile)
      item.add_marker(pytest.mark.slow)
    if item.nodeid.split("[")[0] in SLOW:  # the test function, whatever its parameters
      item.add_marker(pytest.mark.slow)


def pytest_report_header(config):
  expr = config.getoption("markexpr")
  if expr == "not slow and not cluster":
    return ("fast suite: tests marked slow or cluster are deselected; -m 'slow or cluster' runs them,"
            " -m '' runs everything")
  return None


def pytest_addoption(parser):
  parser.addoption("--update-golden", action="store_true", default=False,
                   help="rewrite tests/golden/*.json from this run instead of comparing with them")


@pytest.fixture(scope="session")
def update_golden(request) -> bool:
  """True when the golden files should be regenerated (`--update-golden` or MICROBENCH_UPDATE_GOLDEN=1)."""
  return bool(request.config.getoption("--update-golden") or os.environ.get("MICROBENCH_UPDATE_GOLDEN"))


@pytest.fixture(scope="session")
def parsed_flags():
  """absl flags parsed with defaults, for in-process calls into code that reads FLAGS."""
  from absl import flags
  import microbench.cli.bench  # noqa: F401  (defines the flags)
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["pytest"])
  return flags.FLAGS
