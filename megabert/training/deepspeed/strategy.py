"""DeepSpeed's strategy: the engine applies the update (ZeRO partitions over the
data-parallel group). Its checkpoints: megabert.training.deepspeed.checkpoint."""
from __future__ import annotations

from typing import Optional

import torch

from megabert.config import OptimConfig, TrainConfig
from megabert.optim import build_optimizer
from megabert.tensor_parallel.layers import use_linear
from megabert.training.deepspeed.ds_config import takes_memory_efficient_linear
from megabert.training.deepspeed.engine import initialize, reduce_gradients
from megabert.training.grads import grad_norm, sync_tied_embedding_grads
from megabert.training.strategy import SequentialRunner, StepResult, Strategy, TrainingTask


class DeepSpeedStrategy(Strategy):
    """DeepSpeed's engine applies the update (ZeRO 1/2/3 over the data-parallel group).
    Without pipelining our SequentialRunner takes the micro-batches through the engine and
    hands each loss to `engine.backward` and `engine.step` (a real step at the accumulation
    boundary only); with it, our schedule runs the micro-batches and ZeRO-1 takes the
    gradients after. `runner`: the pipeline schedule with PP > 1, else None."""

    def __init__(self, engine, ps, runner, task: TrainingTask, *, zero_stage: int, fp16: bool, bf16: bool):
        # NOTE: at PP=1 no autocast of ours: DeepSpeed's bf16/fp16 modes cast the module
        # itself, and its forward (training and evaluation alike) is the engine's.
        runner = runner or SequentialRunner(engine, task, backward=self._micro_batch_backward)
        super().__init__(engine.module, engine.optimizer, ps, runner)
        self.engine = engine
        self.zero_stage, self.fp16, self.bf16 = zero_stage, fp16, bf16
        self._own_norm: Optional[float] = None

    @property
    def lr_optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def module(self) -> torch.nn.Module:
        return self.engine

    def _micro_batch_backward(self, loss: torch.Tensor, is_last: bool) -> None:
        """The SequentialRunner's backward at PP=1: DeepSpeed scales the loss by
        1/gradient_accumulation_steps, reduces (ZeRO) and steps at the boundary."""
        self.engine.backward(loss)
        if is_last and self.zero_stage == 0 and not (self.fp16 or self.bf16):
            # DeepSpeed without ZeRO in fp32 clips but does not report the norm; the
            # reduced gradients are still in .grad after the boundary backward.
            self._own_norm = grad_norm(self.params, self.ps).item()
        self.engine.step()  # a real step only at the accumulation boundary

    def train_step(self, batches: list[dict]) -> StepResult:
        engine = self.engine
        skipped_before = engine.skipped_steps
        self._own_norm = None
        if self.ps.pp_size > 1:
            # The schedule runs backward itself; DeepSpeed reduces and steps afterwards.
            scale = float(engine.optimizer.loss_scale) if self.fp16 else 1.0  # fp16: DeepSpeed's loss-scaling wrapper
            metrics = self.runner.forward_backward(batches, scale)
            sync_tied_embedding_grads(self.params, self.ps)
            reduce_gradients(engine, self.zero_stage)
            engine.step()
        else:
            metrics = self.runner.forward_backward(batches)  # engine.backward + step per micro-batch
        # DeepSpeed reads its norm and overflow flag to the host itself, every step.
        norm = engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else (self._own_norm if self._own_norm is not None else float("nan"))
        scale = float(engine.optimizer.loss_scale) if self.fp16 else None
        return StepResult(metrics, torch.tensor(norm), overflow=engine.skipped_steps > skipped_before,
                          loss_scale=scale)

    def close(self) -> None:
        """Releases the engine (its hooks, ZeRO-3 partition state and comm buffers) before
        the process groups go away, so the process exits cleanly."""
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None


def build_deepspeed_strategy(model: torch.nn.Module, ps, ds_config: dict, optim: OptimConfig, train: TrainConfig,
                             runner, task: TrainingTask) -> DeepSpeedStrategy:
    """DeepSpeed's engine around `model` with our optimizer and the strategy that drives it.
    `runner`: the pipeline schedule with PP > 1, else None (a SequentialRunner through the engine).

    ZeRO-Offload steps with the same optimizer: DeepSpeed hands it the fp32 partitions on
    the CPU, which torch's fused AdamW kernel takes (vectorised and threaded, as fast as
    DeepSpeedCPUAdam: docs/performance.md), so no DeepSpeed op is compiled on first use."""
    optimizer = build_optimizer(model, optim, ps.tp_group)
    engine = initialize(model, optimizer, ds_config, ps)
    # The stage DeepSpeed runs: a --deepspeed_config may have chosen it.
    zero_stage = ds_config["zero_optimization"].get("stage", 0)
    if zero_stage == 3 and takes_memory_efficient_linear(ds_config):
        # NOTE: per layer, not DeepSpeed's process-wide swap of F.linear (engine_config turns that
        # off): a model built later in the process keeps torch's F.linear, whose bf16 output plus
        # fp32 bias rounds differently from DeepSpeed's in-place add (docs/performance.md).
        from deepspeed.runtime.zero.linear import zero3_linear_wrap  # after initialize's check that DeepSpeed is there

        use_linear(model, zero3_linear_wrap)
    return DeepSpeedStrategy(engine, ps, runner, task, zero_stage=zero_stage, fp16=train.fp16, bf16=train.bf16)
