"""DeepSpeed's engine: initialised around our model and optimizer, with our ParallelState
as its `mpu` (through the adapter in .mpu), so ZeRO partitions over our data-parallel group
and gradient norms reduce over our model-parallel group.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from megabert.errors import ConfigError
from megabert.parallel import ParallelState
from megabert.parallel.param_spec import spec_table
from megabert.training.deepspeed.door_backend import guard_deepspeed_comm
from megabert.training.deepspeed.ds_config import engine_config
from megabert.training.deepspeed.jit_ops import note_jit_build
from megabert.training.deepspeed.mpu import DeepSpeedMpu, mark_pipe_replicated
from megabert.training.deepspeed.zero_masters import share_fp32_masters
from megabert.training.deepspeed.version import private_patches_allowed

logger = logging.getLogger(__name__)


def initialize(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], config: dict,
               ps: ParallelState):
    """Returns the DeepSpeed engine wrapping `model`."""
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigError(f"--deepspeed needs the deepspeed package ({e}); `pip install deepspeed` "
                          f"or `make install` (it is in the deepspeed extra)")
    start_comm(ps)
    mark_pipe_replicated(model, spec_table(model), ps)
    # Always our optimizer: a JSON's optimizer section was translated, not merged.
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=engine_config(config),
                                           mpu=DeepSpeedMpu(ps), dist_init_required=False)
    stage = config["zero_optimization"].get("stage", 0)
    freed = share_fp32_masters(engine.optimizer, stage) if private_patches_allowed() else 0
    if freed and ps.is_logging_rank:
        logger.info("ZeRO-%d in fp32: DeepSpeed's fp32 master partition shares the parameter partition's memory "
                    "(%.2f GB per rank not duplicated)", stage, freed / 1e9)
    return engine


def start_comm(ps: ParallelState) -> None:
    """deepspeed.comm over our process groups, behind megabert's door (before
    deepspeed.initialize, which then finds it started)."""
    # DeepSpeed reads the launch from torchrun's variables; under mpirun, srun or a single
    # process they are missing, so export what init_parallel discovered.
    os.environ.setdefault("LOCAL_RANK", str(ps.local_rank))
    os.environ.setdefault("RANK", str(ps.rank))
    os.environ.setdefault("WORLD_SIZE", str(ps.world_size))
    if ps.device.type == "cpu":
        _skip_shm_comm_build()
    # ZeRO's collectives bypass megabert's door: count them, word a lost peer and give any
    # group DeepSpeed makes the run's timeout where DeepSpeed sends them, from the start.
    guard_deepspeed_comm(ps.timeout)


def _skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce when it starts (1.5-4
    minutes on 2 cores the first time, a ninja check in every process after) that only
    `deepspeed.comm.inference_all_reduce` (DeepSpeed-Inference) uses; training never calls
    it. Marking the op incompatible makes DeepSpeed's `build_shm_op` return None, as on a
    machine where it cannot build. Unknown DeepSpeed version: its own behaviour, with a
    one-line note that the first run compiles."""
    import deepspeed.ops

    if private_patches_allowed():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        note_jit_build("ShareMemCommBuilder", "DeepSpeed's shared-memory collectives on CPU")


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
