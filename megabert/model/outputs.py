"""Model outputs: dicts with attribute access, as transformers' ModelOutput, so tools that
walk a module's outputs for tensors (an engine's backward hooks that gather partitioned
parameters, for one) find them.
Each task's output subclasses it in its own package (megabert.tasks.*.model)."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from megabert.tensor_parallel import gather_from_tp, vocab_parallel_argmax


class ModelOutput(dict):
    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}") from None


class MLMLogitsOutput(ModelOutput):
    """An output holding the MLM head's logits as the vocab-parallel GEMM leaves them.

    mlm_logits_parallel [..., padded V / tp]: this TP rank's columns, the entry `logits_key`
    names; given as a function, made on first access (the fused MLM loss keeps its logits in
    pieces: a training step never reads them whole). mlm_logits: the full vocab gathered over
    TP on first access, padding columns removed. mlm_predictions: their argmax, reduced over
    the TP ranks instead of gathering [tokens, vocab] logits. Both collective over TP."""

    logits_key = "mlm_logits_parallel"

    def _keep_logits(self, logits_parallel: Union[torch.Tensor, Callable[[], torch.Tensor]], tp_group,
                     vocab_size: int) -> None:
        self._make_logits = logits_parallel if callable(logits_parallel) else None
        if self._make_logits is None:
            self[self.logits_key] = logits_parallel
        self._tp_group, self._vocab_size = tp_group, vocab_size
        self._gathered_logits: Optional[torch.Tensor] = None

    @property
    def mlm_logits_parallel(self) -> torch.Tensor:
        if self.logits_key not in self:
            self[self.logits_key] = self._make_logits()
        return self[self.logits_key]

    @property
    def mlm_logits(self) -> torch.Tensor:
        if self._gathered_logits is None:
            self._gathered_logits = gather_from_tp(self.mlm_logits_parallel, self._tp_group)[..., : self._vocab_size]
        return self._gathered_logits

    @property
    def mlm_predictions(self) -> torch.Tensor:
        """Predicted token ids [b, s] (or [n_masked])."""
        return vocab_parallel_argmax(self.mlm_logits_parallel, self._tp_group, self._vocab_size)
