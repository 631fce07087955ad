"""The task models: BERT for pre-training (masked LM + NSP/SOP) and for question answering."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megabert.config import ModelConfig
from megabert.model.bert import BertPreTrainedModel
from megabert.model.heads import MLMHead, head_linear
from megabert.model.outputs import BertPreTrainingOutput, QuestionAnsweringOutput
from megabert.parallel import ParallelState
from megabert.parallel.param_spec import describe
from megabert.tensor_parallel import vocab_parallel_cross_entropy


class BertForPreTraining(BertPreTrainedModel):
    """Masked LM + the sentence-pair head (NSP or SOP), as transformers' BertForPreTraining.

    forward(input_ids, token_type_ids, attention_mask, labels, next_sentence_label):
    labels are token ids at masked positions and -100 elsewhere. With
    `mlm_logits_at_masked_only` and labels, logits are computed only where labels != -100
    and `mlm_logits` is [n_masked, vocab]; without labels they are full [b, s, vocab].
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
                next_sentence_label: Optional[torch.Tensor] = None) -> BertPreTrainingOutput:
        return self._whole_model_forward(dict(input_ids=input_ids, token_type_ids=token_type_ids,
                                              attention_mask=attention_mask, labels=labels,
                                              next_sentence_label=next_sentence_label))

    def head(self, sequence: torch.Tensor, pooled: Optional[torch.Tensor], batch: dict) -> BertPreTrainingOutput:
        """MLM logits (tied to the word embeddings) and the sentence-pair head, with losses."""
        cfg, labels = self.config, batch.get("labels")
        next_sentence_label = batch.get("next_sentence_label") if self.binary_head is not None else None
        if next_sentence_label is not None:
            next_sentence_label = next_sentence_label.view(-1)  # [b, 1] is accepted too, as in transformers
        hidden, target = sequence.transpose(0, 1), labels  # [b, s, h]
        if cfg.mlm_logits_at_masked_only and labels is not None:
            selected = labels != -100
            hidden, target = hidden[selected], labels[selected]  # [n, h], [n]
        logits = self.lm_head(hidden, self.bert.word_embeddings)  # [..., V/tp]
        mlm_loss = None
        if target is not None:
            per_token = vocab_parallel_cross_entropy(logits, target, self.ctx.tp_group)
            mlm_loss = per_token.sum() / (target != -100).sum().clamp(min=1)
        nsp_logits = self.binary_head(pooled) if self.binary_head is not None else None
        nsp_loss = None
        if nsp_logits is not None and next_sentence_label is not None:
            nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label)
        parts = [x for x in (mlm_loss, nsp_loss) if x is not None]
        return BertPreTrainingOutput(loss=sum(parts) if parts else None, mlm_loss=mlm_loss, nsp_loss=nsp_loss,
                                     mlm_logits_parallel=logits, nsp_logits=nsp_logits, tp_group=self.ctx.tp_group,
                                     vocab_size=cfg.vocab_size, mlm_labels=target, nsp_labels=next_sentence_label)


class BertForQuestionAnswering(BertPreTrainedModel):
    """Span extraction (SQuAD): start/end logits per token, as transformers'."""

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        super().__init__(config, parallel_state, add_pooler=False, output_embeddings=False, **kwargs)
        self.qa_outputs = head_linear(self.ctx, 2, "qa_outputs.") if self.stage.is_last_stage else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, start_positions: Optional[torch.Tensor] = None,
                end_positions: Optional[torch.Tensor] = None) -> QuestionAnsweringOutput:
        return self._whole_model_forward(dict(input_ids=input_ids, token_type_ids=token_type_ids,
                                              attention_mask=attention_mask, start_positions=start_positions,
                                              end_positions=end_positions))

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> QuestionAnsweringOutput:
        logits = self.qa_outputs(sequence.transpose(0, 1))  # [b, s, 2]
        start_logits, end_logits = logits[..., 0].contiguous(), logits[..., 1].contiguous()
        start_positions, end_positions = batch.get("start_positions"), batch.get("end_positions")
        loss = None
        if start_positions is not None and end_positions is not None:
            # As transformers: positions outside the sequence are ignored, not errors.
            ignored = start_logits.size(1)
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = (F.cross_entropy(start_logits.float(), start, ignore_index=ignored)
                    + F.cross_entropy(end_logits.float(), end, ignore_index=ignored)) / 2
        return QuestionAnsweringOutput(loss=loss, start_logits=start_logits, end_logits=end_logits)
