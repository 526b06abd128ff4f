#!/bin/bash
# SLURM HealthCheckProgram (slurm.conf: HealthCheckProgram=/opt/microbench/scripts/fleet/healthcheck.sh,
# HealthCheckInterval=300) or Prolog: this node's latest verdict from the results store, no GPU work. A node the
# latest doctor run named is drained with the doctor's reason when MICROBENCH_DRAIN=1, else the scontrol line is
# printed. Exit 0 healthy (or never examined), 1 named.
# Settings (environment): MICROBENCH_STORE (the store the nightly job writes), MICROBENCH_HOME (the checkout),
# MICROBENCH_NODE (default: this host's short name, as SLURM names nodes).
set -uo pipefail
cd "${MICROBENCH_HOME:-$(dirname "$0")/../..}" || exit 0
[[ -f .venv/bin/activate ]] && source .venv/bin/activate
node="${MICROBENCH_NODE:-$(hostname -s)}"
drain=()
[[ "${MICROBENCH_DRAIN:-0}" == 1 ]] && drain=(--drain)
microbench-report --fleet --node="${node}" "${drain[@]}"
