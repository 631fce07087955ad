"""BERT for sentence and sentence-pair classification (GLUE), as transformers'
BertForSequenceClassification: the pooler's tanh([CLS]) -> dropout -> linear to
config.num_labels outputs; cross entropy over the classes, or mean squared error with one
output (regression, STS-B)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megabert.model.classifier import BertClassifier, ClassifierOutput, sequence_loss


class SequenceClassifierOutput(ClassifierOutput):
    """loss; loss_sum (over the samples, the mean's numerator); logits [b, num_labels]
    ([b * cap, num_labels] for packed rows: one per slot)."""


class BertForSequenceClassification(BertClassifier):
    """Sequence classification / regression on the pooled [CLS], as transformers'. Packed rows:
    labels [b, cap], one per slot (empty slots are left out of the loss)."""

    reads_pooler = True

    def head(self, sequence: torch.Tensor, pooled: torch.Tensor, batch: dict) -> SequenceClassifierOutput:
        # The pooled [CLS] is replicated over TP ranks and the dropout mask comes from the
        # default generator, seeded alike on every TP rank of a stage: the ranks agree.
        logits = self.classifier(F.dropout(pooled, self.config.hidden_dropout, self.training))  # [b, num_labels]
        loss, loss_sum = sequence_loss(logits, batch, self.config.num_labels)
        return SequenceClassifierOutput(loss=loss, logits=logits, loss_sum=loss_sum)
