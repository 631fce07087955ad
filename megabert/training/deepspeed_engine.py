"""DeepSpeed: the config built from our flags (or checked against them), and the engine.

ZeRO partitions optimizer state (1), gradients (2) and parameters (3) over the
data-parallel group; our ParallelState is handed over as DeepSpeed's `mpu`, so the
partitioning uses our DP group and gradient norms our model-parallel group.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Optional

import torch

from megabert.config import OptimConfig, TrainConfig
from megabert.errors import ConfigError
from megabert.parallel import ParallelState
from megabert.parallel.layout import BatchLayout

logger = logging.getLogger(__name__)


def zero_sizing(hidden_size: int) -> dict:
    """ZeRO buffer sizes scaled to the model, as transformers' DeepSpeed integration fills
    its "auto" values; DeepSpeed's own defaults (5e8-element buckets, 1e9 live
    parameters) would let ZeRO-3 gather all of BERT-large at once and save nothing.

    One transformer layer holds 12 h^2 weights (QKV 3h^2, output h^2, MLP 8h^2); ZeRO-3
    keeps at most two layers' worth gathered, parameters smaller than 10 h stay
    unpartitioned (LayerNorms, biases: gathering them costs more than it saves). The
    layout planner (megabert.planning) reads these same numbers."""
    h2 = hidden_size * hidden_size
    return {
        "reduce_bucket_size": h2,
        "allgather_bucket_size": h2,
        "stage3_prefetch_bucket_size": int(0.9 * h2),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        "stage3_max_live_parameters": 2 * 12 * h2,
        "stage3_max_reuse_distance": 2 * 12 * h2,
        "overlap_comm": True,
        "contiguous_gradients": True,
    }


def build_config(train: TrainConfig, optim: OptimConfig, ps: ParallelState) -> dict:
    """DeepSpeed's JSON from our flags: batch sizes, precision, ZeRO stage, clipping.
    The optimizer stays ours (a client optimizer: AdamW or TP-aware LAMB), and so does the
    LR schedule, so DeepSpeed and plain runs follow the same curve."""
    batch = BatchLayout.of(train.micro_batch_size, train.global_batch_size, ps.dp_size)
    cfg: dict = {
        "train_batch_size": batch.global_batch_size,
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.num_micro_batches,
        "gradient_clipping": optim.clip_grad,
        "zero_optimization": {"stage": train.zero_stage},
        "steps_per_print": 10 ** 9,  # our logger reports; DeepSpeed's own lines would duplicate it
        "wall_clock_breakdown": False,
    }
    if train.bf16:
        cfg["bf16"] = {"enabled": True}
    if train.fp16:
        fp16 = {"enabled": True, "loss_scale_window": optim.loss_scale_window, "hysteresis": optim.hysteresis,
                "min_loss_scale": optim.min_loss_scale}
        if optim.loss_scale is not None:
            fp16["loss_scale"] = optim.loss_scale
        else:
            fp16["loss_scale"] = 0  # dynamic
            fp16["initial_scale_power"] = int(math.log2(optim.initial_loss_scale))
        cfg["fp16"] = fp16
    return cfg


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def merge_user_config(path: str, built: dict, train: TrainConfig) -> dict:
    """The user's JSON, checked against the flags: a value both set differently is an error."""
    try:
        with open(path) as f:
            user = json.load(f)
    except OSError as e:
        raise ConfigError(f"--deepspeed_config {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path} is not valid JSON: {e}")
    checks = [("train_batch_size", "--global-batch-size"), ("train_micro_batch_size_per_gpu", "--micro-batch-size"),
              ("gradient_accumulation_steps", "--global-batch-size / (--micro-batch-size x DP)"),
              ("gradient_clipping", "--clip-grad")]
    for key, flag in checks:
        if key in user and user[key] != built[key]:
            raise ConfigError(f"--deepspeed_config {path} sets {key}={user[key]} but the flags give {built[key]} "
                              f"({flag}); make them agree or drop the key from the JSON")
    for prec, flag in (("bf16", "--bf16"), ("fp16", "--fp16")):
        user_on = bool(_get(user, f"{prec}.enabled"))
        if prec in user and user_on != getattr(train, prec):
            raise ConfigError(f"--deepspeed_config {path} has {prec}.enabled={user_on} but {flag} is "
                              f"{'set' if getattr(train, prec) else 'not set'}; make them agree")
    user_stage = _get(user, "zero_optimization.stage")
    if train.zero_stage and user_stage is not None and user_stage != train.zero_stage:
        raise ConfigError(f"--deepspeed_config {path} has zero_optimization.stage={user_stage} but --zero-stage "
                          f"is {train.zero_stage}; make them agree")
    merged = {**built, **user}
    merged["zero_optimization"] = {**built["zero_optimization"], **user.get("zero_optimization", {})}
    return merged


def initialize(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], config: dict,
               ps: ParallelState):
    """Returns the DeepSpeed engine wrapping `model`."""
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigError(f"--deepspeed needs the deepspeed package ({e}); `pip install deepspeed` "
                          f"or `make install` (it is in the deepspeed extra)")
    # DeepSpeed reads the launch from torchrun's variables; under mpirun, srun or a single
    # process they are missing, so export what init_parallel discovered.
    os.environ.setdefault("LOCAL_RANK", str(ps.local_rank))
    os.environ.setdefault("RANK", str(ps.rank))
    os.environ.setdefault("WORLD_SIZE", str(ps.world_size))
    client_optimizer = None if "optimizer" in config else optimizer
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client_optimizer, config=config, mpu=ps,
                                           dist_init_required=False)
    return engine


def reduce_gradients(engine, zero_stage: int) -> None:
    """Reduces gradients accumulated outside `engine.backward` (the pipeline schedule's
    backward) over the data-parallel group, ZeRO-1 into its optimizer-state partitions;
    `engine.step()` then applies them with DeepSpeed's clipping, loss-scale bookkeeping
    and global norm. Only ZeRO-1 takes gradients accumulated this way: ZeRO-2/3 reduce
    inside backward hooks, and DeepSpeed without ZeRO clips with a norm that counts
    pipeline stages wrongly (both refused at argument parsing)."""
    if zero_stage != 1:
        raise ValueError(f"pipeline + DeepSpeed needs ZeRO stage 1, got {zero_stage}")
    engine.set_gradient_accumulation_boundary(True)
    engine.optimizer.reduce_gradients(pipeline_parallel=True)
