# Sourced by the launch scripts: model and optimizer flags for SIZE (base|large) and
# PHASE (1: seq 128, 2: seq 512), after NVIDIA's and DeepSpeed's LAMB BERT recipes
# (phase 1: 7038 steps at 64k sequences, lr 6e-3, 28.43% warmup; phase 2: 1563 steps at
# 32k, lr 4e-3, 12.8% warmup; polynomial decay with power 0.5).
# Override any of them from the environment, e.g. GLOBAL_BATCH=4096 TRAIN_ITERS=1000.
SIZE=${SIZE:-large}
PHASE=${PHASE:-1}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a prefix made by tools/preprocess_data.py}
VOCAB_FILE=${VOCAB_FILE:?set VOCAB_FILE to the WordPiece vocab.txt}
SAVE=${SAVE:-checkpoints/bert-${SIZE}}
TP=${TP:-1}
PP=${PP:-1}  # pipeline stages (with the deepspeed launcher: ZeRO stage 1 only)
VPP_ARGS=${VPP:+--num-layers-per-virtual-pipeline-stage ${VPP}}  # VPP=K: interleaved, K layers per chunk
if [ "$PHASE" = 1 ]; then
  SEQ=128; GLOBAL_BATCH=${GLOBAL_BATCH:-65536}; MICRO_BATCH=${MICRO_BATCH:-64}
  LR=${LR:-6e-3}; WARMUP=${WARMUP:-0.2843}; TRAIN_ITERS=${TRAIN_ITERS:-7038}; LOAD_ARGS=""
  # Re-running phase 1 after an interruption resumes its last checkpoint.
  if [ -f "${SAVE}-phase1/latest_checkpointed_iteration.txt" ]; then LOAD_ARGS="--load ${SAVE}-phase1"; fi
else
  SEQ=512; GLOBAL_BATCH=${GLOBAL_BATCH:-32768}; MICRO_BATCH=${MICRO_BATCH:-16}
  LR=${LR:-4e-3}; WARMUP=${WARMUP:-0.128}; TRAIN_ITERS=${TRAIN_ITERS:-1563}
  # Phase 2 starts from phase 1's weights with a fresh optimizer, schedule and data position
  # while ${SAVE}-phase2 holds no checkpoint; once it does, re-running this same command
  # resumes phase 2 from it (iteration, optimizer, data position) and phase 1 is not read.
  LOAD_ARGS="--pretrained-checkpoint ${PHASE1_CHECKPOINT:-${SAVE}-phase1} --load ${SAVE}-phase2"
fi
PRECISION=${PRECISION---bf16}  # PRECISION= (empty) for fp32, e.g. on CPU
ARGS="--preset bert-${SIZE} --seq-length ${SEQ} --max-position-embeddings 512 \
  --micro-batch-size ${MICRO_BATCH} --global-batch-size ${GLOBAL_BATCH} --train-iters ${TRAIN_ITERS} \
  --optimizer ${OPTIMIZER:-lamb} --lr ${LR} --min-lr 0 --lr-warmup-fraction ${WARMUP} --lr-decay-style polynomial \
  --lr-decay-power 0.5 --weight-decay 0.01 --clip-grad 1.0 \
  --data-path ${DATA_PATH} --vocab-file ${VOCAB_FILE} --split ${SPLIT:-949,50,1} \
  --tensor-model-parallel-size ${TP} --pipeline-model-parallel-size ${PP} ${VPP_ARGS} ${PRECISION} --mlm-logits-at-masked-only \
  --save ${SAVE}-phase${PHASE} --save-interval ${SAVE_INTERVAL:-500} --keep-last-checkpoints 3 \
  --eval-interval ${EVAL_INTERVAL:-1000} --eval-iters 10 --log-interval ${LOG_INTERVAL:-10} \
  --metrics-file ${SAVE}-phase${PHASE}/metrics.jsonl --tensorboard-dir ${SAVE}-phase${PHASE}/tensorboard ${LOAD_ARGS}"
