"""How one optimizer step runs, behind one small interface.

A *runner* takes the micro-batches of one global batch through the model: one after
another (`SequentialRunner`, PP=1) or through pipeline stages (`PipelineSchedule`, 1F1B or
interleaved). A *strategy* turns the accumulated gradients into an update: ours
(`LocalStrategy`: explicit reductions, fp16 loss scaling, global-norm clipping, the
optimizer) or DeepSpeed's engine (`DeepSpeedStrategy`: ZeRO partitions). The Trainer only
calls `train_step`, `forward_only`, `save` and `load`.
"""
from __future__ import annotations

import logging
import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch

from megabert.parallel import ParallelState
from megabert.training import deepspeed_engine
from megabert.training.checkpointing import LoadedCheckpoint, TrainingState, load_checkpoint, save_checkpoint
from megabert.training.grads import (average_data_parallel_grads, clip_grads, grad_norm,
                                     sync_sequence_parallel_grads, sync_tied_embedding_grads)
from megabert.training.precision import DynamicLossScaler

logger = logging.getLogger(__name__)
Metrics = dict[str, torch.Tensor]
Counts = dict[str, torch.Tensor]  # name -> int64 tensor([hits, total])
T = TypeVar("T")


@dataclass(frozen=True)
class Task:
    """What the training loop knows of a task: which batch fields the model takes, how the
    model's output becomes (loss, {name: scalar tensor}) and, at evaluation only, which
    counts it adds (`output_counts`: {name: tensor([hits, total])}, reported as the ratio
    of their sums, e.g. accuracy). Pipeline stages get the whole batch and pick their
    fields themselves."""

    inputs: tuple[str, ...]
    output_loss: Callable[[Any], tuple[torch.Tensor, Metrics]]
    # Counts rather than ratios: a ratio per micro-batch cannot be averaged into the
    # ratio over the whole evaluation when micro-batches hold different numbers of items.
    output_counts: Optional[Callable[[Any], Counts]] = None

    def model_inputs(self, batch: dict) -> dict:
        return {k: batch[k] for k in self.inputs if k in batch}

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, Metrics]:
        return self.output_loss(model(**self.model_inputs(batch)))

    def eval_metrics(self, output) -> tuple[Metrics, Counts]:
        """Evaluation: (the losses of `output_loss`, the counts of `output_counts`)."""
        counts = self.output_counts(output) if self.output_counts is not None else {}
        return self.output_loss(output)[1], counts


def _detached(metrics: Metrics) -> Metrics:
    return {k: v.detach() for k, v in metrics.items()}


class SequentialRunner:
    """PP=1: micro-batches one after another through the whole model; .grad accumulates."""

    def __init__(self, module, task: Task, autocast: Callable[[], AbstractContextManager] = nullcontext):
        self.module, self.task, self.autocast = module, task, autocast

    def forward_backward(self, batches: list[dict], loss_scale: float = 1.0) -> list[Metrics]:
        metrics = []
        for batch in batches:
            with self.autocast():
                loss, m = self.task.loss(self.module, batch)
            # Each micro-batch loss is a mean; dividing by their number makes the
            # accumulated gradient the mean over the global batch.
            (loss * (loss_scale / len(batches))).backward()
            metrics.append(_detached(m))
        return metrics

    @torch.no_grad()
    def forward_only(self, batches: list[dict], output_fn: Callable[[Any], T]) -> list[T]:
        out = []
        for batch in batches:
            with self.autocast():
                out.append(output_fn(self.module(**self.task.model_inputs(batch))))
        return out


@dataclass
class StepResult:
    metrics: list[Metrics]  # per micro-batch (empty on pipeline stages without the loss)
    grad_norm: float
    skipped: bool = False
    loss_scale: Optional[float] = None


class Strategy:
    """Shared by both strategies: the model, its optimizer, the runner, checkpoints."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ps: ParallelState, runner, *,
                 scaler: Optional[DynamicLossScaler] = None, engine=None):
        self.model, self.optimizer, self.ps, self.runner = model, optimizer, ps, runner
        self.scaler, self.engine = scaler, engine
        self.params = [p for p in model.parameters() if p.requires_grad]

    @property
    def lr_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose param groups carry the learning rate."""
        return self.engine.optimizer if self.engine is not None else self.optimizer

    def train_step(self, batches: list[dict]) -> StepResult:
        raise NotImplementedError

    def forward_only(self, batches: list[dict], output_fn: Callable[[Any], T]) -> list[T]:
        module = self.engine if self.engine is not None else self.model
        module.eval()
        try:
            return self.runner.forward_only(batches, output_fn)
        finally:
            module.train()

    def save(self, root: str, state: TrainingState, *, extra: dict, keep_last: Optional[int]) -> None:
        save_checkpoint(root, state, self.model, self.optimizer, self.ps, scaler=self.scaler, extra=extra,
                        keep_last=keep_last, engine=self.engine)

    def load(self, path: str, *, load_optimizer: bool, load_model: bool = True) -> LoadedCheckpoint:
        return load_checkpoint(path, self.model, self.optimizer, self.ps, scaler=self.scaler, engine=self.engine,
                               load_optimizer=load_optimizer, load_model=load_model)

    def close(self) -> None:
        """Releases the DeepSpeed engine (its hooks, ZeRO-3 partition state and comm
        buffers) before the process groups go away, so the process exits cleanly."""
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None


