"""ModernBERT for sequence classification, as transformers' ModernBertForSequenceClassification:
the last hidden states pooled (the [CLS] token, or the mean over real tokens, as
config.classifier_pooling says) -> the prediction head (dense, activation, norm) -> dropout
-> a linear classifier to config.num_labels outputs; cross entropy over the classes, or mean
squared error with one output (regression)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert.config import ModelConfig
from megabert.model.bert import BertPreTrainedModel
from megabert.model.context import BuildContext
from megabert.model.modernbert.layers import ACTIVATIONS
from megabert.model.modernbert.model import ModernBertBackbone, ModernBertForMaskedLM
from megabert.model.outputs import ModelOutput
from megabert.model.registry import register_model
from megabert.parallel import ParallelState
from megabert.parallel.param_spec import describe, describe_module, set_hf_names


class ModernBertPredictionHead(nn.Module):
    """norm(act(dense(x))), replicated on the last stage (transformers' ModernBertPredictionHead)."""

    def __init__(self, ctx: BuildContext, hf_prefix: str):
        super().__init__()
        cfg = ctx.config
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias, dtype=ctx.params_dtype,
                               device=ctx.device)
        describe(self.dense.weight)
        names = ("weight", "bias") if cfg.classifier_bias else ("weight",)
        if cfg.classifier_bias:
            describe(self.dense.bias, init="zeros", weight_decay=False)
        self.act = ACTIVATIONS[cfg.classifier_activation]
        self.norm = ctx.layer_norm(sequence_parallel=False, bias=cfg.norm_bias)
        set_hf_names(self, {f"dense.{k}": f"{hf_prefix}dense.{k}" for k in names})
        set_hf_names(self, {f"norm.{k}": f"{hf_prefix}norm.{k}" for k in
                            (("weight", "bias") if cfg.norm_bias else ("weight",))})
        describe_module(self, placement="last")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class SequenceClassifierOutput(ModelOutput):
    """loss; loss_sum (over the samples, the mean's numerator: the fine-tuning task divides it
    by the global batch's samples); logits [b, num_labels]."""

    def __init__(self, *, loss, logits, loss_sum=None):
        super().__init__(loss=loss, logits=logits, loss_sum=loss_sum)


@register_model
class ModernBertForSequenceClassification(BertPreTrainedModel):
    """Sequence classification / regression on ModernBERT's pooled output, as transformers'."""

    backbone_class = ModernBertBackbone

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        if config.model_family != "modernbert":
            raise ValueError(f"ModernBertForSequenceClassification needs a ModernBERT config, got "
                             f"{config.model_family!r}")
        super().__init__(config, parallel_state, add_pooler=False, output_embeddings=False, **kwargs)
        self.prediction_head = self.classifier = None
        if self.stage.is_last_stage:
            self.prediction_head = ModernBertPredictionHead(self.ctx, "head.")
            # transformers' classifier always has a bias (classifier_bias is the head's dense).
            self.classifier = nn.Linear(config.hidden_size, config.num_labels, dtype=self.ctx.params_dtype,
                                        device=self.ctx.device)
            describe(self.classifier.weight, placement="last", hf_names=("classifier.weight",))
            describe(self.classifier.bias, placement="last", init="zeros", weight_decay=False,
                     hf_names=("classifier.bias",))

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None
                ) -> SequenceClassifierOutput:
        return self._whole_model_forward(dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                              token_type_ids=token_type_ids))

    def head_positions(self, batch: dict) -> Optional[torch.Tensor]:
        """[CLS] pooling reads position 0 alone (the last layer computes only it, unpadded)."""
        if self.config.classifier_pooling != "cls" or batch.get("input_ids") is None:
            return None
        positions = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        positions[:, 0] = True
        return positions

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> SequenceClassifierOutput:
        x = sequence.transpose(0, 1)  # [b, s, h]
        if self.config.classifier_pooling == "cls":
            x = x[:, 0]
        else:
            am = batch.get("attention_mask")
            am = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if am is None else am.to(x.dtype)
            x = (x * am.unsqueeze(-1)).sum(dim=1) / am.sum(dim=1, keepdim=True)
        # Replicated over TP ranks, the dropout mask from the default generator: the ranks agree.
        x = F.dropout(self.prediction_head(x), self.config.classifier_dropout, self.training)
        logits = self.classifier(x)  # [b, num_labels]
        labels = batch.get("labels")
        loss = loss_sum = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss_sum = F.mse_loss(logits.float().squeeze(-1), labels.float().view(-1), reduction="sum")
            else:
                loss_sum = F.cross_entropy(logits.float().view(-1, self.config.num_labels), labels.view(-1),
                                           reduction="sum")
            loss = loss_sum / labels.numel()
        return SequenceClassifierOutput(loss=loss, logits=logits, loss_sum=loss_sum)

    initialize_parameters = ModernBertForMaskedLM.initialize_parameters

