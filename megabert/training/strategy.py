"""How one optimizer step runs, behind one small interface.

A *runner* takes the micro-batches of one global batch through the model: one after
another (`SequentialRunner`, PP=1) or through pipeline stages (`PipelineSchedule`, 1F1B or
interleaved). A *strategy* turns the accumulated gradients into an update: ours
(`LocalStrategy`: explicit reductions, fp16 loss scaling, global-norm clipping, the
optimizer) or DeepSpeed's (megabert.training.deepspeed: ZeRO partitions). The Trainer only
calls `train_step` and `forward_only`; checkpoints are megabert.checkpoint.manager's, whose
parts megabert.training.checkpoint_state makes of a strategy's model and optimizer.
"""
from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import torch

from megabert.parallel import ParallelState
from megabert.data_parallel.averaging import average_data_parallel_grads
from megabert.data_parallel.grad_buckets import GradReducer
from megabert.optim.clip import guarded_step
from megabert.optim.grad_scaler import DynamicLossScaler
from megabert.training.grads import grad_norm, sync_sequence_parallel_grads, sync_tied_embedding_grads

if TYPE_CHECKING:
    from megabert.training.precision import MasterWeights

logger = logging.getLogger(__name__)
Metrics = dict[str, torch.Tensor]
Counts = dict[str, torch.Tensor]  # name -> int64 tensor([hits, total])
LOSS_SHARES = "loss_shares"  # see TrainingTask.loss_counts
T = TypeVar("T")


@dataclass(frozen=True)
class TrainingTask:
    """What the training loop knows of a task: which batch fields the model takes, how the
    model's output becomes (loss, {name: scalar tensor}) and, at evaluation only, which
    counts it adds (`output_counts`: {name: tensor([hits, total])}, reported as the ratio
    of their sums, e.g. accuracy). Pipeline stages get the whole batch and pick their
    fields themselves. A task package (megabert.tasks.*) makes one: pretraining_task(), or
    a fine-tuning task's (training.finetune.FinetuneTask) training_task()."""

    inputs: tuple[str, ...]
    output_loss: Callable[[Any], tuple[torch.Tensor, Metrics]]
    # Counts rather than ratios: a ratio per micro-batch cannot be averaged into the
    # ratio over the whole evaluation when micro-batches hold different numbers of items.
    output_counts: Optional[Callable[[Any], Counts]] = None
    # Losses that are means over items spread unevenly over micro-batches (masked tokens;
    # packed rows hold different numbers of samples), normalised over the whole global batch:
    # `loss_counts(batch)` is a micro-batch's item count per loss (a 1-D tensor); the trainer
    # sums them over the step's micro-batches and data-parallel ranks and hands each micro-batch
    # `batch[LOSS_SHARES]` = those totals / (micro-batches x dp_size) (the runners divide each
    # loss by the number of micro-batches, the gradient reduction averages over DP ranks);
    # `global_loss(output, shares)` -> (loss, metrics) divides the micro-batch's loss sums by
    # them. The step's loss is then the global batch's mean however its items are grouped.
    loss_counts: Optional[Callable[[dict], torch.Tensor]] = None
    global_loss: Optional[Callable[[Any, torch.Tensor], tuple[torch.Tensor, Metrics]]] = None
    # Fields of a logged metrics line that follow from the data position alone (pre-training's
    # mask_prob): `log_fields(consumed_samples)`, consumed_samples counted after the step.
    log_fields: Optional[Callable[[int], dict]] = None

    def __post_init__(self):
        if (self.loss_counts is None) != (self.global_loss is None):
            raise ValueError("TrainingTask: loss_counts and global_loss go together")

    def model_inputs(self, batch: dict) -> dict:
        return {k: batch[k] for k in self.inputs if k in batch}

    def train_loss(self, output, batch: dict) -> tuple[torch.Tensor, Metrics]:
        """(loss, metrics) of one training micro-batch's output."""
        if self.global_loss is not None and LOSS_SHARES in batch:
            return self.global_loss(output, batch[LOSS_SHARES])
        return self.output_loss(output)

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, Metrics]:
        return self.train_loss(model(**self.model_inputs(batch)), batch)

    def eval_metrics(self, output) -> tuple[Metrics, Counts]:
        """Evaluation: (the losses of `output_loss`, the counts of `output_counts`)."""
        counts = self.output_counts(output) if self.output_counts is not None else {}
        return self.output_loss(output)[1], counts


