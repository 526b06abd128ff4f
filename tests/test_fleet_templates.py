"""The fleet templates (scripts/fleet/): the nightly job run outside SLURM (the doctor's simulated fleet and an
8-device sweep standing in for srun's), the health check on its store, the scontrol drain line printed and run
only when asked; the scrontab line and systemd units well-formed."""

from __future__ import annotations

import os
import subprocess

import pytest

from support import ROOT, clean_env

pytest.importorskip("sqlalchemy")
FLEET = os.path.join(ROOT, "scripts", "fleet")


def _fake_scontrol(tmp_path) -> dict[str, str]:
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'drained'}\n")
  (bin_dir / "scontrol").chmod(0o755)
  return {"PATH": f"{bin_dir}:{os.path.dirname(os.sys.executable)}:{os.environ['PATH']}"}


def _bash(script: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", os.path.join(FLEET, script)], capture_output=True, text=True, cwd=tmp_path,
                        timeout=600, check=False, env=clean_env(**_fake_scontrol(tmp_path), **env))


@pytest.mark.slow
def test_the_nightly_job_judges_records_and_prints_the_drain_line(tmp_path):
  rules = tmp_path / "rules.toml"
  rules.write_text("[[rule]]\nname = \"doctor healthy\"\nmetric = \"doctor\"\n")
  env = dict(MICROBENCH_LAUNCH="", MICROBENCH_DISTRIBUTED="", MICROBENCH_STORE=str(tmp_path / "s.db"),
             MICROBENCH_RULES=str(rules), MICROBENCH_TEXTFILE=str(tmp_path / "textfile"),
             MICROBENCH_DOCTOR_FLAGS="--simulate=6 --fault=h2:rate=0.25",
             MICROBENCH_SWEEP_FLAGS="--scopes=scale_up --collectives=all_reduce --min_bytes=16K --max_bytes=64K"
                                    " --samples=4 --iters=6")
  first = _bash("nightly.sbatch", tmp_path, **env)
  out = first.stdout
  assert first.returncode == 1, out + first.stderr[-3000:]
  assert "no baseline yet" in out and "rule FAIL doctor healthy" in out
  assert "drain (run with --drain): scontrol update nodename=node2 state=drain" in out
  assert not (tmp_path / "drained").exists()
  assert 'microbench_doctor_node_healthy{node="node2"} 0' in (tmp_path / "textfile" / "microbench.prom").read_text()
  healthy = _bash("healthcheck.sh", tmp_path, MICROBENCH_HOME=ROOT, MICROBENCH_STORE=str(tmp_path / "s.db"),
                  MICROBENCH_NODE="node1")
  assert healthy.returncode == 0 and "node1: healthy" in healthy.stdout, healthy.stdout + healthy.stderr
  named = _bash("healthcheck.sh", tmp_path, MICROBENCH_HOME=ROOT, MICROBENCH_STORE=str(tmp_path / "s.db"),
                MICROBENCH_NODE="node2", MICROBENCH_DRAIN="1")
  assert named.returncode == 1 and "NAMED" in named.stdout
  assert (tmp_path / "drained").read_text().startswith("update nodename=node2 state=drain reason=microbench-doctor")


def test_the_templates_are_well_formed():
  for script in ("nightly.sbatch", "healthcheck.sh"):
    assert subprocess.run(["bash", "-n", os.path.join(FLEET, script)], check=False).returncode == 0
  cron = [l for l in open(os.path.join(FLEET, "nightly.scrontab"), encoding="utf-8") if l.strip()
          and not l.startswith("#")]
  assert len(cron) == 1 and len(cron[0].split()) >= 6 and "scripts/fleet/nightly.sbatch" in cron[0]
  timer = open(os.path.join(FLEET, "systemd", "microbench-nightly.timer"), encoding="utf-8").read()
  service = open(os.path.join(FLEET, "systemd", "microbench-nightly.service"), encoding="utf-8").read()
  assert "OnCalendar=" in timer and "[Install]" in timer and "ExecStart=/usr/bin/sbatch" in service
  assert "scripts/fleet/nightly.sbatch" in service
