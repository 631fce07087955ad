"""Model outputs. User-visible MLM logits are gathered over TP ranks on first access
only: training reads the loss and never pays for a [tokens, vocab] all-gather."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megabert.tensor_parallel import gather_from_tp


class BertPreTrainingOutput:
    def __init__(self, *, loss, mlm_loss, nsp_loss, mlm_logits_parallel, nsp_logits, tp_group, vocab_size):
        self.loss: Optional[torch.Tensor] = loss
        self.mlm_loss: Optional[torch.Tensor] = mlm_loss
        self.nsp_loss: Optional[torch.Tensor] = nsp_loss
        self.nsp_logits: Optional[torch.Tensor] = nsp_logits  # [b, 2]
        self.mlm_logits_parallel: torch.Tensor = mlm_logits_parallel  # [..., padded V / tp]
        self._tp_group, self._vocab_size = tp_group, vocab_size
        self._mlm_logits: Optional[torch.Tensor] = None

    @property
    def mlm_logits(self) -> torch.Tensor:
        """[b, s, vocab] (or [n_masked, vocab]): full vocab, padding columns removed."""
        if self._mlm_logits is None:
            full = gather_from_tp(self.mlm_logits_parallel, self._tp_group)
            self._mlm_logits = full[..., : self._vocab_size]
        return self._mlm_logits

    # NOTE: the sentence-pair logits are called nsp_logits whether the head was trained
    # for NSP or SOP: both are a 2-way classification of the [CLS] representation.
    @property
    def sop_logits(self) -> Optional[torch.Tensor]:
        return self.nsp_logits


@dataclass
class QuestionAnsweringOutput:
    loss: Optional[torch.Tensor]
    start_logits: torch.Tensor  # [b, s]
    end_logits: torch.Tensor  # [b, s]
