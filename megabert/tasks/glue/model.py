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
    """loss; loss_sum (over the samples, the mean's numerator); logits [b, num_labels]
    ([b * cap, num_labels] for packed rows: one per slot)."""

    def __init__(self, *, loss, logits, loss_sum=None):
        super().__init__(loss=loss, logits=logits, loss_sum=loss_sum)


@register_model
class BertForSequenceClassification(BertPreTrainedModel):
    """Sequence classification / regression on the pooled [CLS], as transformers'."""

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        super().__init__(config, parallel_state, add_pooler=True, output_embeddings=False, **kwargs)
        self.classifier = head_linear(self.ctx, config.num_labels, "classifier.") if self.stage.is_last_stage \
            else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                packed_seqlens: Optional[torch.Tensor] = None) -> SequenceClassifierOutput:
        """Packed rows (megabert.data.packing): position_ids [b, s], packed_seqlens [b, cap] and
        labels [b, cap] (empty slots are left out of the loss)."""
        return self._whole_model_forward(dict(input_ids=input_ids, token_type_ids=token_type_ids,
                                              attention_mask=attention_mask, labels=labels, position_ids=position_ids,
                                              packed_seqlens=packed_seqlens))

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
