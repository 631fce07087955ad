"""BERT, BERT for pre-training (MLM + NSP/SOP) and BERT for question answering.

Reads like single-device BERT: the parallel layers are drop-in building blocks and
the process groups come from the ParallelState handed to the constructor. Activations
are [s, b, h] inside the encoder (Megatron's layout, so sequence parallelism splits
dim 0); inputs and outputs are batch-first as in transformers.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert.config import ModelConfig, ParallelConfig, validate_layout
from megabert.errors import ConfigError
from megabert.model.context import BuildContext
from megabert.model.embeddings import BertEmbeddings
from megabert.model.heads import MLMHead, Pooler, _linear
from megabert.model.outputs import BertPreTrainingOutput, QuestionAnsweringOutput
from megabert.model.pretrained import PretrainedMixin
from megabert.model.transformer import TransformerBlock
from megabert.ops import resolve_attention_backend, resolve_layernorm_backend
from megabert.parallel import ParallelState, get_parallel_state
from megabert.tensor_parallel import gather_from_sp_to_replicated, vocab_parallel_cross_entropy
from megabert.tensor_parallel.random import TP_SEED_OFFSET, TP_STREAM, RNGStatesTracker


def attention_mask_to_bool(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """transformers' convention (1 = token, 0 = padding), [b, s] or [b, sq, sk], to the
    kernels' bool mask (True = masked out) broadcastable to [b, heads, sq, sk]."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return (attention_mask == 0)[:, None, None, :]
    if attention_mask.dim() == 3:
        return (attention_mask == 0)[:, None, :, :]
    if attention_mask.dim() == 4:
        return attention_mask == 0
    raise ValueError(f"attention_mask must be [b, s], [b, sq, sk] or [b, 1, sq, sk], got {tuple(attention_mask.shape)}")


def build_context(config: ModelConfig, ps: ParallelState, seed: int, params_dtype: torch.dtype,
                  device: Optional[torch.device | str]) -> BuildContext:
    """The shared build context of one rank's model (or pipeline stage)."""
    device = torch.device(device) if device is not None else ps.device
    rng = RNGStatesTracker(device)
    # Per TP rank (independent dropout in split regions) and per pipeline stage (stages
    # hold different layers, which should not share dropout masks).
    rng.add(TP_STREAM, seed + TP_SEED_OFFSET + ps.tp_rank + 100 * ps.pp_rank)
    return BuildContext(config=config, tp_group=ps.tp_group, tp_size=ps.tp_size, seed=seed, rng=rng,
                        attention_backend=resolve_attention_backend(config.attention_backend, device.type),
                        layernorm_backend=resolve_layernorm_backend(config.layernorm_backend, device.type),
                        params_dtype=params_dtype, device=device)


def pretraining_heads(config: ModelConfig, ps: ParallelState, sequence: torch.Tensor, pooled: Optional[torch.Tensor],
                      lm_head: MLMHead, word_embeddings: torch.Tensor, binary_head: Optional[nn.Linear],
                      labels: Optional[torch.Tensor], next_sentence_label: Optional[torch.Tensor]
                      ) -> BertPreTrainingOutput:
    """MLM logits (tied to the word embeddings) and the sentence-pair head, with losses.
    `sequence` is the encoder output [s, b, h] gathered over sequence-parallel ranks."""
    hidden = sequence.transpose(0, 1)  # [b, s, h]
    target = labels
    if config.mlm_logits_at_masked_only:
        if labels is None:
            raise ValueError("mlm_logits_at_masked_only needs labels to know the masked positions")
        selected = labels != -100
        hidden, target = hidden[selected], labels[selected]  # [n, h], [n]
    logits = lm_head(hidden, word_embeddings)  # [..., V/tp]

    mlm_loss = None
    if target is not None:
        per_token = vocab_parallel_cross_entropy(logits, target, ps.tp_group)
        mlm_loss = per_token.sum() / (target != -100).sum().clamp(min=1)
    nsp_logits = binary_head(pooled) if binary_head is not None else None
    nsp_loss = None
    if nsp_logits is not None and next_sentence_label is not None:
        nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label.view(-1))
    parts = [x for x in (mlm_loss, nsp_loss) if x is not None]
    return BertPreTrainingOutput(loss=sum(parts) if parts else None, mlm_loss=mlm_loss, nsp_loss=nsp_loss,
                                 mlm_logits_parallel=logits, nsp_logits=nsp_logits, tp_group=ps.tp_group,
                                 vocab_size=config.vocab_size)


