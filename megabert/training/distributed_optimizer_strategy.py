"""The training step with the distributed optimizer (--use-distributed-optimizer): LocalStrategy's
update, with the reductions, the loss scaler, the norm and the clipping acting on this rank's
shards. The sharded buffers and the optimizer over their pieces are megabert.data_parallel's
(sharded_buffers, distributed_optimizer); this module only orders them inside one step.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from megabert.checkpoint.manager import CheckpointParts
from megabert.checkpoint.run_state import RNGStreams
from megabert.config import OptimConfig
from megabert.data_parallel.distributed_optimizer import DistributedOptimizer
from megabert.data_parallel.sharded_buffers import ShardedBuffers
from megabert.parallel import ParallelState
from megabert.parallel.param_spec import spec_of
from megabert.optim.grad_scaler import DynamicLossScaler
from megabert.training.grads import sync_sequence_parallel_grads, sync_tied_embedding_grads
from megabert.training.checkpoint_state import ModelWeights
from megabert.training.precision import MasterWeights
from megabert.training.strategy import LocalStrategy, StepResult

logger = logging.getLogger(__name__)


class DistributedOptimizerStrategy(LocalStrategy):
    """LocalStrategy's update with the distributed optimizer: the reductions, the loss
    scaler, the norm and the clipping act on this rank's shards (the pieces)."""

    def __init__(self, model, dist_opt: DistributedOptimizer, ps, runner, *, scaler: Optional[DynamicLossScaler],
                 clip_grad: float, master_weights: Optional[MasterWeights] = None):
        super().__init__(model, dist_opt.optimizer, ps, runner, scaler=scaler, clip_grad=clip_grad,
                         reducer=dist_opt.buffers, master_weights=master_weights)
        self.dist_opt = dist_opt
        self.buffers: ShardedBuffers = dist_opt.buffers  # the reducer, with the parameter all-gathers too

    def train_step(self, batches: list[dict]) -> StepResult:
        buffers, pieces, ps = self.buffers, self.dist_opt.tensors, self.ps
        self.fresh_gemm_copies()
        scale = self.scaler.scale if self.scaler else 1.0
        buffers.start(len(batches))
        metrics = self.runner.forward_backward(batches, scale)
        buffers.finish()  # the reduce-scatters, issued during the last micro-batch's backward
        # The shards of the sums over TP and over the embedding group: every TP rank and
        # both embedding stages lay their buffers out alike, so shard i is the same
        # elements on each.
        sync_sequence_parallel_grads(pieces, ps)
        sync_tied_embedding_grads(pieces, ps)
        result = self._update(pieces, metrics, scale, dp_sharded=True)
        if not result.overflow:
            buffers.gather_params()  # with --overlap-param-gather, waited for by the next forward
        return result

    def forward_only(self, batches, output_fn):
        self.buffers.wait_params()
        return super().forward_only(batches, output_fn)

    def settle(self) -> None:
        # The last step's parameter all-gathers are otherwise issued as forward waits for
        # them: a rank with no batch to predict would leave the others waiting.
        self.buffers.wait_params()


def distributed_optimizer_parts(strategy: DistributedOptimizerStrategy) -> CheckpointParts:
    """What its checkpoints hold: the weights once the last step's all-gathers landed, and the
    distributed optimizer's states by name (gathered over DP at save time, on every rank)."""
    model = strategy.model
    return CheckpointParts(model=ModelWeights(model, strategy.ps, before_read=strategy.buffers.wait_params),
                           rng=RNGStreams(model.rng), optimizer=strategy.dist_opt, scaler=strategy.scaler)


def build_distributed_optimizer_strategy(model: torch.nn.Module, ps: ParallelState, cfg: OptimConfig, runner, *,
                                         bucket_elements: int, overlap_param_gather: bool, fp16: bool,
                                         clip_grad: float, master_weights: bool = False
                                         ) -> DistributedOptimizerStrategy:
    """`master_weights` (--bf16): the GEMMs take bf16 copies of the fp32 parameters
    (megabert.training.precision.MasterWeights), remade as each bucket's all-gather lands."""
    params = [p for p in model.parameters() if p.requires_grad]
    # The pipeline's tied word embeddings get a bucket of their own: the first and the last
    # stage then shard them alike and can sum their shards over the embedding group.
    isolate = (lambda p: spec_of(p).placement == "tied") if ps.pp_size > 1 else (lambda p: False)
    buffers = ShardedBuffers(params, ps, bucket_elements, isolate=isolate, overlap_param_gather=overlap_param_gather)
    buffers.install_forward_hooks(model)
    if master_weights:
        # Made once the parameters live in the buffers. The optimizer steps views of the
        # buffers and the all-gathers write them, which bumps no parameter's version (the
        # lazy check in gemm_weight would miss them): the copies are remade per bucket as
        # its gather is waited for, whether at the end of the step or in forward
        # (--overlap-param-gather), so DistributedOptimizerStrategy.train_step needs nothing.
        copies = MasterWeights(model).attach_gathers(buffers)
    dist_opt = DistributedOptimizer(model, cfg, ps, buffers)
    scaler = DynamicLossScaler(cfg) if fp16 else None
    return DistributedOptimizerStrategy(model, dist_opt, ps, runner, scaler=scaler, clip_grad=clip_grad,
                                        master_weights=copies if master_weights else None)
