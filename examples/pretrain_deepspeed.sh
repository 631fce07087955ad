#!/usr/bin/env bash
# The deepspeed launcher with a hostfile ("host slots=8" per line) and a ds_config JSON:
#   HOSTFILE=examples/hostfile DS_CONFIG=examples/ds_config_zero1.json DATA_PATH=... VOCAB_FILE=... \
#   bash examples/pretrain_deepspeed.sh
# The JSON may only add to the flags (ZeRO details, communication); batch sizes,
# precision and the ZeRO stage it repeats must agree with them, or the run stops.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/recipes.sh
DS_CONFIG=${DS_CONFIG:-examples/ds_config_zero1.json}
HOSTFILE_ARGS=""
[ -n "${HOSTFILE:-}" ] && HOSTFILE_ARGS="--hostfile ${HOSTFILE}"
exec deepspeed ${HOSTFILE_ARGS} pretrain_bert.py ${ARGS} --deepspeed --deepspeed_config "${DS_CONFIG}" \
  --zero-stage "${ZERO_STAGE:-1}" "$@"
