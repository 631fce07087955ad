"""Task heads: masked LM (tied to the word embeddings), sentence pair (NSP/SOP), QA."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert.model.context import BuildContext
from megabert.model.init import init_linear_
from megabert.tensor_parallel import copy_to_tp


def _linear(ctx: BuildContext, name: str, in_features: int, out_features: int) -> nn.Linear:
    lin = nn.Linear(in_features, out_features, dtype=ctx.params_dtype, device=ctx.device)
    init_linear_(lin, ctx.seed, name + ".weight", ctx.config.init_method_std)
    return lin


class Pooler(nn.Module):
    """tanh(W h_[CLS] + b): the sentence representation the binary head reads."""

    def __init__(self, ctx: BuildContext):
        super().__init__()
        self.dense = _linear(ctx, "pooler.dense", ctx.config.hidden_size, ctx.config.hidden_size)

    def forward(self, sequence: torch.Tensor) -> torch.Tensor:  # [s, b, h] -> [b, h]
        return torch.tanh(self.dense(sequence[0]))


class MLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> logits against the (vocab-parallel) word embeddings.

    Logits stay split over the vocab ([..., V/tp]); the loss is computed without
    gathering them. Columns past the real vocab (padding) are filled with the dtype's
    minimum, so they take no probability mass: the loss equals the unpadded model's.
    """

    def __init__(self, ctx: BuildContext, padded_vocab_size: int, tp_rank: int):
        super().__init__()
        cfg = ctx.config
        self.tp_group = ctx.tp_group
        self.dense = _linear(ctx, "lm_head.dense", cfg.hidden_size, cfg.hidden_size)
        self.layernorm = ctx.layer_norm(sequence_parallel=False)
        per_rank = padded_vocab_size // ctx.tp_size
        self.bias = nn.Parameter(torch.zeros(per_rank, dtype=ctx.params_dtype, device=ctx.device))
        self.bias.tensor_model_parallel, self.bias.partition_dim, self.bias.partition_stride = True, 0, 1
        first_pad = cfg.vocab_size - tp_rank * per_rank  # local index of the first padding column
        self.local_pad_start = first_pad if first_pad < per_rank else None
        self.tp_size = ctx.tp_size

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        x = self.layernorm(F.gelu(self.dense(hidden)))
        if self.tp_size == 1 and self.local_pad_start is not None:
            # One rank holds the whole vocab: leave the padding rows out of the GEMM
            # instead of computing and then masking their logits.
            end = self.local_pad_start
            return F.linear(x, word_embeddings[:end], self.bias[:end])
        logits = F.linear(copy_to_tp(x, self.tp_group), word_embeddings, self.bias)
        if self.local_pad_start is not None:
            pad = torch.zeros(logits.size(-1), dtype=torch.bool, device=logits.device)
            pad[max(self.local_pad_start, 0):] = True
            logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
        return logits
