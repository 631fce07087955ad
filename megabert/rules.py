"""Every rule that spans more than one flag, written once.

Single-field checks (a positive size, a value in range) stay in the config dataclasses'
`__post_init__`. The rules here relate several flags, or a flag and the world size, and
are called wherever such values are decided: at parsing (flags only), when a DeepSpeed JSON
has been merged (its stage and offload are what runs), by the layout planner for
candidate layouts that no flag describes yet, and by checkpoint conversion. Each raises
ConfigError with one line that names the flags (or the JSON key) and what to do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megabert.errors import ConfigError

if TYPE_CHECKING:  # config.py calls these rules from __post_init__: no import at run time
    from megabert.config import ModelConfig, ParallelConfig, TrainConfig

# Tried (CPU, gloo): the losses are eager's, but dynamo stops at DeepSpeed's hooks in every
# submodule, so what compiles is a dozen fragments per layer and recompilations past
# dynamo's limit, after which those frames run eagerly: a silent fallback, not a speed-up.
COMPILE_ZERO3_WHY = ("ZeRO-3 gathers each submodule's parameters in hooks that torch.compile cannot trace, which "
                     "splits every layer into a graph per linear layer until dynamo gives up and runs them eagerly")


def check_zero(stage: int, *, pp: int = 1, offload_optimizer: bool = False, offload_params: bool = False,
               compile: bool = False, deepspeed: bool = True, stage_source: Optional[str] = None,
               where: str = "") -> None:
    """What a ZeRO stage combines with. `stage_source` names where the stage came from for
    the message (default "--zero-stage N"); `where` follows the offload flags when a JSON
    set them (" (--deepspeed_config X)"). `deepspeed=False` (stage 0 of the planner:
    megabert's own trainer) needs no stage for pipelining."""
    source = stage_source or f"--zero-stage {stage}"
    if compile and stage == 3:
        raise ConfigError(f"--compile cannot combine with {source}: {COMPILE_ZERO3_WHY}; use ZeRO stage 1 or 2 with "
                          f"--compile, or drop --compile")
    if offload_optimizer and stage < 1:
        raise ConfigError(f"--zero-offload-optimizer cpu{where} needs --zero-stage 1, 2 or 3 (ZeRO partitions the "
                          f"optimizer state it offloads)")
    if offload_params and stage != 3:
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


def check_flags(*, train: TrainConfig, pp: int, optimizer: str, sequence_parallel: bool = False,
                seq_length: Optional[int] = None, max_position_embeddings: Optional[int] = None,
                use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = True) -> None:
    """The rules that need no process group and no DeepSpeed JSON (run at parsing)."""
    check_distributed_optimizer(use_distributed_optimizer, deepspeed=train.deepspeed,
                                overlap_grad_reduce=overlap_grad_reduce)
    if seq_length is not None and max_position_embeddings is not None and seq_length > max_position_embeddings:
        raise ConfigError(f"--seq-length {seq_length} exceeds --max-position-embeddings {max_position_embeddings}")
    if train.finetune and not train.load:
        raise ConfigError("--finetune needs --load")
    if not train.deepspeed:
        return
    if optimizer == "lamb":
        raise ConfigError("--optimizer lamb with --deepspeed is not supported: ZeRO and DeepSpeed's precision "
                          "wrappers hand the optimizer flattened buffers, so LAMB's per-tensor trust ratio would "
                          "be wrong; train LAMB without --deepspeed, or use --optimizer adam with ZeRO")
    check_sequence_parallel(sequence_parallel, deepspeed=True)
    if train.deepspeed_config:
        return  # the JSON may choose the stage and offload: checked once merged
    check_zero(train.zero_stage, pp=pp, offload_optimizer=train.zero_offload_optimizer == "cpu",
               offload_params=train.zero_offload_params == "cpu", compile=train.compile)


def check_model_split(model: ModelConfig, tp: int, pp: int, layers_per_virtual_stage: Optional[int] = None) -> None:
    """The model divides over TP (heads, MLP) and PP (layers, virtual chunks)."""
    if model.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {model.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if model.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size {model.ffn_hidden_size} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if model.num_layers % pp:
        raise ConfigError(f"--num-layers {model.num_layers} is not divisible by "
                          f"--pipeline-model-parallel-size {pp}")
    vpp = layers_per_virtual_stage
    if vpp is not None and pp == 1:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if vpp is not None and (vpp < 1 or (model.num_layers // pp) % vpp):
        raise ConfigError(f"layers per pipeline stage ({model.num_layers // pp}) is not divisible by "
                          f"--num-layers-per-virtual-pipeline-stage {vpp}")


def validate_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int,
                    train: TrainConfig | None = None) -> int:
    """Checks the model and the batch against the rank grid; returns the data-parallel size."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                          f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes")
    check_model_split(model, tp, pp, parallel.num_layers_per_virtual_pipeline_stage)
    dp = world_size // (tp * pp)
    if train is not None and train.global_batch_size is not None:
        if train.global_batch_size % (train.micro_batch_size * dp):
            raise ConfigError(f"--global-batch-size {train.global_batch_size} is not divisible by "
                              f"--micro-batch-size {train.micro_batch_size} x data-parallel size {dp}")
    return dp
