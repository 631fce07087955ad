"""BERT for sentence and sentence-pair classification (GLUE), as transformers'
BertForSequenceClassification: the pooler's tanh([CLS]) -> dropout -> linear to
config.num_labels outputs; cross entropy over the classes, or mean squared error with one
output (regression, STS-B)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megabert.config import ModelConfig
from megabert.model.bert import BertPreTrainedModel
from megabert.model.heads import head_linear
from megabert.model.outputs import ModelOutput
from megabert.model.registry import register_model
from megabert.parallel import ParallelState


class SequenceClassifierOutput(ModelOutput):
    """loss; logits [b, num_labels]."""

    def __init__(self, *, loss, logits):
        super().__init__(loss=loss, logits=logits)


@register_model
class BertForSequenceClassification(BertPreTrainedModel):
    """Sequence classification / regression on the pooled [CLS], as transformers'."""

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        super().__init__(config, parallel_state, add_pooler=True, output_embeddings=False, **kwargs)
        self.classifier = head_linear(self.ctx, config.num_labels, "classifier.") if self.stage.is_last_stage \
            else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> SequenceClassifierOutput:
        return self._whole_model_forward(dict(input_ids=input_ids, token_type_ids=token_type_ids,
                                              attention_mask=attention_mask, labels=labels))

    def head(self, sequence: torch.Tensor, pooled: torch.Tensor, batch: dict) -> SequenceClassifierOutput:
        # The pooled [CLS] is replicated over TP ranks and the dropout mask comes from the
        # default generator, seeded alike on every TP rank of a stage: the ranks agree.
        logits = self.classifier(F.dropout(pooled, self.config.hidden_dropout, self.training))  # [b, num_labels]
        labels = batch.get("labels")
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(logits.float().squeeze(-1), labels.float().view(-1))
            else:
                loss = F.cross_entropy(logits.float().view(-1, self.config.num_labels), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)
