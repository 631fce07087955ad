"""Span extraction (SQuAD): start/end logits per token, as transformers'
BertForQuestionAnswering and ModernBertForQuestionAnswering, and their output."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megabert.config import ModelConfig
from megabert.model.bert import BertPreTrainedModel
from megabert.model.classifier import PredictionHeadTaskModel
from megabert.model.heads import head_linear
from megabert.model.outputs import ModelOutput
from megabert.parallel import ParallelState


class QuestionAnsweringOutput(ModelOutput):
    """loss; start_logits and end_logits [b, s]."""

    def __init__(self, *, loss, start_logits, end_logits):
        super().__init__(loss=loss, start_logits=start_logits, end_logits=end_logits)


class BertForQuestionAnswering(BertPreTrainedModel):
    """Span extraction (SQuAD): start/end logits per token, as transformers'."""

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        super().__init__(config, parallel_state, add_pooler=False, output_embeddings=False, **kwargs)
        self.qa_outputs = head_linear(self.ctx, 2, "qa_outputs.") if self.stage.is_last_stage else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, start_positions: Optional[torch.Tensor] = None,
                end_positions: Optional[torch.Tensor] = None,
                token_positions: Optional[torch.Tensor] = None) -> QuestionAnsweringOutput:
        return self._whole_model_forward(dict(input_ids=input_ids, token_type_ids=token_type_ids,
                                              attention_mask=attention_mask, start_positions=start_positions,
                                              end_positions=end_positions, token_positions=token_positions))

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> QuestionAnsweringOutput:
        logits = self.qa_outputs(sequence.transpose(0, 1))  # [b, s, 2]
        return span_output(logits, batch)


def span_output(logits: torch.Tensor, batch: dict) -> QuestionAnsweringOutput:
    """logits [b, s, 2] -> start/end logits and, with start/end positions, the mean of their
    cross entropies (transformers' question-answering loss)."""
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


class ModernBertForQuestionAnswering(PredictionHeadTaskModel):
    """Span extraction on ModernBERT, as transformers' ModernBertForQuestionAnswering: the
    final-normed hidden states -> the prediction head (dense, activation, norm) -> dropout ->
    a linear to 2 outputs (start, end)."""

    @staticmethod
    def outputs(config: ModelConfig) -> int:
        return 2  # start, end

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                start_positions: Optional[torch.Tensor] = None, end_positions: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None,
                token_positions: Optional[torch.Tensor] = None) -> QuestionAnsweringOutput:
        return self._whole_model_forward(dict(input_ids=input_ids, attention_mask=attention_mask,
                                              start_positions=start_positions, end_positions=end_positions,
                                              token_type_ids=token_type_ids, token_positions=token_positions))

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> QuestionAnsweringOutput:
        return span_output(self.classify(sequence.transpose(0, 1)), batch)  # logits [b, s, 2]

