"""What the training steps since the last logging step leave on the device.

Reading a device value into Python (.item(), .tolist(), float()) waits for every kernel
queued before it. Done once per step, it keeps the host from queueing step n+1 while step n
runs: on a GPU the device then idles while the host launches the next step's kernels, which
with CUDA graphs is most of the idle time left. So each step adds its losses, its gradient
norm and its skip flag here, as device tensors, and the trainer reads them once per logging
step (Trainer.flush_metrics): the losses as their mean over the interval's steps (Megatron's
logged loss), the last step's gradient norm, and how many steps were skipped.
"""
from __future__ import annotations

from typing import Optional

import torch

from megabert.training.strategy import Metrics, StepResult


class IntervalMetrics:
    """Device-side sums over the steps since the last `take()`; nothing here reads a value."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        # Steps that produced each loss (all of them on the last pipeline stage; a loss of
        # some steps only, such as the embedding task's loss per training file, is the mean
        # over those).
        self._loss_steps: dict[str, int] = {}
        self._nonfinite: Optional[torch.Tensor] = None
        self.steps = 0
        self.overflows = 0  # fp16 steps skipped for overflow (known on the host)
        self.last: Optional[StepResult] = None
        self.lr: Optional[float] = None

    def add(self, result: StepResult, lr: float) -> None:
        if result.metrics:
            for k in result.metrics[0]:
                # The step's loss is the mean over its micro-batches, as the update's gradient.
                mean = torch.stack([m[k].float() for m in result.metrics]).mean()
                self._sums[k] = self._sums[k] + mean if k in self._sums else mean
                self._loss_steps[k] = self._loss_steps.get(k, 0) + 1
        if result.nonfinite is not None:
            flag = result.nonfinite.reshape(())
            self._nonfinite = flag if self._nonfinite is None else self._nonfinite + flag
        self.steps += 1
        self.overflows += int(result.overflow)
        self.last, self.lr = result, lr

    def means(self) -> Metrics:
        """{loss name: its mean over the interval's steps}, on the device."""
        return {k: v / self._loss_steps[k] for k, v in self._sums.items()}

    def nonfinite_steps(self) -> int:
        """Steps whose update was skipped for a non-finite gradient norm (reads the count)."""
        return int(self._nonfinite.item()) if self._nonfinite is not None else 0
