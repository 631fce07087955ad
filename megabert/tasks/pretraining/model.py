"""BERT for pre-training: masked LM + the sentence-pair head (NSP or SOP), as transformers'
BertForPreTraining, and its output. User-visible MLM logits are gathered over TP ranks on
first access only: training reads the loss and never pays for a [tokens, vocab] all-gather."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from megabert.config import ModelConfig
from megabert.model.bert import BertPreTrainedModel
from megabert.model.heads import MLMHead, head_linear
from megabert.model.outputs import MLMLogitsOutput
from megabert.model.packed import (cls_positions_mask, fixed_shape_packing, flat_head_positions, gather_flat,
                                   gather_labelled, head_positions)
from megabert.parallel import ParallelState
from megabert.parallel.param_spec import describe


class BertPreTrainingOutput(MLMLogitsOutput):
    """loss, mlm_loss, nsp_loss; mlm_loss_sum, nsp_loss_sum: the cross entropy summed over the
    masked tokens and over the samples (the means' numerators: the trainer divides them by the
    whole global batch's counts, pretraining_task); nsp_logits [b, 2]; mlm_logits_parallel [..., padded V / tp];
    mlm_logits [b, s, vocab] (or [n_masked, vocab]): full vocab, padding columns removed;
    mlm_predictions: the argmax of mlm_logits, without gathering them; mlm_labels and
    nsp_labels: the targets the losses were computed against (None without labels)."""

    def __init__(self, *, loss, mlm_loss, nsp_loss,
                 mlm_logits_parallel: Union[torch.Tensor, Callable[[], torch.Tensor]], nsp_logits, tp_group,
                 vocab_size, mlm_labels: Optional[torch.Tensor] = None, nsp_labels: Optional[torch.Tensor] = None,
                 mlm_loss_sum=None, nsp_loss_sum=None):
        """`mlm_logits_parallel`: the tensor, or a function that makes it on first access
        (MLMLogitsOutput)."""
        # The loss sums are entries (not attributes): DeepSpeed's ZeRO-3 hooks the tensors of a
        # module's output to gather its parameters again for backward.
        super().__init__(loss=loss, mlm_loss=mlm_loss, nsp_loss=nsp_loss, nsp_logits=nsp_logits,
                         mlm_loss_sum=mlm_loss_sum, nsp_loss_sum=nsp_loss_sum)
        self._keep_logits(mlm_logits_parallel, tp_group, vocab_size)
        # Kept off the dict: they are inputs handed back, not outputs for tools to walk.
        self._mlm_labels, self._nsp_labels = mlm_labels, nsp_labels

    @property
    def mlm_labels(self) -> Optional[torch.Tensor]:
        """Labels aligned with the rows of mlm_logits: [b, s] with -100 at unmasked positions,
        or [n_masked] when logits are computed only at masked positions."""
        return self._mlm_labels

    @property
    def nsp_labels(self) -> Optional[torch.Tensor]:
        """Sentence-pair labels [b] (0 = B follows A), when the binary head was given them;
        [b * cap] for packed rows, -100 in empty slots."""
        return self._nsp_labels

    # NOTE: the sentence-pair logits are called nsp_logits whether the head was trained
    # for NSP or SOP: both are a 2-way classification of the [CLS] representation.
    @property
    def sop_logits(self) -> Optional[torch.Tensor]:
        return self["nsp_logits"]


class BertForPreTraining(BertPreTrainedModel):
    """Masked LM + the sentence-pair head (NSP or SOP), as transformers' BertForPreTraining.

    forward(input_ids, token_type_ids, attention_mask, labels, next_sentence_label):
    labels are token ids at masked positions and -100 elsewhere. Packed rows
    (megabert.data.packing) add position_ids [b, s] and packed_seqlens [b, cap], and take
    next_sentence_label [b, cap] (-100 in empty slots); nsp_logits are then [b * cap, 2]. With
    `mlm_logits_at_masked_only` and labels, logits are computed only where labels != -100
    and `mlm_logits` is [n_masked, vocab]; without labels they are full [b, s, vocab]. No bool
    mask need select them (a nonzero(): a host sync on a GPU): pretrain_bert.py's batches carry
    the masked positions, computed on the host. Packed rows with `mlm_positions` [b, slots]
    (each row's masked positions, -1 in empty slots: megabert.data.packing.label_positions)
    compute them at those slots: `mlm_logits` is [b * slots, vocab], `mlm_labels` -100 in empty
    slots, and no shape depends on the data. Unpacked rows with `mlm_flat_positions` [n_masked]
    (row x s + column of each: megabert.data.packing.flat_label_positions) compute exactly the
    bool mask's rows, in its order.
    """

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        super().__init__(config, parallel_state, add_pooler=config.bert_binary_head, output_embeddings=True, **kwargs)
        if self.bert.embeddings is not None:
            # The MLM projection is tied to the word embeddings: with pipeline stages the
            # first and the last stage each hold a copy, kept equal by summing gradients.
            describe(self.bert.word_embeddings, placement="tied")
        self.lm_head = self.binary_head = None
        if self.stage.is_last_stage:
            self.lm_head = MLMHead(self.ctx, self.padded_vocab_size, self.parallel_state.tp_rank)
            if config.bert_binary_head:
                self.binary_head = head_linear(self.ctx, 2, "cls.seq_relationship.")

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                next_sentence_label: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                packed_seqlens: Optional[torch.Tensor] = None,
                mlm_positions: Optional[torch.Tensor] = None,
                mlm_flat_positions: Optional[torch.Tensor] = None,
                token_positions: Optional[torch.Tensor] = None) -> BertPreTrainingOutput:
        return self._whole_model_forward(dict(input_ids=input_ids, token_type_ids=token_type_ids,
                                              attention_mask=attention_mask, labels=labels,
                                              next_sentence_label=next_sentence_label, position_ids=position_ids,
                                              packed_seqlens=packed_seqlens, mlm_positions=mlm_positions,
                                              mlm_flat_positions=mlm_flat_positions,
                                              token_positions=token_positions))

    def _given_positions(self, batch: dict) -> Optional[torch.Tensor]:
        """The masked positions the batch gives, where the head reads the masked LM at them (logits
        at masked positions only, labels given): packed rows' mlm_positions [b, slots], unpacked
        rows' mlm_flat_positions [n]; else None."""
        if not self.config.mlm_logits_at_masked_only or batch.get("labels") is None:
            return None
        return batch.get("mlm_positions" if batch.get("packed_seqlens") is not None else "mlm_flat_positions")

    def head_positions(self, batch: dict) -> Optional[torch.Tensor]:
        """With logits at masked positions only: those positions and [CLS] (the pooler's), with no
        nonzero() where the batch gives them: for packed rows on the fixed-shape path with
        mlm_positions, int64 [b, k] positions of each row (a fixed k: head_positions); for
        unpacked rows with mlm_flat_positions, int64 [b + n] of row x s + column
        (flat_head_positions)."""
        labels = batch.get("labels")
        if not self.config.mlm_logits_at_masked_only or labels is None:
            return None
        given, packed = self._given_positions(batch), batch.get("packed_seqlens")
        if given is not None and packed is None:
            return flat_head_positions(given, labels, cls=self.bert.pooler is not None)
        if given is not None and fixed_shape_packing(labels.device, self.config.unpad_input):
            return head_positions(packed, given, labels.size(1))
        positions = labels != -100
        if self.bert.pooler is not None:
            if packed is not None:
                positions = positions | cls_positions_mask(packed, labels.size(1))  # each sample's [CLS]
            else:
                positions[:, 0] = True
        return positions

    def head(self, sequence: torch.Tensor, pooled: Optional[torch.Tensor], batch: dict) -> BertPreTrainingOutput:
        """MLM logits (tied to the word embeddings) and the sentence-pair head, with losses."""
        cfg, labels = self.config, batch.get("labels")
        next_sentence_label = batch.get("next_sentence_label") if self.binary_head is not None else None
        if next_sentence_label is not None:
            next_sentence_label = next_sentence_label.view(-1)  # [b, 1] is accepted too, as in transformers
        hidden, target = sequence.transpose(0, 1), labels  # [b, s, h]
        given = self._given_positions(batch)
        if given is not None and batch.get("packed_seqlens") is not None:
            hidden, target = gather_labelled(sequence, labels, given)  # [b * slots, h], [b * slots]
        elif given is not None:
            hidden, target = gather_flat(sequence, labels, given)  # [n, h], [n]
        elif cfg.mlm_logits_at_masked_only and labels is not None:
            selected = labels != -100
            hidden, target = hidden[selected], labels[selected]  # [n, h], [n]
        mlm_loss = mlm_sum = None
        if target is not None:
            # logits: made on first access ([..., V/tp]); training reads only the loss.
            logits, per_token = self.lm_head.logits_and_loss(hidden, self.bert.word_embeddings, target)
            mlm_sum = per_token.sum()
            mlm_loss = mlm_sum / (target != -100).sum().clamp(min=1)
        else:
            logits = self.lm_head(hidden, self.bert.word_embeddings)
        nsp_logits = self.binary_head(pooled) if self.binary_head is not None else None
        nsp_loss = nsp_sum = None
        if nsp_logits is not None and next_sentence_label is not None:
            # -100: an empty slot of a packed row
            nsp_sum = F.cross_entropy(nsp_logits.float(), next_sentence_label, reduction="sum")
            nsp_loss = nsp_sum / (next_sentence_label != -100).sum().clamp(min=1)
        parts = [x for x in (mlm_loss, nsp_loss) if x is not None]
        return BertPreTrainingOutput(loss=sum(parts) if parts else None, mlm_loss=mlm_loss, nsp_loss=nsp_loss,
                                     mlm_logits_parallel=logits, nsp_logits=nsp_logits, tp_group=self.ctx.tp_group,
                                     vocab_size=cfg.vocab_size, mlm_labels=target, nsp_labels=next_sentence_label,
                                     mlm_loss_sum=mlm_sum, nsp_loss_sum=nsp_sum)