def mean_loss_task(name: str, inputs: tuple[str, ...], count: Callable[[dict], torch.Tensor]) -> TrainingTask:
    """A task with one loss, a mean over items (`count(batch)`: a micro-batch's number of them,
    a 0-d tensor): in training its output's `loss_sum` over the whole global batch's count
    (TrainingTask.loss_counts), logged as `name`."""

    def global_loss(out, shares: torch.Tensor):
        loss = out.loss_sum / shares[0]
        return loss, {name: loss}

    return TrainingTask(inputs=inputs, output_loss=lambda out: (out.loss, {name: out.loss}),
                loss_counts=lambda batch: count(batch).reshape(1), global_loss=global_loss)


def _detached(metrics: Metrics) -> Metrics:
    return {k: v.detach() for k, v in metrics.items()}


# backward(loss, is_last): what one micro-batch's loss goes through after its forward.
Backward = Callable[[torch.Tensor, bool], None]


class SequentialRunner:
    """PP=1: micro-batches one after another through the whole model. By default each
    loss goes through autograd and .grad accumulates; a strategy whose update happens per
    micro-batch hands its own `backward` (megabert.training.deepspeed's)."""

    keeps_grads = False  # the strategy sets .grad to None before a step (CUDA graphs' runner keeps them)

    def __init__(self, module, task: TrainingTask, autocast: Callable[[], AbstractContextManager] = nullcontext,
                 backward: Optional[Backward] = None):
        self.module, self.task, self.autocast, self.backward = module, task, autocast, backward

    def forward_backward(self, batches: list[dict], loss_scale: float = 1.0) -> list[Metrics]:
        metrics = []
        for i, batch in enumerate(batches):
            with self.autocast():
                loss, m = self.task.loss(self.module, batch)
            if self.backward is not None:
                self.backward(loss, i == len(batches) - 1)
            else:
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
    """One optimizer step, as the device left it: nothing here has been read to the host, so
    the trainer can queue the next step before this one finishes (it reads them on logging
    steps: megabert.training.step_metrics)."""

    metrics: list[Metrics]  # per micro-batch (empty on pipeline stages without the loss)
    grad_norm: Optional[torch.Tensor]  # 0-d; None when an fp16 overflow skipped the step first
    # fp16: the gradients overflowed, the step was skipped and the scale lowered (the host knows:
    # the LR schedule waits for such steps, as Megatron's).
    overflow: bool = False
    # 0-d, 1.0 where the gradient norm was not finite and the update was skipped
    # (megabert.optim.clip.guarded_step); None where the strategy reports no such flag.
    nonfinite: Optional[torch.Tensor] = None
    loss_scale: Optional[float] = None


