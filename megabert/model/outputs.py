"""Model outputs: dicts with attribute access, as transformers' ModelOutput, so tools that
walk a module's outputs for tensors (DeepSpeed ZeRO-3's backward hooks, for one) find them.

User-visible MLM logits are gathered over TP ranks on first access only: training reads
the loss and never pays for a [tokens, vocab] all-gather.
"""
from __future__ import annotations

from typing import Optional

import torch

from megabert.tensor_parallel import gather_from_tp, vocab_parallel_argmax


class ModelOutput(dict):
    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}") from None


class BertPreTrainingOutput(ModelOutput):
    """loss, mlm_loss, nsp_loss; nsp_logits [b, 2]; mlm_logits_parallel [..., padded V / tp];
    mlm_logits [b, s, vocab] (or [n_masked, vocab]): full vocab, padding columns removed;
    mlm_predictions: the argmax of mlm_logits, without gathering them; mlm_labels and
    nsp_labels: the targets the losses were computed against (None without labels)."""

    def __init__(self, *, loss, mlm_loss, nsp_loss, mlm_logits_parallel, nsp_logits, tp_group, vocab_size,
                 mlm_labels: Optional[torch.Tensor] = None, nsp_labels: Optional[torch.Tensor] = None):
        super().__init__(loss=loss, mlm_loss=mlm_loss, nsp_loss=nsp_loss, nsp_logits=nsp_logits,
                         mlm_logits_parallel=mlm_logits_parallel)
        self._tp_group, self._vocab_size = tp_group, vocab_size
        # Kept off the dict: they are inputs handed back, not outputs for tools to walk.
        self._mlm_labels, self._nsp_labels = mlm_labels, nsp_labels
        self._mlm_logits: Optional[torch.Tensor] = None

    @property
    def mlm_logits(self) -> torch.Tensor:
        if self._mlm_logits is None:
            full = gather_from_tp(self["mlm_logits_parallel"], self._tp_group)
            self._mlm_logits = full[..., : self._vocab_size]
        return self._mlm_logits

    @property
    def mlm_predictions(self) -> torch.Tensor:
        """Predicted token ids [b, s] (or [n_masked]): the argmax over the full vocab, reduced
        over TP ranks instead of gathering [tokens, vocab] logits. Collective over TP."""
        return vocab_parallel_argmax(self["mlm_logits_parallel"], self._tp_group, self._vocab_size)

    @property
    def mlm_labels(self) -> Optional[torch.Tensor]:
        """Labels aligned with the rows of mlm_logits: [b, s] with -100 at unmasked positions,
        or [n_masked] when logits are computed only at masked positions."""
        return self._mlm_labels

    @property
    def nsp_labels(self) -> Optional[torch.Tensor]:
        """Sentence-pair labels [b] (0 = B follows A), when the binary head was given them."""
        return self._nsp_labels

    # NOTE: the sentence-pair logits are called nsp_logits whether the head was trained
    # for NSP or SOP: both are a 2-way classification of the [CLS] representation.
    @property
    def sop_logits(self) -> Optional[torch.Tensor]:
        return self["nsp_logits"]


class QuestionAnsweringOutput(ModelOutput):
    """loss; start_logits and end_logits [b, s]."""

    def __init__(self, *, loss, start_logits, end_logits):
        super().__init__(loss=loss, start_logits=start_logits, end_logits=end_logits)
