"""Word + position + token-type embeddings, LayerNorm, dropout -> [s, b, h]."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert.model.context import BuildContext
from megabert.tensor_parallel import VocabParallelEmbedding, scatter_to_sp


def word_embeddings(ctx: BuildContext, padded_vocab_size: int) -> VocabParallelEmbedding:
    """The (vocab-parallel) word embeddings, from the seed by name: every TP size and every
    pipeline stage that holds a copy starts from the same matrix."""
    init_rows = ctx.init("embeddings.word_embeddings.weight")
    vocab_size = ctx.config.vocab_size

    def init_word_embeddings(full: torch.Tensor) -> None:
        # Padding rows (past the real vocab) start at zero and stay there: no id looks
        # them up and their logits are masked. Random rows would make the matrix norm,
        # and with it LAMB's trust ratio, depend on how much padding the TP size adds.
        init_rows(full)
        full[vocab_size:] = 0.0

    return VocabParallelEmbedding(padded_vocab_size, ctx.config.hidden_size, tp_group=ctx.tp_group,
                                  init_method=init_word_embeddings, params_dtype=ctx.params_dtype, device=ctx.device)


class TiedWordEmbeddings(nn.Module):
    """The last pipeline stage's copy of the word embeddings, for the MLM head's output
    projection. Named like BertEmbeddings' so both copies save under one name; the
    trainer keeps them equal by summing their gradients over the embedding group."""

    def __init__(self, ctx: BuildContext, padded_vocab_size: int):
        super().__init__()
        self.word_embeddings = word_embeddings(ctx, padded_vocab_size)
        # The first stage's copy is the one counted in the gradient norm (ours, and
        # DeepSpeed's, which reads its own attribute name).
        self.word_embeddings.weight.pipeline_duplicate = True
        self.word_embeddings.weight.ds_pipe_replicated = True


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
        ctx.init("embeddings.position_embeddings.weight")(self.position_embeddings.weight.data)
        ctx.init("embeddings.tokentype_embeddings.weight")(self.tokentype_embeddings.weight.data)
        # The embedding LayerNorm runs before the sequence is scattered: full-sequence params.
        self.layernorm = ctx.layer_norm(sequence_parallel=False)
        self.dropout_p = cfg.hidden_dropout

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.size(1)
        if seq_len > self.position_embeddings.num_embeddings:
            raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings "
                             f"{self.position_embeddings.num_embeddings}")
        positions = torch.arange(seq_len, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) \
            + self.tokentype_embeddings(token_type_ids)  # [b, s, h]
        x = self.layernorm(x.transpose(0, 1).contiguous())  # [s, b, h]: Megatron's layout
        if self.ctx.sequence_parallel:
            x = scatter_to_sp(x, self.ctx.tp_group)  # [s/tp, b, h]
            with self.ctx.rng.fork():  # each rank drops in its own slice
                return F.dropout(x, self.dropout_p, self.training)
        return F.dropout(x, self.dropout_p, self.training)