class Strategy:
    """Shared by every strategy: the model, its optimizer, the runner; stepping and precision
    (--bf16's GEMM copies) only. What a checkpoint holds of them is
    megabert.training.checkpoint_state's."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ps: ParallelState, runner, *,
                 scaler: Optional[DynamicLossScaler] = None, master_weights: Optional["MasterWeights"] = None):
        self.model, self.optimizer, self.ps, self.runner = model, optimizer, ps, runner
        self.scaler = scaler
        self.master_weights = master_weights  # --bf16's GEMM copies (megabert.training.precision)
        self.params = [p for p in model.parameters() if p.requires_grad]

    @property
    def lr_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose param groups carry the learning rate."""
        return self.optimizer

    def train_step(self, batches: list[dict]) -> StepResult:
        raise NotImplementedError

    @property
    def module(self) -> torch.nn.Module:
        """What the runner calls: the model, or the wrapper a strategy puts around it."""
        return self.model

    def fresh_gemm_copies(self) -> None:
        """Before the model runs: --bf16's GEMM copies of masters written since (a checkpoint
        load) are remade; compiled layers cannot check that themselves."""
        if self.master_weights is not None:
            self.master_weights.refresh_stale()

    def forward_only(self, batches: list[dict], output_fn: Callable[[Any], T]) -> list[T]:
        self.fresh_gemm_copies()
        self.module.eval()
        try:
            return self.runner.forward_only(batches, output_fn)
        finally:
            self.module.train()

    def settle(self) -> None:
        """Collective, when training ends: completes what the last step left in flight, so
        that what runs next (predictions, an export) reads the final weights and issues no
        collective of the step's."""

    def close(self) -> None:
        """Releases what the strategy holds before the process groups go away."""


class LocalStrategy(Strategy):
    """Our own update: explicit gradient reductions once per global batch, fp16 loss
    scaling with overflow skips, global-norm clipping, then the optimizer. In bf16 and fp32
    with torch's fused AdamW (the default) the step reads nothing to the host; fp16's
    overflow check and the foreach optimizers' non-finite check read one flag."""

    def __init__(self, model, optimizer, ps, runner, *, scaler: Optional[DynamicLossScaler], clip_grad: float,
                 reducer: Optional[GradReducer] = None, master_weights: Optional["MasterWeights"] = None):
        super().__init__(model, optimizer, ps, runner, scaler=scaler, master_weights=master_weights)
        self.clip_grad = clip_grad
        self.reducer = reducer  # None: DP gradients averaged after backward (DP = 1, --no-overlap-grad-reduce)

    def train_step(self, batches: list[dict]) -> StepResult:
        self.fresh_gemm_copies()
        scale = self.scaler.scale if self.scaler else 1.0
        if self.reducer is not None:
            self.reducer.start(len(batches))
            metrics = self.runner.forward_backward(batches, scale)
            self.reducer.finish()  # the DP average, issued during the last micro-batch's backward
        else:
            if self.runner.keeps_grads:
                self.runner.zero_grads()  # CUDA graphs write into the run's .grad buffers
            else:
                self.optimizer.zero_grad(set_to_none=True)
            metrics = self.runner.forward_backward(batches, scale)
            average_data_parallel_grads(self.params, self.ps)
        # Sums over TP and over the embedding group, once per global batch; they commute
        # with the DP average.
        sync_sequence_parallel_grads(self.params, self.ps)
        sync_tied_embedding_grads(self.params, self.ps)
        return self._update(self.params, metrics, scale)

    def _update(self, tensors: list[torch.Tensor], metrics: list[Metrics], scale: float, *,
                dp_sharded: bool = False) -> StepResult:
        """fp16's overflow check and unscaling, the global norm, the clipped step of `tensors`'
        gradients (this rank's shards where `dp_sharded`), skipped where the norm is not finite."""
        loss_scale = scale if self.scaler is not None else None
        if self.scaler is not None:
            if self.scaler.found_overflow(tensors, self.ps.device):  # fp16's one host read
                self.scaler.update(overflow=True)
                self.optimizer.zero_grad(set_to_none=True)
                return StepResult(metrics, None, overflow=True, loss_scale=loss_scale)
            self.scaler.unscale_(tensors)
        norm = grad_norm(tensors, self.ps, dp_sharded=dp_sharded)
        # A NaN/inf gradient (bf16 and fp32 have no scaler to absorb it) skips the update
        # rather than writing NaN weights; fused AdamW decides on the device.
        nonfinite = guarded_step(self.optimizer, tensors, self.clip_grad, norm)
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return StepResult(metrics, norm, nonfinite=nonfinite, loss_scale=loss_scale)

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.close()
