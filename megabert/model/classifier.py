"""What BERT's classifier task models share (GLUE's sequence classification, NER's token
classification): a linear of config.num_labels outputs on the last stage, one forward that also
takes packed rows, and one output (loss, loss_sum, logits). Each task model writes its `head`."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megabert.config import ModelConfig
from megabert.model.bert import BertPreTrainedModel
from megabert.model.heads import head_linear
from megabert.model.outputs import ModelOutput
from megabert.parallel import ParallelState


class ClassifierOutput(ModelOutput):
    """loss (the mean over the micro-batch's labelled items); loss_sum (its numerator: training
    divides it by the global batch's count instead); logits."""

    def __init__(self, *, loss, logits, loss_sum=None):
        super().__init__(loss=loss, logits=logits, loss_sum=loss_sum)


def sequence_loss(logits: torch.Tensor, batch: dict, num_labels: int
                  ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(loss, loss_sum) of a sequence classifier's logits [b (* cap), num_labels] against
    batch["labels"]: cross entropy over the classes, or mean squared error with one output
    (regression); packed rows (batch["packed_seqlens"]) leave their empty slots out. (None,
    None) without labels."""
    labels = batch.get("labels")
    if labels is None:
        return None, None
    labels = labels.reshape(-1)
    if num_labels == 1:
        per_sample = F.mse_loss(logits.float().squeeze(-1), labels.float(), reduction="none")
    else:
        per_sample = F.cross_entropy(logits.float().view(-1, num_labels), labels.long().clamp(min=0),
                                     reduction="none")
    packed = batch.get("packed_seqlens")
    if packed is not None:  # an empty slot of a packed row has no sample
        real = packed.reshape(-1) > 0
        per_sample = per_sample * real
        loss_sum = per_sample.sum()
        return loss_sum / real.sum().clamp(min=1), loss_sum
    loss_sum = per_sample.sum()
    # The count as a Python number: a tensor made from it on the host would be a copy from
    # pageable memory, which waits for the device to drain first.
    return loss_sum / max(labels.numel(), 1), loss_sum


class BertClassifier(BertPreTrainedModel):
    """BERT -> `classifier` (transformers' name, config.num_labels outputs). A subclass says
    whether its head reads the pooled [CLS] (`reads_pooler`) and writes `head`."""

    reads_pooler: bool

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        super().__init__(config, parallel_state, add_pooler=self.reads_pooler, output_embeddings=False, **kwargs)
        self.classifier = head_linear(self.ctx, config.num_labels, "classifier.") if self.stage.is_last_stage \
            else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                packed_seqlens: Optional[torch.Tensor] = None,
                token_positions: Optional[torch.Tensor] = None) -> ClassifierOutput:
        """Packed rows (megabert.data.packing): position_ids [b, s] (each sample's from 0) and
        packed_seqlens [b, cap]; labels as the subclass's head reads them. token_positions: the
        real tokens' flat positions from the host (megabert.model.unpad.TokenLayout)."""
        return self._whole_model_forward(dict(input_ids=input_ids, token_type_ids=token_type_ids,
                                              attention_mask=attention_mask, labels=labels, position_ids=position_ids,
                                              packed_seqlens=packed_seqlens, token_positions=token_positions))