class BertModel(nn.Module):
    """Embeddings + transformer encoder (+ pooler). Returns [s, b, h] and the pooled [b, h]."""

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, *, seed: int = 1234,
                 add_pooler: bool = True, params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device | str] = None):
        super().__init__()
        ps = parallel_state or get_parallel_state()
        if ps.pp_size > 1:
            raise ConfigError("BertModel builds a whole model; with --pipeline-model-parallel-size > 1 the "
                              "trainer builds per-stage models")
        validate_layout(config, ParallelConfig(tensor_model_parallel_size=ps.tp_size), ps.tp_size * ps.dp_size)
        self.config, self.parallel_state = config, ps
        self.padded_vocab_size = config.padded_vocab_size(ps.tp_size)
        self.ctx = build_context(config, ps, seed, params_dtype, device)
        self.embeddings = BertEmbeddings(self.ctx, self.padded_vocab_size)
        self.encoder = TransformerBlock(self.ctx)
        self.pooler = Pooler(self.ctx) if add_pooler else None

    @property
    def rng(self) -> RNGStatesTracker:
        return self.ctx.rng

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        x = self.encoder(x, attention_mask_to_bool(attention_mask))
        if self.ctx.sequence_parallel:
            x = gather_from_sp_to_replicated(x, self.ctx.tp_group)  # [s/tp, b, h] -> [s, b, h]
        pooled = self.pooler(x) if self.pooler is not None else None
        return x, pooled


class BertForPreTraining(PretrainedMixin, nn.Module):
    """Masked LM + the sentence-pair head (NSP or SOP), as transformers' BertForPreTraining.

    forward(input_ids, token_type_ids, attention_mask, labels, next_sentence_label):
    labels are token ids at masked positions and -100 elsewhere. With
    `mlm_logits_at_masked_only`, logits are computed only where labels != -100 and
    `mlm_logits` is [n_masked, vocab].
    """

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, *, seed: int = 1234,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.bert = BertModel(config, parallel_state, seed=seed, add_pooler=config.bert_binary_head,
                              params_dtype=params_dtype, device=device)
        self.config, self.parallel_state = config, self.bert.parallel_state
        self.lm_head = MLMHead(self.bert.ctx, self.bert.padded_vocab_size, self.parallel_state.tp_rank)
        self.binary_head = _linear(self.bert.ctx, "binary_head", config.hidden_size, 2) \
            if config.bert_binary_head else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                next_sentence_label: Optional[torch.Tensor] = None) -> BertPreTrainingOutput:
        sequence, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        return pretraining_heads(self.config, self.parallel_state, sequence, pooled, self.lm_head,
                                 self.bert.embeddings.word_embeddings.weight, self.binary_head, labels,
                                 next_sentence_label)


class BertForQuestionAnswering(PretrainedMixin, nn.Module):
    """Span extraction (SQuAD): start/end logits per token, as transformers'."""

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, *, seed: int = 1234,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.bert = BertModel(config, parallel_state, seed=seed, add_pooler=False, params_dtype=params_dtype,
                              device=device)
        self.config, self.parallel_state = config, self.bert.parallel_state
        self.qa_outputs = _linear(self.bert.ctx, "qa_outputs", config.hidden_size, 2)

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, start_positions: Optional[torch.Tensor] = None,
                end_positions: Optional[torch.Tensor] = None) -> QuestionAnsweringOutput:
        sequence, _ = self.bert(input_ids, token_type_ids, attention_mask)
        logits = self.qa_outputs(sequence.transpose(0, 1))  # [b, s, 2]
        start_logits, end_logits = logits[..., 0].contiguous(), logits[..., 1].contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            # As transformers: positions outside the sequence are ignored, not errors.
            ignored = start_logits.size(1)
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = (F.cross_entropy(start_logits.float(), start, ignore_index=ignored)
                    + F.cross_entropy(end_logits.float(), end, ignore_index=ignored)) / 2
        return QuestionAnsweringOutput(loss=loss, start_logits=start_logits, end_logits=end_logits)
