"""What the classifier task models share. BertClassifier (GLUE's sequence classification, NER's
token classification): a linear of config.num_labels outputs on the last stage, one forward
that also takes packed rows, and one output (loss, loss_sum, logits). PredictionHeadTaskModel:
the families whose classifiers read a prediction head (dense, activation, norm) first
(ModernBERT's), as transformers' ModernBertFor{SequenceClassification,TokenClassification,
QuestionAnswering}. Each task model writes its `head`."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert.config import ModelConfig
from megabert.model.bert import BertPreTrainedModel
from megabert.model.context import BuildContext
from megabert.model.heads import head_linear
from megabert.model.mlp import ACTIVATIONS
from megabert.model.norm import norm_hf_names
from megabert.model.outputs import ModelOutput
from megabert.model.packed import cls_positions_mask, gather_cls
from megabert.parallel import ParallelState
from megabert.parallel.param_spec import describe, describe_module, set_hf_names


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
        self.classifier = (head_linear(self.ctx, config.num_labels, "classifier.") if self.stage.is_last_stage
                           else None)

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


class PredictionHead(nn.Module):
    """norm(act(dense(x))), replicated on the last stage (transformers' ModernBertPredictionHead);
    act(dense(x)) where the spec's head has no norm (EuroBERT's)."""

    def __init__(self, ctx: BuildContext):
        super().__init__()
        spec = ctx.spec.classifier
        h = ctx.spec.hidden_size
        self.dense = nn.Linear(h, h, bias=spec.dense_bias, dtype=ctx.params_dtype, device=ctx.device)
        describe(self.dense.weight)
        names = ("weight", "bias") if spec.dense_bias else ("weight",)
        if spec.dense_bias:
            describe(self.dense.bias, init="zeros", weight_decay=False)
        self.act = ACTIVATIONS[spec.activation]
        self.norm = ctx.norm(sequence_parallel=False) if spec.head_norm else nn.Identity()
        set_hf_names(self, {f"dense.{k}": v for k, v in ctx.spec.hf("classifier_dense").items() if k in names})
        set_hf_names(self, norm_hf_names("norm", self.norm, ctx.spec.hf("classifier_norm")))
        describe_module(self, placement="last")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


def classifier_linear(ctx: BuildContext, outputs: int) -> nn.Linear:
    """transformers' `classifier` of ModernBERT's task models: hidden -> `outputs`, replicated on
    the last stage, always with a bias (config.classifier_bias is the prediction head's dense)."""
    linear = nn.Linear(ctx.spec.hidden_size, outputs, dtype=ctx.params_dtype, device=ctx.device)
    describe(linear.weight, placement="last", hf_names=("classifier.weight",))
    describe(linear.bias, placement="last", init="zeros", weight_decay=False, hf_names=("classifier.bias",))
    return linear


def packed_mean(x: torch.Tensor, packed_seqlens: torch.Tensor) -> torch.Tensor:
    """x [b, s, h] of packed rows -> [b * cap, h]: each slot's mean over its sample's tokens
    (zeros for an empty slot)."""
    ends = packed_seqlens.cumsum(1)  # [b, cap]
    positions = torch.arange(x.size(1), device=x.device)
    slot = (positions[None, :, None] >= ends[:, None, :]).sum(-1)  # [b, s]: the sample slot, cap past them
    member = F.one_hot(slot, packed_seqlens.size(1) + 1)[..., :-1].to(x.dtype)  # [b, s, cap]
    sums = torch.einsum("bsc,bsh->bch", member, x)
    return (sums / packed_seqlens.clamp(min=1).unsqueeze(-1).to(x.dtype)).reshape(-1, x.size(-1))


class PredictionHeadTaskModel(BertPreTrainedModel):
    """What the pooling classifiers share, as transformers' ModernBertFor{SequenceClassification,
    TokenClassification,QuestionAnswering} and UltrabertForSequenceClassification: the backbone,
    then on the last stage the prediction head (dense, activation, norm) where the spec has one
    (ClassifierSpec.prediction_head) and a linear `classifier` of `outputs(config)` outputs. Each
    task model writes its forward and `head`."""

    @staticmethod
    def outputs(config: ModelConfig) -> int:
        return config.num_labels

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        super().__init__(config, parallel_state, add_pooler=False, output_embeddings=False, **kwargs)
        self.prediction_head = self.classifier = None
        if self.stage.is_last_stage:
            self.prediction_head = (PredictionHead(self.ctx) if self.ctx.spec.classifier.prediction_head
                                    else nn.Identity())
            self.classifier = classifier_linear(self.ctx, self.outputs(config))

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., h] -> the prediction head, dropout, the classifier -> [..., outputs]."""
        # Replicated over TP ranks, the dropout mask from the default generator: the ranks agree.
        return self.classifier(F.dropout(self.prediction_head(x), self.ctx.spec.classifier.dropout, self.training))


class EncoderForSequenceClassification(PredictionHeadTaskModel):
    """Sequence classification / regression on the pooled output ([CLS] or the mean, as
    ClassifierSpec.pooling), as transformers' ModernBERT's, UltraBERT's and EuroBERT's; or, with
    "late" pooling (EuroBERT's default), every token classified and the logits averaged."""

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, packed_seqlens: Optional[torch.Tensor] = None,
                token_positions: Optional[torch.Tensor] = None) -> ClassifierOutput:
        """Packed rows (megabert.data.packing): packed_seqlens [b, cap] and labels [b, cap]; the
        logits are then [b * cap, num_labels], one per slot (empty slots are left out of the loss)."""
        return self._whole_model_forward(dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                              token_type_ids=token_type_ids, position_ids=position_ids,
                                              packed_seqlens=packed_seqlens, token_positions=token_positions))

    def head_positions(self, batch: dict) -> Optional[torch.Tensor]:
        """[CLS] pooling reads each sample's first token alone (the last layer computes only
        those, unpadded)."""
        if self.ctx.spec.classifier.pooling != "cls" or batch.get("input_ids") is None:
            return None
        packed = batch.get("packed_seqlens")
        if packed is not None:
            return cls_positions_mask(packed, batch["input_ids"].size(1))
        positions = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        positions[:, 0] = True
        return positions

    def _pool(self, sequence: torch.Tensor, batch: dict) -> torch.Tensor:
        """sequence [s, b, h] -> [b, h] (or [b * cap, h] for packed rows): the [CLS] token, or
        the mean over the sample's real tokens, as ClassifierSpec.pooling says (any width h:
        late pooling averages logits)."""
        packed = batch.get("packed_seqlens")
        if self.ctx.spec.classifier.pooling == "cls":
            return sequence[0] if packed is None else gather_cls(sequence, packed)
        x = sequence.transpose(0, 1)  # [b, s, h]
        if packed is not None:
            return packed_mean(x, packed)
        am = batch.get("attention_mask")
        am = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if am is None else am.to(x.dtype)
        return (x * am.unsqueeze(-1)).sum(dim=1) / am.sum(dim=1, keepdim=True)

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> ClassifierOutput:
        if self.ctx.spec.classifier.pooling == "late":
            logits = self._pool(self.classify(sequence), batch)  # [s, b, num_labels] -> [b (* cap), num_labels]
        else:
            logits = self.classify(self._pool(sequence, batch))  # [b (* cap), num_labels]
        loss, loss_sum = sequence_loss(logits, batch, self.config.num_labels)
        return ClassifierOutput(loss=loss, logits=logits, loss_sum=loss_sum)


class ModernBertForSequenceClassification(EncoderForSequenceClassification):
    """EncoderForSequenceClassification under the class name ModernBERT checkpoints record."""
