"""Word + position + token-type embeddings, LayerNorm, dropout -> [s, b, h]."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert.model.context import BuildContext
from megabert.model.norm import residual_stream
from megabert.parallel.param_spec import describe, set_hf_names
from megabert.tensor_parallel import VocabParallelEmbedding, scatter_to_sp

WORD_EMBEDDINGS_HF = "bert.embeddings.word_embeddings.weight"


def word_embeddings(ctx: BuildContext, padded_vocab_size: int) -> VocabParallelEmbedding:
    """The (vocab-parallel) word embeddings; rows past the real vocab are padding."""
    emb = VocabParallelEmbedding(padded_vocab_size, ctx.config.hidden_size, tp_group=ctx.tp_group, init_method=None,
                                 params_dtype=ctx.params_dtype, device=ctx.device)
    describe(emb.weight, valid_rows=ctx.config.vocab_size, placement="first", hf_names=(WORD_EMBEDDINGS_HF,))
    return emb


class TiedWordEmbeddings(nn.Module):
    """The last pipeline stage's copy of the word embeddings, for the MLM head's output
    projection. Named like BertEmbeddings' so both copies save under one name (and so
    initialise identically); the trainer keeps them equal by summing their gradients over
    the embedding group, and only the first stage's copy counts in the gradient norm."""

    def __init__(self, ctx: BuildContext, padded_vocab_size: int):
        super().__init__()
        self.word_embeddings = word_embeddings(ctx, padded_vocab_size)


class BertEmbeddings(nn.Module):
    def __init__(self, ctx: BuildContext, padded_vocab_size: int):
        super().__init__()
        cfg = ctx.config
        self.ctx = ctx
        self.word_embeddings = word_embeddings(ctx, padded_vocab_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                                dtype=ctx.params_dtype, device=ctx.device)
        self.tokentype_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size,
                                                 dtype=ctx.params_dtype, device=ctx.device)
        describe(self.position_embeddings.weight, placement="first")
        describe(self.tokentype_embeddings.weight, placement="first")
        set_hf_names(self, {"position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
                            "tokentype_embeddings.weight": "bert.embeddings.token_type_embeddings.weight"})
        # The embedding LayerNorm runs before the sequence is scattered: full-sequence params.
        # Megatron-LM's BERT has none (its pre-LN layers normalise their input anyway).
        self.layernorm = ctx.layer_norm(sequence_parallel=False) if cfg.embedding_layernorm else None
        if self.layernorm is not None:
            for p in self.layernorm.parameters():
                describe(p, placement="first")
            set_hf_names(self, {"layernorm.weight": "bert.embeddings.LayerNorm.weight",
                                "layernorm.bias": "bert.embeddings.LayerNorm.bias"})
        self.dropout_p = cfg.hidden_dropout

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """position_ids: [b, s], or None for 0 .. s - 1 in every row (packed rows restart them
        at each sample)."""
        seq_len = input_ids.size(1)
        if seq_len > self.position_embeddings.num_embeddings:
            raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings "
                             f"{self.position_embeddings.num_embeddings}")
        positions = torch.arange(seq_len, device=input_ids.device) if position_ids is None else position_ids
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) \
            + self.tokentype_embeddings(token_type_ids)  # [b, s, h]
        x = x.transpose(0, 1).contiguous()  # [s, b, h]: Megatron's layout
        if self.layernorm is not None:
            x = self.layernorm(x)
        x = residual_stream(x, self.ctx.config.bf16_residual)
        if self.ctx.sequence_parallel:
            x = scatter_to_sp(x, self.ctx.tp_group)  # [s/tp, b, h]
            with self.ctx.rng.fork():  # each rank drops in its own slice
                return F.dropout(x, self.dropout_p, self.training)
        return F.dropout(x, self.dropout_p, self.training)
