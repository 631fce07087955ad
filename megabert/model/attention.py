"""Self-attention with heads split over the tensor-parallel group."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megabert import ops
from megabert.model.context import BuildContext
from megabert.model.unpad import TokenLayout
from megabert.parallel.param_spec import set_hf_names
from megabert.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint


class SelfAttention(nn.Module):
    """QKV is one column-parallel GEMM whose full weight is [Q; K; V] (3h x h); with
    stride 3 each rank holds [Q_r; K_r; V_r], i.e. whole heads. The output projection
    is row-parallel, so the only communication is its all-reduce (or reduce-scatter)."""

    def __init__(self, ctx: BuildContext, hf_prefix: str):
        """`hf_prefix`: this layer's Hugging Face names start with it ("bert.encoder.layer.3.attention.")."""
        super().__init__()
        cfg = ctx.config
        self.ctx = ctx
        self.heads_per_rank = cfg.num_attention_heads // ctx.tp_size
        self.head_dim = cfg.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, stride=3, **ctx.tp_kwargs())
        self.dense = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, input_is_parallel=True,
                                       **ctx.row_parallel_kwargs())
        # transformers keeps Q, K and V as three matrices; ours is their concatenation.
        set_hf_names(self, {f"qkv.{k}": [f"{hf_prefix}self.{m}.{k}" for m in ("query", "key", "value")]
                            for k in ("weight", "bias")})
        set_hf_names(self, {f"dense.{k}": f"{hf_prefix}output.dense.{k}" for k in ("weight", "bias")})
        self.selective_recompute = cfg.recompute_granularity == "selective"
        self.varlen = ctx.attention_backend == "varlen"

    def _dropout_p(self) -> float:
        return self.ctx.config.attention_dropout if self.training else 0.0

    def _varlen_core(self, qkv: torch.Tensor, tokens: TokenLayout) -> torch.Tensor:
        return ops.varlen_attention(qkv, tokens.cu_seqlens, tokens.host_cu_seqlens, dropout_p=self._dropout_p(),
                                    rng_fork=self.ctx.rng.fork, max_seqlen=tokens.max_seqlen)

    def _core(self, q, k, v, mask):
        return ops.core_attention(q, k, v, mask, backend=self.ctx.attention_backend,
                                  dropout_p=self._dropout_p(), rng_fork=self.ctx.rng.fork)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], tokens: Optional[TokenLayout] = None,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [s, b, h] (or [s/tp, b, h] with sequence parallelism), or [T, h] of the real
        tokens that `tokens` places (unpadded: the GEMMs skip padding; the varlen core works
        on [T, ...] as it is, the others pad back); mask: bool [b, 1, 1|s, s]. `rows`
        (unpadded only): the output is wanted at these rows of [T, h] alone -> [n, h]; every
        token is still attended to."""
        qkv = self.qkv(x)  # [s, b, 3h/tp] or [T, 3h/tp]
        if tokens is not None and self.varlen:
            # The stride-3 QKV weight gives each token [Q_r | K_r | V_r], each heads x d.
            qkv = qkv.view(qkv.size(0), 3, self.heads_per_rank, self.head_dim)  # [T, 3, n/tp, d]
            if self.selective_recompute and self.training:
                ctx = checkpoint(self._varlen_core, self.ctx.rng, qkv, tokens)
            else:
                ctx = self._varlen_core(qkv, tokens)  # [T, n/tp, d]
            ctx = ctx.view(ctx.size(0), self.heads_per_rank * self.head_dim)  # [T, h/tp]
            return self.dense(ctx if rows is None else ctx.index_select(0, rows))
        if tokens is not None:
            qkv = tokens.pad(qkv)  # [s, b, 3h/tp]: padded keys are masked, padded queries dropped below
        s, b = qkv.shape[:2]
        q, k, v = (t.reshape(s, b, self.heads_per_rank, self.head_dim).permute(1, 2, 0, 3)
                   for t in qkv.chunk(3, dim=-1))  # each [b, n/tp, s, d]
        if self.selective_recompute and self.training:
            # Selective recompute (Korthikanti et al. 2022): the attention core holds the
            # O(s^2) activations but is cheap to recompute.
            ctx = checkpoint(self._core, self.ctx.rng, q, k, v, mask)
        else:
            ctx = self._core(q, k, v, mask)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)  # [s, b, h/tp]
        if tokens is not None:
            ctx = tokens.unpad(ctx)  # [T, h/tp]
            if rows is not None:
                ctx = ctx.index_select(0, rows)  # [n, h/tp]
        return self.dense(ctx)
