#!/usr/bin/env bash
# The deepspeed launcher with a hostfile ("host slots=8" per line) and a ds_config JSON:
#   HOSTFILE=examples/hostfile DS_CONFIG=examples/ds_config_zero1.json DATA_PATH=... VOCAB_FILE=... \
#   bash examples/pretrain_deepspeed.sh
# The JSON may only add to the flags (ZeRO details, communication); batch sizes,
# precision and the ZeRO stage it repeats must agree with them, or the run stops.
set -euo pipefail
cd "$(dirname "$0")/.."
# ZeRO partitions flattened optimizer state, which LAMB's per-tensor trust ratio cannot
# use: with DeepSpeed the recipe trains AdamW (BERT's original optimizer) at a smaller LR.
OPTIMIZER=adam
LR=${LR:-$([ "${PHASE:-1}" = 1 ] && echo 4e-4 || echo 2.8e-4)}
source examples/launchers.sh
source examples/recipes.sh
DS_CONFIG=${DS_CONFIG:-examples/ds_config_zero1.json}
LAUNCH_ARGS="--master_port ${MASTER_PORT:-29500}"
[ -n "${HOSTFILE:-}" ] && LAUNCH_ARGS="${LAUNCH_ARGS} --hostfile ${HOSTFILE}"
# Without a hostfile the launcher counts local GPUs; GPUS_PER_NODE overrides (CPU: processes).
[ -n "${GPUS_PER_NODE:-}" ] && LAUNCH_ARGS="${LAUNCH_ARGS} --num_gpus ${GPUS_PER_NODE}"
exec "${DEEPSPEED}" ${LAUNCH_ARGS} pretrain_bert.py ${ARGS} --deepspeed --deepspeed_config "${DS_CONFIG}" \
  --zero-stage "${ZERO_STAGE:-1}" "$@"
