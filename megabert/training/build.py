"""Model + configs -> a ready Trainer: optimizer, micro-batch runner (sequential or
pipeline schedule), update strategy (ours or DeepSpeed's), checkpoint state and
data position. Shared by pre-training and fine-tuning."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from megabert.config import TrainConfig
from megabert.model.transformer import compile_layers
from megabert.optim import LRSchedule, build_optimizer
from megabert.optim.grad_scaler import DynamicLossScaler
from megabert.parallel import ParallelState
from megabert.pipeline_parallel import PipeComm, PipelineSchedule, pipeline_dtype
from megabert.data_parallel.overlap import OverlappedGradReducer
from megabert.training.precision import MasterWeights, autocast
from megabert.checkpoint.manager import CheckpointManager
from megabert.training.checkpoint_state import local_parts, preload_weights
from megabert.training.cuda_graphs import CudaGraphs, GraphedRunner
from megabert.training.strategy import LocalStrategy, SequentialRunner, Strategy, TrainingTask
from megabert.training.trainer import Batches, Trainer

if TYPE_CHECKING:
    from megabert.training.resolve import ResolvedRun

logger = logging.getLogger(__name__)


def apply_compile(model: torch.nn.Module, ps: ParallelState, train: TrainConfig, *, fixed_shapes: bool = False
                  ) -> None:
    """--compile: torch.compile the model's transformer layers, once, where the model is
    built (before DeepSpeed wraps it). `fixed_shapes`: every micro-batch is the same tensors
    (--pack-sequences: megabert.model.packed), so on CUDA the layers compile in mode
    "reduce-overhead" with static shapes: their forward and backward replay as CUDA graphs
    (no launch per kernel from Python; the step reads nothing back from the device to allow it)."""
    if not train.compile:
        return
    # --cuda-graphs captures the whole micro-batch, compiled layers included (their graphs
    # replay inside it, not as CUDA graph trees of their own).
    cuda_graphs = fixed_shapes and ps.device.type == "cuda" and not train.cuda_graphs
    # NOTE: CUDA graph trees replay a graph into the buffers of its last replay; a pipeline
    # schedule (forwards of several micro-batches before their backwards) and full recompute
    # (a layer's forward run again inside backward) break that pattern and are untried with it.
    # Gradient accumulation failed on an H200: a micro-batch's backward read a saved activation
    # that a later replay had overwritten (tests/test_packed_fixed_shape.py's CUDA test, two
    # micro-batches a step); one micro-batch a step ran (make bench-gpu).
    micro_batches = (train.global_batch_size or train.micro_batch_size * ps.dp_size) // (
        train.micro_batch_size * ps.dp_size)
    untried = [why for why, on in (("--pipeline-model-parallel-size > 1", ps.pp_size > 1),
                                   ("--recompute-granularity full",
                                    model.config.recompute_granularity == "full"),
                                   (f"{micro_batches} micro-batches a step (failed on an H200)",
                                    micro_batches > 1)) if on]
    if cuda_graphs and untried:
        cuda_graphs = False
        if ps.is_logging_rank:
            logger.info("--compile with --pack-sequences: no CUDA graphs with %s (untried or failing); the layers "
                        "compile as without packing", " and ".join(untried))
    n = compile_layers(model, cuda_graphs=cuda_graphs)
    if ps.is_logging_rank:
        logger.info("--compile: %d transformer layers compiled with torch.compile%s; the first training step and the "
                    "first evaluation compile them (once per process)", n,
                    ' (mode "reduce-overhead": CUDA graphs of packed rows\' fixed shapes)' if cuda_graphs else "")


def build_runner(model: torch.nn.Module, ps: ParallelState, task: TrainingTask, *, seq_length: int,
                 micro_batch_size: int, num_micro_batches: int, bf16: bool = False, fp16: bool = False):
    """What takes micro-batches through the model, for training and forward-only alike:
    the pipeline schedule with PP > 1 (stages exchange [s, b, h] activations of this
    micro-batch size), else one micro-batch after another."""
    amp = lambda: autocast(ps.device, bf16, fp16)  # noqa: E731
    if ps.pp_size > 1:
        comm = PipeComm(ps, model.activation_shape(seq_length, micro_batch_size), pipeline_dtype(bf16))
        return PipelineSchedule(model, ps, comm, num_micro_batches, task, autocast=amp)
    return SequentialRunner(model, task, amp)


def build_predictor(model: torch.nn.Module, ps: ParallelState, task: TrainingTask, *, seq_length: int,
                    micro_batch_size: int, bf16: bool = False, fp16: bool = False) -> Strategy:
    """A strategy without an optimizer, for forward-only use (prediction, trained here or
    loaded with --load): its `forward_only` takes groups of `ps.pp_size` micro-batches of
    `micro_batch_size` through the runner, the model in eval mode."""
    return Strategy(model, None, ps, build_runner(model, ps, task, seq_length=seq_length,
                                                  micro_batch_size=micro_batch_size, num_micro_batches=ps.pp_size,
                                                  bf16=bf16, fp16=fp16))


def build_strategy(model: torch.nn.Module, ps: ParallelState, run: "ResolvedRun", task: TrainingTask) -> Strategy:
    """How `run` updates `model`: DeepSpeed's strategy with --deepspeed, else ours."""
    t, ds_cfg = run.train, run.deepspeed_config

    def runner():
        return build_runner(model, ps, task, seq_length=run.seq_length, micro_batch_size=t.micro_batch_size,
                            num_micro_batches=run.batch.num_micro_batches, bf16=t.bf16, fp16=t.fp16)

    if ds_cfg is not None:
        # The one door to DeepSpeed: megabert.training.deepspeed wraps the model (and, for
        # ZeRO-Offload, builds its CPU optimizer) and, at PP=1, its own SequentialRunner.
        from megabert.training.deepspeed.strategy import build_deepspeed_strategy

        return build_deepspeed_strategy(model, ps, ds_cfg, run.optim, t, runner() if ps.pp_size > 1 else None,
                                        task)
    if run.parallel.use_distributed_optimizer:
        from megabert.training.distributed_optimizer_strategy import build_distributed_optimizer_strategy

        return build_distributed_optimizer_strategy(model, ps, run.optim, runner(),
                                                    bucket_elements=run.parallel.ddp_bucket_size,
                                                    overlap_param_gather=run.parallel.overlap_param_gather,
                                                    fp16=t.fp16, clip_grad=run.optim.clip_grad,
                                                    master_weights=t.bf16)
    # Ours, from the top down: the runner (replayed with --cuda-graphs) and the gradients'
    # reducer read no optimizer, so they come first; then the optimizer, its bf16 weight
    # copies and the loss scaler.
    params = [p for p in model.parameters() if p.requires_grad]
    step_runner = runner()
    if t.cuda_graphs:
        step_runner = graphed(model, ps, step_runner, params)
    reducer = None
    if ps.dp_size > 1 and run.parallel.overlap_grad_reduce:
        if t.cuda_graphs:
            if ps.is_logging_rank:
                logger.info("--cuda-graphs: the data-parallel gradient average runs after the replayed backward "
                            "(the overlapped reduction's hooks would not run in a replay)")
        else:
            reducer = OverlappedGradReducer(params, ps, run.parallel.ddp_bucket_size)
    optimizer = build_optimizer(model, run.optim, ps.tp_group)
    if t.bf16:
        # The linear layers' and the tied decoder's GEMMs take bf16 weights made once per
        # step, fp32 masters kept (megabert.training.precision.MasterWeights).
        master_weights = MasterWeights(model).attach(optimizer)
    else:
        master_weights = None
    scaler = DynamicLossScaler(run.optim) if t.fp16 else None
    return LocalStrategy(model, optimizer, ps, step_runner, scaler=scaler, clip_grad=run.optim.clip_grad,
                         reducer=reducer, master_weights=master_weights)


