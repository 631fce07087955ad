"""The masked-LM task model of every family (transformers' *ForMaskedLM): the encoder, its
MLM head, and the output. `ModernBertForMaskedLM` is its name in checkpoints written before
the families shared one tree."""
from __future__ import annotations

from typing import Optional

import torch

from megabert.config import ModelConfig
from megabert.families import encoder_spec
from megabert.model.bert import BertPreTrainedModel
from megabert.model.heads import MLMHead
from megabert.model.outputs import MLMLogitsOutput
from megabert.model.packed import gather_flat
from megabert.parallel import ParallelState
from megabert.parallel.param_spec import describe


class MaskedLMOutput(MLMLogitsOutput):
    """loss; logits [b, s, vocab] (or [n_masked, vocab] with logits at masked positions only):
    the full vocab gathered over TP on first access, padding columns removed;
    logits_parallel [..., padded V / tp]; predictions: the argmax without gathering; labels:
    the targets the loss was computed against."""

    logits_key = "logits_parallel"

    def __init__(self, *, loss, logits_parallel, tp_group, vocab_size, labels=None, loss_sum=None):
        # mlm_loss_sum: the numerator the trainer divides by the global batch's masked tokens
        # (pretraining_task); an entry, not an attribute, as BertPreTrainingOutput's.
        super().__init__(loss=loss, mlm_loss=loss, mlm_loss_sum=loss_sum, nsp_loss_sum=None)
        self._keep_logits(logits_parallel, tp_group, vocab_size)
        self._labels = labels

    # transformers' names; the mlm_* ones are BERT's pre-training output's, so the pre-training
    # task reads either model.
    logits_parallel = MLMLogitsOutput.mlm_logits_parallel
    logits = MLMLogitsOutput.mlm_logits
    predictions = MLMLogitsOutput.mlm_predictions

    @property
    def labels(self) -> Optional[torch.Tensor]:
        return self._labels

    mlm_labels = labels
    nsp_loss = None
    nsp_logits = None
    nsp_labels = None


class EncoderForMaskedLM(BertPreTrainedModel):
    """Any family's encoder with its masked-LM head, as transformers' *ForMaskedLM.

    forward(input_ids, attention_mask, labels) -> MaskedLMOutput: `logits` [b, s, vocab]
    (the config's vocab_size), and with labels (token ids at masked positions, -100
    elsewhere) the mean cross entropy `loss`. With `mlm_logits_at_masked_only` and labels,
    logits are computed at the masked positions alone ([n_masked, vocab])."""

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        tied = encoder_spec(config).mlm_head.tied
        super().__init__(config, parallel_state, add_pooler=False, output_embeddings=tied, **kwargs)
        if self.bert.embeddings is not None and tied:
            describe(self.bert.word_embeddings, placement="tied")  # the decoder's weight too
        self.lm_head = (MLMHead(self.ctx, self.padded_vocab_size, self.parallel_state.tp_rank)
                        if self.stage.is_last_stage else None)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, packed_seqlens: Optional[torch.Tensor] = None,
                mlm_flat_positions: Optional[torch.Tensor] = None,
                token_positions: Optional[torch.Tensor] = None) -> MaskedLMOutput:
        """Packed rows (megabert.data.packing): packed_seqlens [b, cap] (and position_ids [b, s],
        each sample's from 0); labels stay per token. Unpacked rows may carry, from the host, the
        masked positions (`mlm_flat_positions` [n], row x s + column) and the real tokens'
        (`token_positions` [T]): the head and the unpadded encoder then select by index, with no
        nonzero() on the device (megabert.tasks.pretraining.task.pretraining_batches)."""
        return self._whole_model_forward(dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                              token_type_ids=token_type_ids, position_ids=position_ids,
                                              packed_seqlens=packed_seqlens, mlm_flat_positions=mlm_flat_positions,
                                              token_positions=token_positions))

    def _decoder_weight(self) -> torch.Tensor:
        return self.lm_head.decoder_weight(self.bert.word_embeddings if self.bert.embeddings is not None else None)

    def head_positions(self, batch: dict) -> Optional[torch.Tensor]:
        labels = batch.get("labels")
        if not self.config.mlm_logits_at_masked_only or labels is None:
            return None
        given = batch.get("mlm_flat_positions")
        return given if given is not None and batch.get("packed_seqlens") is None else labels != -100

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> MaskedLMOutput:
        labels, given = batch.get("labels"), batch.get("mlm_flat_positions")
        hidden, target = sequence.transpose(0, 1), labels  # [b, s, h]
        if self.config.mlm_logits_at_masked_only and labels is not None:
            if given is not None and batch.get("packed_seqlens") is None:
                hidden, target = gather_flat(sequence, labels, given)  # [n, h], [n] by index
            else:
                selected = labels != -100
                hidden, target = hidden[selected], labels[selected]  # [n, h], [n]
        loss = loss_sum = None
        if target is not None:
            logits, per_token = self.lm_head.logits_and_loss(hidden, self._decoder_weight(), target)
            loss_sum = per_token.sum()
            loss = loss_sum / (target != -100).sum().clamp(min=1)
        else:
            logits = self.lm_head.logits(self.lm_head.transform(hidden), self._decoder_weight())
        return MaskedLMOutput(loss=loss, logits_parallel=logits, tp_group=self.ctx.tp_group,
                              vocab_size=self.config.vocab_size, labels=target, loss_sum=loss_sum)


# transformers' name: the masked LM of whichever family a directory's config.json names.
AutoModelForMaskedLM = EncoderForMaskedLM


class ModernBertForMaskedLM(EncoderForMaskedLM):
    """EncoderForMaskedLM under the class name ModernBERT checkpoints record."""
