#!/usr/bin/env bash
# One node:      DATA_PATH=... VOCAB_FILE=... SIZE=large PHASE=1 bash examples/pretrain_torchrun.sh
# Several nodes: run on every node with NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0> MASTER_PORT=29500
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/launchers.sh
source examples/recipes.sh
GPUS_PER_NODE=${GPUS_PER_NODE:-$("${PYTHON}" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
exec "${TORCHRUN[@]}" --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  pretrain_bert.py ${ARGS} "$@"
