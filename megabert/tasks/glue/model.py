"""BERT for sentence and sentence-pair classification (GLUE), as transformers'
BertForSequenceClassification: the pooler's tanh([CLS]) -> dropout -> linear to
config.num_labels outputs; cross entropy over the classes, or mean squared error with one
output (regression, STS-B)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megabert.model.classifier import BertClassifier, ClassifierOutput
from megabert.model.registry import register_model


class SequenceClassifierOutput(ClassifierOutput):
    """loss; loss_sum (over the samples, the mean's numerator); logits [b, num_labels]
    ([b * cap, num_labels] for packed rows: one per slot)."""


@register_model
class BertForSequenceClassification(BertClassifier):
    """Sequence classification / regression on the pooled [CLS], as transformers'. Packed rows:
    labels [b, cap], one per slot (empty slots are left out of the loss)."""

    reads_pooler = True

    def head(self, sequence: torch.Tensor, pooled: torch.Tensor, batch: dict) -> SequenceClassifierOutput:
        # The pooled [CLS] is replicated over TP ranks and the dropout mask comes from the
        # default generator, seeded alike on every TP rank of a stage: the ranks agree.
        logits = self.classifier(F.dropout(pooled, self.config.hidden_dropout, self.training))  # [b, num_labels]
        labels = batch.get("labels")
        loss = loss_sum = None
        if labels is not None:
            labels = labels.reshape(-1)
            if self.config.num_labels == 1:
                per_sample = F.mse_loss(logits.float().squeeze(-1), labels.float(), reduction="none")
            else:
                per_sample = F.cross_entropy(logits.float().view(-1, self.config.num_labels),
                                             labels.long().clamp(min=0), reduction="none")
            packed = batch.get("packed_seqlens")
            if packed is not None:  # an empty slot of a packed row has no sample
                real = packed.reshape(-1) > 0
                per_sample, count = per_sample * real, real.sum()
            else:
                count = torch.tensor(labels.numel(), device=labels.device)
            loss_sum = per_sample.sum()
            loss = loss_sum / count.clamp(min=1)
        return SequenceClassifierOutput(loss=loss, logits=logits, loss_sum=loss_sum)
