"""The embeddings of every family: word (+ position) (+ token type), norm, dropout -> [s, b, h]."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert.model.context import BuildContext
from megabert.model.norm import norm_hf_names, residual_stream
from megabert.parallel.param_spec import describe, describe_module, set_hf_names
from megabert.tensor_parallel import VocabParallelEmbedding, scatter_to_sp

def word_embeddings(ctx: BuildContext, padded_vocab_size: int) -> VocabParallelEmbedding:
    """The (vocab-parallel) word embeddings; rows past the real vocab are padding."""
    emb = VocabParallelEmbedding(padded_vocab_size, ctx.spec.hidden_size, tp_group=ctx.tp_group, init_method=None,
                                 params_dtype=ctx.params_dtype, device=ctx.device)
    describe(emb.weight, valid_rows=ctx.config.vocab_size, placement="first",
             hf_names=ctx.spec.hf("word_embeddings", ("weight",)).get("weight", ()))
    return emb


class TiedWordEmbeddings(nn.Module):
    """The last pipeline stage's copy of the word embeddings, for the MLM head's output
    projection. Named like Embeddings' so both copies save under one name (and so
    initialise identically); the trainer keeps them equal by summing their gradients over
    the embedding group, and only the first stage's copy counts in the gradient norm."""

    def __init__(self, ctx: BuildContext, padded_vocab_size: int):
        super().__init__()
        self.word_embeddings = word_embeddings(ctx, padded_vocab_size)


class Embeddings(nn.Module):
    """Word (+ learned position) (+ token type) embeddings, as the spec says, summed, then the
    embedding norm (if any) and dropout -> [s, b, h]."""

    def __init__(self, ctx: BuildContext, padded_vocab_size: int):
        super().__init__()
        spec, emb = ctx.spec, ctx.spec.embeddings
        self.ctx = ctx
        self.word_embeddings = word_embeddings(ctx, padded_vocab_size)
        self.position_embeddings = self.tokentype_embeddings = None
        if emb.max_positions:
            self.position_embeddings = nn.Embedding(emb.max_positions, spec.hidden_size, dtype=ctx.params_dtype,
                                                    device=ctx.device)
            describe(self.position_embeddings.weight, placement="first",
                     hf_names=spec.hf("position_embeddings", ("weight",)).get("weight", ()))
        if emb.type_vocab_size:
            self.tokentype_embeddings = nn.Embedding(emb.type_vocab_size, spec.hidden_size, dtype=ctx.params_dtype,
                                                     device=ctx.device)
            describe(self.tokentype_embeddings.weight, placement="first",
                     hf_names=spec.hf("token_type_embeddings", ("weight",)).get("weight", ()))
        # The embedding norm runs before the sequence is scattered: full-sequence params.
        # Megatron-LM's BERT has none (its pre-LN layers normalise their input anyway).
        self.norm_name = spec.names.embedding_norm
        norm = ctx.norm(sequence_parallel=False) if emb.norm else None
        self.add_module(self.norm_name, norm)
        if norm is not None:
            describe_module(norm, placement="first")
            set_hf_names(self, norm_hf_names(self.norm_name, norm, spec.hf("embedding_norm")))
        self.dropout_p = emb.dropout

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """position_ids: [b, s], or None for 0 .. s - 1 in every row (packed rows restart them
        at each sample). Read only with learned positions (RoPE takes them from the layout)."""
        x = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            seq_len = input_ids.size(1)
            if seq_len > self.position_embeddings.num_embeddings:
                raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings "
                                 f"{self.position_embeddings.num_embeddings}")
            positions = torch.arange(seq_len, device=input_ids.device) if position_ids is None else position_ids
            x = x + self.position_embeddings(positions)
        if self.tokentype_embeddings is not None:
            # NOTE: a one-row table (GTE's type_vocab_size 1) is added to every token: its
            # tokenizer types both segments of a pair 0, where the tasks' features write BERT's 1.
            one_type = token_type_ids is None or self.tokentype_embeddings.num_embeddings == 1
            x = x + self.tokentype_embeddings(torch.zeros_like(input_ids) if one_type else token_type_ids)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]: Megatron's layout
        norm = getattr(self, self.norm_name)
        if norm is not None:
            x = norm(x)
        x = residual_stream(x, self.ctx.config.bf16_residual)
        if self.ctx.sequence_parallel:
            x = scatter_to_sp(x, self.ctx.tp_group)  # [s/tp, b, h]
            with self.ctx.rng.fork():  # each rank drops in its own slice
                return F.dropout(x, self.dropout_p, self.training)
        return F.dropout(x, self.dropout_p, self.training)
