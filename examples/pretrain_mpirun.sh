#!/usr/bin/env bash
# mpirun (Open MPI or MPICH; `pip install mpi4py mpich` brings one into the venv):
#   NP=16 HOSTS=node1:8,node2:8 DATA_PATH=... VOCAB_FILE=... bash examples/pretrain_mpirun.sh
# Rank 0 publishes the rendezvous address over MPI; no MASTER_ADDR needed.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/launchers.sh
source examples/recipes.sh
HOST_ARGS=""
[ -n "${HOSTS:-}" ] && HOST_ARGS="-hosts ${HOSTS}"
exec "${MPIRUN}" -np "${NP:-2}" ${HOST_ARGS} "${PYTHON}" pretrain_bert.py ${ARGS} "$@"