class LocalStrategy(Strategy):
    """Our own update: explicit gradient reductions once per global batch, fp16 loss
    scaling with overflow skips, global-norm clipping, then the optimizer. One host sync
    per step (the norm), however many parameters."""

    def __init__(self, model, optimizer, ps, runner, *, scaler: Optional[DynamicLossScaler], clip_grad: float):
        super().__init__(model, optimizer, ps, runner, scaler=scaler)
        self.clip_grad = clip_grad

    def train_step(self, batches: list[dict]) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        scale = self.scaler.scale if self.scaler else 1.0
        metrics = self.runner.forward_backward(batches, scale)
        # Gradient sync is explicit: once per global batch, after all micro-batches.
        sync_sequence_parallel_grads(self.params, self.ps)
        sync_tied_embedding_grads(self.params, self.ps)
        average_data_parallel_grads(self.params, self.ps)
        if self.scaler is not None:
            if self.scaler.found_overflow(self.params, self.ps.device):
                self.scaler.update(overflow=True)
                self.optimizer.zero_grad(set_to_none=True)
                return StepResult(metrics, float("nan"), skipped=True, loss_scale=scale)
            self.scaler.unscale_(self.params)
        norm = grad_norm(self.params, self.ps)
        norm_value = norm.item()
        if not math.isfinite(norm_value):
            # bf16/fp32 have no scaler to absorb this: skip rather than write NaN weights.
            logger.warning("gradient norm is %s; step skipped", norm_value)
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(metrics, norm_value, skipped=True, loss_scale=scale if self.scaler else None)
        clip_grads(self.params, self.clip_grad, norm)
        self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return StepResult(metrics, norm_value, loss_scale=scale if self.scaler else None)


class DeepSpeedStrategy(Strategy):
    """DeepSpeed's engine applies the update (ZeRO 1/2/3 over the data-parallel group).
    Without pipelining the engine runs forward, backward and its accumulation boundary;
    with it, our schedule runs the micro-batches and ZeRO-1 takes the gradients after."""

    def __init__(self, engine, ps, runner, *, zero_stage: int, fp16: bool, bf16: bool):
        super().__init__(engine.module, engine.optimizer, ps, runner, engine=engine)
        self.zero_stage, self.fp16, self.bf16 = zero_stage, fp16, bf16

    def train_step(self, batches: list[dict]) -> StepResult:
        engine = self.engine
        skipped_before = getattr(engine, "skipped_steps", 0)
        own_norm = None
        if self.ps.pp_size > 1:
            # The schedule runs backward itself; DeepSpeed reduces and steps afterwards.
            scale = float(getattr(engine.optimizer, "loss_scale", 1.0)) if self.fp16 else 1.0
            metrics = self.runner.forward_backward(batches, scale)
            sync_tied_embedding_grads(self.params, self.ps)
            deepspeed_engine.reduce_gradients(engine, self.zero_stage)
            engine.step()
        else:
            metrics = []
            task = self.runner.task
            for i, batch in enumerate(batches):
                loss, m = task.loss(engine, batch)
                engine.backward(loss)  # scaled by 1/gradient_accumulation_steps inside
                if i == len(batches) - 1 and self.zero_stage == 0 and not (self.fp16 or self.bf16):
                    # DeepSpeed without ZeRO in fp32 clips but does not report the norm; the
                    # reduced gradients are still in .grad after the boundary backward.
                    own_norm = grad_norm(self.params, self.ps).item()
                engine.step()  # a real step only at the accumulation boundary
                metrics.append(_detached(m))
        norm = engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else (own_norm if own_norm is not None else float("nan"))
        scale = float(getattr(engine.optimizer, "loss_scale", float("nan"))) if self.fp16 else None
        return StepResult(metrics, norm, skipped=getattr(engine, "skipped_steps", 0) > skipped_before, loss_scale=scale)
