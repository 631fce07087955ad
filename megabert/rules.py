"""Every rule that spans more than one flag, written once and applied once.

Single-field checks (a positive size, a value in range) stay in the config dataclasses'
`__post_init__`. The rules here relate several flags, or flags and the world, and each
runs at one point of the one resolution:

- `check_flags(cfg)`: the rules between flags alone, when the flags are parsed
  (megabert.arguments), before any process group exists: a wrong combination costs no
  launch, and under torchrun every rank reports it alike.
- the world-size rule, where the rank grid is built (megabert.parallel.layout
  `data_parallel_size`, called by ParallelState.build: the Python API's door too).
- `resolve_run` (megabert.training.resolve) applies the rest once the world is known:
  the model's split over TP/PP (`check_model_split`), the batch over the data-parallel
  ranks (megabert.parallel.layout.BatchLayout), the ZeRO plan that runs
  (`check_zero`) when the engine's JSON chose its stage or an offload (a plan from the
  flags alone was checked with the flags), the binary head's objective on the data
  that --data-path names (`sentence_pairs`; the shards' own rule is
  megabert.data.shard_sources.sentence_pair_task), and --seq-length against the model's
  positions (`check_seq_length`) once the run's start has given the model its shape (a
  loaded ModernBERT brings its own).

The layout planner applies the same functions to candidate layouts that no flag describes
yet, checkpoint conversion to the layout it writes, and a model being built to its own
shape (`check_model_split`: the Python API builds models without a resolved run). Each raises ConfigError with one
line that names the flags (or the JSON key) and what to do.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

from megabert.config import Configs, DataConfig, FinetuneConfigs, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megabert.data.shard_sources import detect_nvidia_data, sentence_pair_task
from megabert.data_parallel.zero_plan import ZeroPlan
from megabert.errors import ConfigError
from megabert.families import get_family
from megabert.parallel.layout import UNEVEN_FLAGS, BatchLayout, data_parallel_size, stage_layer_counts

logger = logging.getLogger(__name__)

# Tried (CPU, gloo): the losses are eager's, but dynamo stops at DeepSpeed's hooks in every
# submodule, so what compiles is a dozen fragments per layer and recompilations past
# dynamo's limit, after which those frames run eagerly: a silent fallback, not a speed-up.
COMPILE_ZERO3_WHY = ("ZeRO-3 gathers each submodule's parameters in hooks that torch.compile cannot trace, which "
                     "splits every layer into a graph per linear layer until dynamo gives up and runs them eagerly")


def zero_plan_from_flags(train: TrainConfig) -> ZeroPlan:
    """The ZeRO plan the flags alone describe (no sizes: those need the model)."""
    return ZeroPlan(stage=train.zero_stage, offload_optimizer=train.zero_offload_optimizer == "cpu",
                    offload_params=train.zero_offload_params == "cpu", source="flag")


def check_zero(plan: ZeroPlan, *, pp: int = 1, compile: bool = False, deepspeed: bool = True) -> None:
    """What a ZeRO stage combines with. The plan's `stage_origin` and `offload_origin` name
    where the stage and the offloads came from in the message. `deepspeed=False` (stage 0 of
    the planner: megabert's own trainer) needs no stage for pipelining."""
    stage, source, where = plan.stage, plan.stage_origin, plan.offload_origin
    if compile and stage == 3:
        raise ConfigError(f"--compile cannot combine with {source}: {COMPILE_ZERO3_WHY}; use ZeRO stage 1 or 2 with "
                          f"--compile, or drop --compile")
    if plan.offload_optimizer and stage < 1:
        raise ConfigError(f"--zero-offload-optimizer cpu{where} needs --zero-stage 1, 2 or 3 (ZeRO partitions the "
                          f"optimizer state it offloads)")
    if plan.offload_params and stage != 3:
        raise ConfigError(f"--zero-offload-params cpu{where} needs --zero-stage 3 (only ZeRO-3 partitions "
                          f"parameters); got {source}")
    if pp > 1 and stage > 1:
        raise ConfigError(f"{source} cannot combine with --pipeline-model-parallel-size {pp} > 1 (ZeRO-2/3 "
                          f"partition gradients that pipeline stages accumulate outside DeepSpeed's backward); "
                          f"use ZeRO stage 1")
    if pp > 1 and stage == 0 and deepspeed:
        raise ConfigError(f"--deepspeed with --pipeline-model-parallel-size {pp} needs --zero-stage 1, got {source} "
                          f"(without ZeRO, DeepSpeed's gradient clipping counts pipeline stages wrongly); use ZeRO "
                          f"stage 1 or drop --deepspeed")


def check_sequence_parallel(sequence_parallel: bool, *, deepspeed: bool) -> None:
    if sequence_parallel and deepspeed:
        raise ConfigError("--sequence-parallel with --deepspeed is not supported: DeepSpeed reduces gradients "
                          "before the sequence-parallel LayerNorm gradients are summed; drop one of them")


def check_distributed_optimizer(use_distributed_optimizer: bool, *, deepspeed: bool, overlap_grad_reduce: bool
                                ) -> None:
    """megabert's own distributed optimizer is its own strategy's: DeepSpeed shards with ZeRO."""
    if not use_distributed_optimizer:
        return
    if deepspeed:
        raise ConfigError("--use-distributed-optimizer cannot combine with --deepspeed (DeepSpeed shards the "
                          "optimizer with its own ZeRO): drop --deepspeed, or use --zero-stage 1 instead")
    if not overlap_grad_reduce:
        raise ConfigError("--use-distributed-optimizer reduce-scatters gradient buckets as backward produces them "
                          "and has no path without --overlap-grad-reduce; drop --no-overlap-grad-reduce")


def check_train(train: TrainConfig) -> None:
    """The training flags among themselves: precision, how a run starts, what needs --deepspeed."""
    if train.bf16 and train.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive: pick one")
    if train.pretrained_checkpoint and train.finetune:
        raise ConfigError("--pretrained-checkpoint already takes the weights only and resumes the run's own "
                          "checkpoint once there is one; drop --finetune")
    if train.finetune and not train.load:
        raise ConfigError("--finetune needs --load")
    if train.deepspeed_config and not train.deepspeed:
        raise ConfigError("--deepspeed_config needs --deepspeed")
    if train.zero_stage and not train.deepspeed:
        raise ConfigError(f"--zero-stage {train.zero_stage} needs --deepspeed")
    for name, what in (("zero_offload_optimizer", "optimizer"), ("zero_offload_params", "params")):
        if getattr(train, name) != "none" and not train.deepspeed:
            raise ConfigError(f"--zero-offload-{what} {getattr(train, name)} needs --deepspeed")


def check_optim(optim: OptimConfig) -> None:
    """The optimizer flags that bound one another."""
    if not 0.0 <= optim.lr_warmup_init <= optim.lr:
        raise ConfigError(f"--lr-warmup-init must be in [0, --lr], got {optim.lr_warmup_init} with --lr {optim.lr}")
    if not 0.0 <= optim.lamb_min_coeff <= optim.lamb_max_coeff:
        raise ConfigError(f"LAMB's trust-ratio bounds need 0 <= --lamb-min-coeff <= --lamb-max-coeff, got "
                          f"{optim.lamb_min_coeff} and {optim.lamb_max_coeff}")
    if optim.min_lr < 0 or optim.min_lr > optim.lr:
        raise ConfigError(f"--min-lr must be in [0, --lr], got {optim.min_lr} with --lr {optim.lr}")


def check_steps_past_decay(optim: OptimConfig, train_iters: Optional[int]) -> None:
    """Steps past --lr-decay-iters run at --min-lr (Megatron's rule): with --min-lr 0 they
    would be steps at lr 0, which change nothing (megabert.optim.lr_schedules)."""
    decays = optim.lr_decay_style not in ("constant", "warmup_exp_decay_exp")
    if decays and optim.min_lr == 0 and optim.lr_decay_iters and train_iters and optim.lr_decay_iters < train_iters:
        raise ConfigError(f"--lr-decay-iters {optim.lr_decay_iters} < --train-iters {train_iters} with --min-lr 0: "
                          f"the last {train_iters - optim.lr_decay_iters} steps would run at lr 0; raise "
                          f"--lr-decay-iters to {train_iters} or give --min-lr a positive value")


def check_model(model: ModelConfig) -> None:
    """The architecture's flags among themselves."""
    if model.hidden_size % model.num_attention_heads and model.kv_channels is None:
        raise ConfigError(f"--hidden-size {model.hidden_size} is not divisible by "
                          f"--num-attention-heads {model.num_attention_heads}")
    if model.num_attention_heads % model.num_kv_heads:
        raise ConfigError(f"--num-attention-heads {model.num_attention_heads} is not divisible by "
                          f"--num-query-groups {model.num_kv_heads}")
    if model.unpad_input and model.sequence_parallel:
        raise ConfigError("--unpad-input cannot combine with --sequence-parallel (the sequence is split over "
                          "tensor-parallel ranks, the real tokens are not); use --no-unpad-input")


def check_flags(cfg: Configs | FinetuneConfigs) -> None:
    """The rules that need no process group and no DeepSpeed JSON (run at parsing). A ZeRO
    plan from the flags alone is checked here; one that a --deepspeed_config may change, in
    resolve_run once merged."""
    # Fine-tuning has no model section: its model comes from --load.
    train, model = cfg.train, cfg.model if isinstance(cfg, Configs) else None
    check_train(train)
    if (isinstance(cfg, FinetuneConfigs) and train.save and train.load and
            os.path.realpath(train.save) == os.path.realpath(train.load)):
        # Fine-tuning resumes what --save holds: the pre-trained checkpoint would be taken for
        # the run's own, and the fine-tuned model saved over it.
        raise ConfigError(f"--save {train.save} is also --load: fine-tuning reads the pre-trained model from --load "
                          f"and keeps (and resumes) its own run in --save; give --save a directory of its own")
    check_optim(cfg.optim)
    check_steps_past_decay(cfg.optim, train.train_iters if isinstance(cfg, Configs) else cfg.finetune.train_iters)
    if model is not None:
        check_model(model)
        if model.bf16_residual and not train.bf16:
            raise ConfigError("--bf16-residual needs --bf16: it keeps the residual stream in bf16 inside bf16 "
                              "mixed precision (fp16's range is too narrow for it); add --bf16 or drop the flag")
    check_distributed_optimizer(cfg.parallel.use_distributed_optimizer, deepspeed=train.deepspeed,
                                overlap_grad_reduce=cfg.parallel.overlap_grad_reduce)
    check_cuda_graphs(cfg)
    if not train.deepspeed:
        return
    if cfg.optim.optimizer == "lamb":
        raise ConfigError("--optimizer lamb with --deepspeed is not supported: ZeRO and DeepSpeed's precision "
                          "wrappers hand the optimizer flattened buffers, so LAMB's per-tensor trust ratio would "
                          "be wrong; train LAMB without --deepspeed, or use --optimizer adam with ZeRO")
    check_sequence_parallel(bool(model and model.sequence_parallel), deepspeed=True)
    if not train.deepspeed_config:
        check_zero(zero_plan_from_flags(train), pp=cfg.parallel.pipeline_model_parallel_size, compile=train.compile)


def check_cuda_graphs(cfg: Configs | FinetuneConfigs) -> None:
    """--cuda-graphs (megabert.training.cuda_graphs): a replay reruns no Python, so the step must
    have fixed shapes and nothing per step that Python does inside forward or backward."""
    train = cfg.train
    if not train.cuda_graphs:
        return
    if isinstance(cfg, FinetuneConfigs):
        raise ConfigError("--cuda-graphs is for pretrain_bert.py with --pack-sequences; fine-tuning steps are "
                          "not fixed-shape: drop --cuda-graphs")
    why = [(not cfg.data.pack_sequences, "needs --pack-sequences: only packed rows have the same shapes at every "
                                         "micro-batch"),
           (train.fp16, "cannot replay fp16's loss scale, which changes between steps: use --bf16"),
           (train.deepspeed, "cannot combine with --deepspeed: its engine runs Python hooks inside backward"),
           (cfg.parallel.use_distributed_optimizer, "cannot combine with --use-distributed-optimizer: its "
                                                    "parameter gathers are hooks of the forward"),
           (cfg.parallel.pipeline_model_parallel_size > 1, "needs --pipeline-model-parallel-size 1: a pipeline "
                                                            "schedule exchanges activations between stages"),
           (cfg.parallel.tensor_model_parallel_size > 1, "needs --tensor-model-parallel-size 1: tensor parallelism's "
                                                          "collectives replayed inside a graph would escape "
                                                          "--distributed-timeout-minutes (a lost peer would hang the "
                                                          "job) and the per-step byte ledger"),
           (not get_family(cfg.model.model_family).packed_mlm_slots,
            f"is for BERT-style masked LMs' fixed-shape packed step; --model-family {cfg.model.model_family}'s "
            f"selects its masked positions on the device"),
           (cfg.model.recompute_granularity is not None, "cannot combine with --recompute-granularity: the "
                                                         "recompute restores RNG states by value inside backward")]
    for bad, what in why:
        if bad:
            raise ConfigError(f"--cuda-graphs {what}")


def check_seq_length(seq_length: int, model: ModelConfig) -> None:
    """Run in resolve_run, once the model's shape is known (a loaded ModernBERT brings its own
    8,192 positions)."""
    if seq_length > model.max_position_embeddings:
        raise ConfigError(f"--seq-length {seq_length} exceeds --max-position-embeddings "
                          f"{model.max_position_embeddings}")


def sentence_pairs(data: DataConfig, model: Optional[ModelConfig], explicit: frozenset) -> DataConfig:
    """--binary-head-task as the data decides it: NSP on NVIDIA's shards
    (megabert.data.shard_sources.sentence_pair_task), with one info line when the data, not a
    flag, chose it."""
    if model is None or not model.bert_binary_head:
        return data
    source = detect_nvidia_data(data.data_path)
    fmt = source.format if source is not None else None
    task = sentence_pair_task(fmt, data.binary_head_task, given="data.binary_head_task" in explicit)
    if task == data.binary_head_task:
        return data
    logger.info("--data-path holds %s shards, whose sentence pairs are next-sentence pairs: the binary head "
                "trains NSP (--bert-no-binary-head trains none)", fmt)
    return dataclasses.replace(data, binary_head_task=task)


def check_model_split(model: ModelConfig, tp: int, pp: int, layers_per_virtual_stage: Optional[int] = None,
                      first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None) -> None:
    """The model divides over TP (heads, MLP) and PP (layers, virtual chunks; uneven first and
    last stages by megabert.parallel.layout.stage_layer_counts)."""
    check_model(model)
    if model.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {model.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    kv = model.num_kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(f"--num-query-groups {kv} neither splits over nor replicates onto "
                          f"--tensor-model-parallel-size {tp}: use a TP size that divides or is a multiple of it")
    if model.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size {model.ffn_hidden_size} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    stage_layer_counts(model.num_layers, pp, first_stage_layers, last_stage_layers)
    vpp = layers_per_virtual_stage
    if vpp is not None and (first_stage_layers is not None or last_stage_layers is not None):
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage (the interleaved schedule) cannot combine with "
                          f"{UNEVEN_FLAGS}: its chunks are equal; drop one or the other")
    if vpp is not None and pp == 1:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if vpp is not None and (vpp < 1 or (model.num_layers // pp) % vpp):
        raise ConfigError(f"layers per pipeline stage ({model.num_layers // pp}) is not divisible by "
                          f"--num-layers-per-virtual-pipeline-stage {vpp}")


def validate_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int,
                    train: TrainConfig | None = None) -> int:
    """The model and the batch against a rank grid that no ParallelState describes yet
    (checkpoint conversion, a layout written for later); returns the data-parallel size.
    The rules are the ones above and megabert.parallel.layout's, not restated here."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    dp = data_parallel_size(world_size, tp, pp)
    check_model_split(model, tp, pp, parallel.num_layers_per_virtual_pipeline_stage,
                      parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers)
    if train is not None:
        BatchLayout.of(train.micro_batch_size, train.global_batch_size, dp)
    return dp
