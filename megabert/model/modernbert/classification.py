"""ModernBERT for sequence classification, as transformers' ModernBertForSequenceClassification:
the last hidden states pooled (the [CLS] token, or the mean over real tokens, as
config.classifier_pooling says) -> the prediction head (dense, activation, norm) -> dropout
-> a linear classifier to config.num_labels outputs; cross entropy over the classes, or mean
squared error with one output (regression). Packed rows pool each sample on its own."""
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
from megabert.model.classifier import ClassifierOutput, sequence_loss
from megabert.model.packed import cls_positions_mask, gather_cls
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


def classifier_linear(ctx: BuildContext, outputs: int) -> nn.Linear:
    """transformers' `classifier` of ModernBERT's task models: hidden -> `outputs`, replicated on
    the last stage, always with a bias (config.classifier_bias is the prediction head's dense)."""
    linear = nn.Linear(ctx.config.hidden_size, outputs, dtype=ctx.params_dtype, device=ctx.device)
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


class ModernBertTaskModel(BertPreTrainedModel):
    """What ModernBERT's task models share, as transformers' ModernBertFor{SequenceClassification,
    TokenClassification,QuestionAnswering}: the backbone, then on the last stage the prediction
    head (dense, activation, norm) and a linear `classifier` of `outputs(config)` outputs; the
    initialisation of ModernBertForMaskedLM. Each task model writes its forward and `head`."""

    backbone_class = ModernBertBackbone

    @staticmethod
    def outputs(config: ModelConfig) -> int:
        return config.num_labels

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        if config.model_family != "modernbert":
            raise ValueError(f"{type(self).__name__} needs a ModernBERT config, got {config.model_family!r}")
        super().__init__(config, parallel_state, add_pooler=False, output_embeddings=False, **kwargs)
        self.prediction_head = self.classifier = None
        if self.stage.is_last_stage:
            self.prediction_head = ModernBertPredictionHead(self.ctx, "head.")
            self.classifier = classifier_linear(self.ctx, self.outputs(config))

    initialize_parameters = ModernBertForMaskedLM.initialize_parameters


@register_model
class ModernBertForSequenceClassification(ModernBertTaskModel):
    """Sequence classification / regression on ModernBERT's pooled output, as transformers'."""

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
        if self.config.classifier_pooling != "cls" or batch.get("input_ids") is None:
            return None
        packed = batch.get("packed_seqlens")
        if packed is not None:
            return cls_positions_mask(packed, batch["input_ids"].size(1))
        positions = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        positions[:, 0] = True
        return positions

    def _pool(self, sequence: torch.Tensor, batch: dict) -> torch.Tensor:
        """sequence [s, b, h] -> [b, h] (or [b * cap, h] for packed rows): the [CLS] token, or
        the mean over the sample's real tokens, as config.classifier_pooling says."""
        packed = batch.get("packed_seqlens")
        if self.config.classifier_pooling == "cls":
            return sequence[0] if packed is None else gather_cls(sequence, packed)
        x = sequence.transpose(0, 1)  # [b, s, h]
        if packed is not None:
            return packed_mean(x, packed)
        am = batch.get("attention_mask")
        am = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if am is None else am.to(x.dtype)
        return (x * am.unsqueeze(-1)).sum(dim=1) / am.sum(dim=1, keepdim=True)

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> ClassifierOutput:
        # Replicated over TP ranks, the dropout mask from the default generator: the ranks agree.
        x = F.dropout(self.prediction_head(self._pool(sequence, batch)), self.config.classifier_dropout,
                      self.training)
        logits = self.classifier(x)  # [b (* cap), num_labels]
        loss, loss_sum = sequence_loss(logits, batch, self.config.num_labels)
        return ClassifierOutput(loss=loss, logits=logits, loss_sum=loss_sum)