def graphed(model: torch.nn.Module, ps: ParallelState, runner: SequentialRunner, params: list) -> GraphedRunner:
    """--cuda-graphs (megabert.training.cuda_graphs): the runner replays a captured micro-batch;
    the model's RNG streams become graph-safe so that its dropout can be captured."""
    graphs = CudaGraphs(ps.device)
    model.rng.make_graph_safe()
    return GraphedRunner(runner, params, graphs, generators=model.rng.generators)


def build_trainer(model: torch.nn.Module, ps: ParallelState, run: "ResolvedRun", task: TrainingTask,
                  train_batches: Callable[[int], Iterator[dict]],
                  valid_batches: Optional[Callable[[], Iterator[dict]]] = None, *,
                  flops_per_sample: Optional[float] = None, checkpoint_extra: Optional[dict] = None) -> Trainer:
    """`run` trains `model` on `task` (its loss and metrics) at `run.seq_length`, from
    `run.start` (megabert.checkpoint.manager). `train_batches(consumed_samples)` gives the
    training batches from that point on, so a resumed run sees exactly the samples the
    interrupted one would have."""
    preloaded = preload_weights(run, model, ps)
    strategy = build_strategy(model, ps, run, task)
    checkpoint = build_checkpoint(strategy, run)
    state = checkpoint.resume(run.start, optim=run.optim, load_optim=run.train.load_optim, seq_length=run.seq_length,
                              preloaded=preloaded)
    return Trainer(strategy, Batches(train_batches(state.consumed_samples), valid_batches), run.train, run.batch,
                   LRSchedule(run.optim, run.train.train_iters), checkpoint=checkpoint, state=state,
                   flops_per_sample=flops_per_sample, checkpoint_extra=checkpoint_extra)


def build_checkpoint(strategy: Strategy, run: "ResolvedRun") -> CheckpointManager:
    """The checkpoint manager of what `build_strategy` made of `run`: its parts are the
    strategy's model and optimizer, as each kind of strategy keeps them."""
    if run.deepspeed_config is not None:
        from megabert.training.deepspeed.checkpoint import deepspeed_parts

        parts = deepspeed_parts(strategy)
    elif run.parallel.use_distributed_optimizer:
        from megabert.training.distributed_optimizer_strategy import distributed_optimizer_parts

        parts = distributed_optimizer_parts(strategy)
    else:
        parts = local_parts(strategy)
    return CheckpointManager(parts, strategy.ps)

