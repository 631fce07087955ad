"""One pipeline stage of BertForPreTraining: this rank's model chunks.

The layers are split into pp_size x V chunks of equal size; rank r holds global chunks
r, r + pp, r + 2 pp, ... (V = 1 unless the schedule is interleaved). Chunk 0 starts
with the embeddings, the last chunk ends with the final LayerNorm (pre-LN), the pooler
and the heads. The last stage also holds a copy of the word embeddings for the tied
MLM projection. Parameters keep the names of the whole model ("bert.encoder.layers.7.")
so a stage's state dict is exactly its slice of a PP=1 checkpoint, and every layer is
initialised from the seed by that name: PP=1 and PP=N start from the same weights.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megabert.config import ModelConfig, ParallelConfig, validate_layout
from megabert.model.bert import attention_mask_to_bool, build_context, pretraining_heads
from megabert.model.embeddings import BertEmbeddings, TiedWordEmbeddings
from megabert.model.heads import MLMHead, Pooler, _linear
from megabert.model.outputs import BertPreTrainingOutput
from megabert.model.pretrained import PretrainedMixin
from megabert.model.transformer import TransformerBlock
from megabert.parallel import ParallelState
from megabert.tensor_parallel import gather_from_sp_to_replicated
from megabert.tensor_parallel.random import RNGStatesTracker


def chunk_layers(num_layers: int, pp_size: int, pp_rank: int, layers_per_virtual_stage: Optional[int]
                 ) -> list[list[int]]:
    """Global layer numbers of each model chunk held by `pp_rank`."""
    per_chunk = layers_per_virtual_stage or num_layers // pp_size
    chunks = num_layers // (pp_size * per_chunk)
    return [list(range(g * per_chunk, (g + 1) * per_chunk)) for g in (v * pp_size + pp_rank for v in range(chunks))]


class _StageBackbone(nn.Module):
    """The `bert.` part of a stage, with BertModel's attribute names."""

    def __init__(self, ctx, padded_vocab_size: int, *, first: bool, last: bool, layer_ids: list[int]):
        super().__init__()
        self.ctx, self.padded_vocab_size = ctx, padded_vocab_size
        if first:
            self.embeddings = BertEmbeddings(ctx, padded_vocab_size)
        elif last:
            self.embeddings = TiedWordEmbeddings(ctx, padded_vocab_size)
        else:
            self.embeddings = None
        self.encoder = TransformerBlock(ctx, layer_ids, final_layernorm=last)
        self.pooler = Pooler(ctx) if last and ctx.config.bert_binary_head else None

    @property
    def rng(self) -> RNGStatesTracker:
        return self.ctx.rng


class BertForPreTrainingPipelineStage(PretrainedMixin, nn.Module):
    """BertForPreTraining's layers that live on this pipeline rank; driven by
    megabert.pipeline_parallel.PipelineSchedule through `forward_chunk`."""

    checkpoint_class_name = "BertForPreTraining"  # what the saved weights are, for export

    def __init__(self, config: ModelConfig, ps: ParallelState, *, seed: int = 1234,
                 num_layers_per_virtual_stage: Optional[int] = None, params_dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        validate_layout(config, ParallelConfig(tensor_model_parallel_size=ps.tp_size,
                                               pipeline_model_parallel_size=ps.pp_size,
                                               num_layers_per_virtual_pipeline_stage=num_layers_per_virtual_stage),
                        ps.world_size)
        self.config, self.parallel_state = config, ps
        self.chunk_layers = chunk_layers(config.num_layers, ps.pp_size, ps.pp_rank, num_layers_per_virtual_stage)
        self.num_chunks = len(self.chunk_layers)
        # None when every rank holds one chunk: the plain 1F1B layout, whatever the flag said.
        self.virtual_stage_layers = num_layers_per_virtual_stage if self.num_chunks > 1 else None
        ctx = build_context(config, ps, seed, params_dtype, device)
        first, last = ps.is_first_stage, ps.is_last_stage
        self.bert = _StageBackbone(ctx, config.padded_vocab_size(ps.tp_size), first=first, last=last,
                                   layer_ids=[i for ids in self.chunk_layers for i in ids])
        self.lm_head = MLMHead(ctx, self.bert.padded_vocab_size, ps.tp_rank) if last else None
        self.binary_head = _linear(ctx, "binary_head", config.hidden_size, 2) \
            if last and config.bert_binary_head else None
        if ps.pp_size > 1 and self.bert.embeddings is not None:
            self.bert.embeddings.word_embeddings.weight.pipeline_tied = True

    # ------------------------------------------------------------ schedule interface

    def _global_chunk(self, v: int) -> int:
        return v * self.parallel_state.pp_size + self.parallel_state.pp_rank

    def is_first_chunk(self, v: int) -> bool:
        return self._global_chunk(v) == 0

    def is_last_chunk(self, v: int) -> bool:
        return self._global_chunk(v) == self.num_chunks * self.parallel_state.pp_size - 1

    def forward_chunk(self, v: int, hidden: Optional[torch.Tensor], batch: dict):
        """Chunk v on one micro-batch: [s, b, h] -> [s, b, h] (or the embeddings' output for
        chunk 0); the last chunk returns a BertPreTrainingOutput with the losses."""
        mask = attention_mask_to_bool(batch.get("attention_mask"))
        if self.is_first_chunk(v):
            ids = batch["input_ids"]
            tt = batch.get("token_type_ids")
            hidden = self.bert.embeddings(ids, tt if tt is not None else torch.zeros_like(ids))
        last = self.is_last_chunk(v)
        x = self.bert.encoder(hidden, mask, self.chunk_layers[v], apply_final_layernorm=last)
        if not last:
            return x
        ctx = self.bert.ctx
        if ctx.sequence_parallel:
            x = gather_from_sp_to_replicated(x, ctx.tp_group)
        pooled = self.bert.pooler(x) if self.bert.pooler is not None else None
        return pretraining_heads(self.config, self.parallel_state, x, pooled, self.lm_head,
                                 self.bert.embeddings.word_embeddings.weight, self.binary_head,
                                 batch.get("labels"), batch.get("next_sentence_label"))

    def activation_shape(self, seq_length: int, micro_batch_size: int) -> tuple[int, int, int]:
        """What travels between stages: [s (/tp with sequence parallelism), b, h]."""
        s = seq_length // self.parallel_state.tp_size if self.bert.ctx.sequence_parallel else seq_length
        return s, micro_batch_size, self.config.hidden_size

    def forward(self, *args, **kwargs) -> BertPreTrainingOutput:
        raise RuntimeError("a pipeline stage holds only part of the model: run it through "
                           "megabert.pipeline_parallel.PipelineSchedule (pretrain_bert.py does)")
