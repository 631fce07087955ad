"""Token classification (named entities), as transformers' BertForTokenClassification (every
position's final hidden state -> dropout -> linear to config.num_labels tag scores) and
ModernBertForTokenClassification (the final-normed hidden states -> the prediction head:
dense, activation, norm -> dropout -> linear); cross entropy over the labelled positions
(-100: none)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megabert.model.classifier import BertClassifier, ClassifierOutput, PredictionHeadTaskModel

IGNORE_INDEX = -100
"""A position without a label: padding, [CLS]/[SEP], a word's later sub-words."""


class TokenClassifierOutput(ClassifierOutput):
    """loss; loss_sum (over the labelled positions, the mean's numerator); logits [b, s, num_labels]."""


class BertForTokenClassification(BertClassifier):
    """A tag per token (NER), as transformers' (no pooler). Packed rows: the labels stay per
    token, -100 past a row's samples."""

    reads_pooler = False

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> TokenClassifierOutput:
        # The sequence is replicated over TP ranks (gathered after sequence parallelism) and
        # the dropout mask comes from the default generator, seeded alike on every TP rank of
        # a stage: the ranks agree.
        hidden = F.dropout(sequence.transpose(0, 1), self.config.hidden_dropout, self.training)  # [b, s, h]
        return token_output(self.classifier(hidden), batch, self.config.num_labels)


def token_output(logits: torch.Tensor, batch: dict, num_labels: int) -> TokenClassifierOutput:
    """logits [b, s, num_labels] -> the output, with the loss where the batch has labels."""
    labels = batch.get("labels")
    loss = loss_sum = None
    if labels is not None:
        # The mean over the labelled positions, as transformers'; a micro-batch with none
        # (a window inside one very long word) gives 0, not NaN. Training divides loss_sum
        # by the global batch's labelled positions instead (ner_task's global_loss).
        flat = labels.reshape(-1)
        loss_sum = F.cross_entropy(logits.float().reshape(-1, num_labels), flat, ignore_index=IGNORE_INDEX,
                                   reduction="sum")
        loss = loss_sum / (flat != IGNORE_INDEX).sum().clamp(min=1)
    return TokenClassifierOutput(loss=loss, logits=logits, loss_sum=loss_sum)


class ModernBertForTokenClassification(PredictionHeadTaskModel):
    """A tag per token on ModernBERT, as transformers' ModernBertForTokenClassification."""

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                packed_seqlens: Optional[torch.Tensor] = None,
                token_positions: Optional[torch.Tensor] = None) -> TokenClassifierOutput:
        """Packed rows as BertForTokenClassification's (each sample's RoPE positions from 0)."""
        return self._whole_model_forward(dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                              token_type_ids=token_type_ids, position_ids=position_ids,
                                              packed_seqlens=packed_seqlens, token_positions=token_positions))

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> TokenClassifierOutput:
        return token_output(self.classify(sequence.transpose(0, 1)), batch, self.config.num_labels)

