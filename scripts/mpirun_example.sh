#!/bin/bash
# Multi-host microbench with Open MPI's mpirun, one process per GPU.
#   scripts/mpirun_example.sh HOSTFILE GPUS_PER_NODE [microbench flags ...]
#   scripts/mpirun_example.sh hosts.txt 8 --scopes=scale_out,global --min_bytes=1M --max_bytes=1G
# HOSTFILE lines are "node01 slots=8"; process 0 (and the coordinator) runs on the first host.
# The coordinator, process count and rank are passed explicitly, which works with every Open MPI: JAX's
# own detection (`--distributed` alone) reads OMPI_MCA_orte_hnp_uri, which Open MPI 5 no longer sets. The GPU:
# microbench reads OMPI_COMM_WORLD_LOCAL_RANK and _LOCAL_SIZE itself (Open MPI 4 and 5 set both): rank L of a
# node drives GPU L of those CUDA_VISIBLE_DEVICES shows (all of them when it is unset); a CUDA_VISIBLE_DEVICES
# you export is kept, so a partial node works. --local_device_ids (after the script's arguments) overrides.
set -euo pipefail
HOSTFILE=${1:?usage: $0 HOSTFILE GPUS_PER_NODE [microbench flags ...]}
GPUS=${2:?usage: $0 HOSTFILE GPUS_PER_NODE [microbench flags ...]}
shift 2
NODES=$(grep -Evc '^[[:space:]]*(#|$)' "$HOSTFILE")
HEAD=$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE")
PORT=${MICROBENCH_PORT:-29500}
# NCCL's, XLA's and JAX's settings reach the ranks on other hosts too (mpirun exports only what -x names).
EXPORTS=()
for name in $(compgen -e | grep -E '^(NCCL_|XLA_|JAX_|CUDA_VISIBLE_DEVICES$)' || true); do EXPORTS+=(-x "$name"); done
exec mpirun --hostfile "$HOSTFILE" -np $((NODES * GPUS)) --map-by "ppr:${GPUS}:node" --bind-to none \
  -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH -x VIRTUAL_ENV ${EXPORTS[@]+"${EXPORTS[@]}"} \
  bash -c 'exec python -m microbench --distributed --coordinator_address='"${HEAD}:${PORT}"' \
      --num_processes=$OMPI_COMM_WORLD_SIZE --process_id=$OMPI_COMM_WORLD_RANK "$@"' microbench "$@"
