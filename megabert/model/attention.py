"""Self-attention with heads split over the tensor-parallel group, as the spec says: learned
positions or RoPE (a base per layer type), global or within a sliding window (per layer type).

Tensor parallelism (Megatron's split, in transformers' tensor layouts so that a Hugging Face
checkpoint is sliced, never permuted): QKV is one column-parallel GEMM whose full weight is
[Q; K; V] (3h x h); with stride 3 each rank holds [Q_r; K_r; V_r], i.e. whole heads. The
output projection is row-parallel, so the only communication is its all-reduce (or
reduce-scatter).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert import ops
from megabert.errors import ConfigError
from megabert.model.context import BuildContext
from megabert.model.local_attention import local_attention, worth_blocking
from megabert.model.rope import RotaryTables, attention_input, grouped_qkv, padded_positions
from megabert.model.unpad import TokenLayout
from megabert.parallel.param_spec import describe, set_hf_names
from megabert.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint, copy_to_tp, gather_from_sp


def band_mask(s: int, half_window: int, device) -> torch.Tensor:
    """[s, s] bool, True = masked: keys more than `half_window` positions from the query
    (transformers' sliding_window_bidirectional_overlay keeps |q - k| <= half_window)."""
    idx = torch.arange(s, device=device)
    return (idx[:, None] - idx[None, :]).abs() > half_window


class AttentionInputs:
    """What every layer of one micro-batch reads besides its activations: the padding mask
    (bool [b, 1, 1|s, s], True = masked, or None), the unpadded layout (or None), the RoPE
    tables (None without RoPE), and each window's padded mask (the band added), made once."""

    def __init__(self, mask: Optional[torch.Tensor], tokens: Optional[TokenLayout], rope: Optional[RotaryTables],
                 seq_length: int, device, padded_segments: Optional[torch.Tensor] = None):
        self.mask, self.tokens, self.rope = mask, tokens, rope
        # Packed rows in the padded layout (sequence parallelism): int64 [b, s], each position's
        # sample; `mask` is then their block-diagonal [b, 1, s, s].
        self.padded_segments = padded_segments
        self.s, self.device = seq_length, device
        self._window_masks: dict[int, torch.Tensor] = {}
        self._segments: Optional[torch.Tensor] = None

    @classmethod
    def unmasked(cls, s: int, b: int, head_dim: int, device) -> "AttentionInputs":
        """[s, b] rows without padding, each position its slot (a layer run on its own)."""
        return cls(None, None, RotaryTables(padded_positions(s, b, device), head_dim), s, device)

    @property
    def key_padding(self) -> Optional[torch.Tensor]:
        """bool [b, s], True = padding (from a [b, 1, 1, s] mask), or None."""
        if self.mask is None:
            return None
        if self.mask.dim() != 4 or self.mask.size(2) != 1:
            raise ValueError("sliding-window layers take a [b, s] padding mask (transformers' attention_mask)")
        return self.mask[:, 0, 0, :]

    @property
    def token_segments(self) -> torch.Tensor:
        """int64 [1, T]: the sequence of each unpadded token (the window layers' segments)."""
        if self._segments is None:
            cu = self.tokens.cu_seqlens
            ids = torch.arange(cu.numel() - 1, device=cu.device)
            self._segments = torch.repeat_interleave(ids, cu[1:] - cu[:-1], output_size=self.tokens.num_tokens)[None]
        return self._segments

    def padded_mask(self, half_window: Optional[int]) -> Optional[torch.Tensor]:
        if half_window is None:
            return self.mask
        if half_window not in self._window_masks:
            band = band_mask(self.s, half_window, self.device)[None, None]  # [1, 1, s, s]
            self._window_masks[half_window] = band if self.mask is None else self.mask | band
        return self._window_masks[half_window]


class SelfAttention(nn.Module):
    def __init__(self, ctx: BuildContext, layer_number: int, hf_prefix: str):
        """`hf_prefix`: this layer's Hugging Face names start with it ("bert.encoder.layer.3.")."""
        super().__init__()
        spec, attn = ctx.spec, ctx.spec.attention
        self.ctx = ctx
        self.heads_per_rank = attn.num_heads // ctx.tp_size
        self.head_dim = attn.head_dim
        inner = attn.num_heads * attn.head_dim
        self.qkv_name, self.out_name = spec.names.qkv, spec.names.attn_out
        self.kv_heads = None
        if attn.gqa:
            self._build_gqa(ctx, hf_prefix)
        else:
            self.add_module(self.qkv_name, ColumnParallelLinear(spec.hidden_size, 3 * inner, stride=3,
                                                                bias=attn.qkv_bias, **ctx.tp_kwargs()))
            # transformers may keep Q, K and V as three matrices; ours is their concatenation.
            set_hf_names(self, {f"{self.qkv_name}.{k}": v for k, v in spec.hf_layer("qkv", hf_prefix).items()
                                if k == "weight" or attn.qkv_bias})
        self.add_module(self.out_name, RowParallelLinear(inner, spec.hidden_size, input_is_parallel=True,
                                                         bias=attn.out_bias, **ctx.row_parallel_kwargs()))
        set_hf_names(self, {f"{self.out_name}.{k}": v for k, v in spec.hf_layer("attn_out", hf_prefix).items()
                            if k == "weight" or attn.out_bias})
        self.selective_recompute = ctx.config.recompute_granularity == "selective"
        self.theta = attn.theta(layer_number)
        self.half_window = attn.window(layer_number)
        # Unpadded under the varlen backend every layer runs ops.varlen_attention, window layers
        # with (w, w), |i - j| <= w as transformers' sliding window: the CPU kernel and
        # FlashAttention skip the key tiles outside it (cost linear in the length), SDPA masks a
        # band. Elsewhere window layers run by blocks of the window (local_attention.py: linear in
        # s); the reference backend "torch" (and short padded rows) run a band-masked dense core.
        self.varlen = ctx.attention_backend == "varlen"
        self.blocked = self.half_window is not None and ctx.attention_backend != "torch"
        self.window = (-1, -1) if self.half_window is None else (self.half_window, self.half_window)

    def _build_gqa(self, ctx: BuildContext, hf_prefix: str) -> None:
        """Grouped-query attention: Q column-parallel by heads; K and V ([K; V], stride 2) split
        by key/value heads when the TP size divides them, so each rank keeps the key/value heads
        of its own query heads (query heads [j*g, (j+1)*g) share head j); replicated when the TP
        size exceeds them (Megatron's rule), each rank then reading its query heads' group. A
        replicated K/V weight sees only its rank's group: its gradient is partial over the TP
        group and is summed there (ParamSpec.sequence_parallel)."""
        spec, attn, tp = ctx.spec, ctx.spec.attention, ctx.tp_size
        d, h = attn.head_dim, spec.hidden_size
        self.group = attn.num_heads // attn.num_kv_heads
        self.add_module("query", ColumnParallelLinear(h, attn.num_heads * d, bias=attn.qkv_bias, **ctx.tp_kwargs()))
        names = {"query": spec.hf_layer("q", hf_prefix), "key_value": spec.hf_layer("kv", hf_prefix)}
        if attn.num_kv_heads % tp == 0:
            self.kv_heads = attn.num_kv_heads // tp
            self.kv_replicated = None
            self.add_module("key_value", ColumnParallelLinear(h, 2 * attn.num_kv_heads * d, stride=2,
                                                              bias=attn.qkv_bias, **ctx.tp_kwargs()))
        else:
            if tp % attn.num_kv_heads:
                raise ConfigError(f"{attn.num_kv_heads} key/value heads neither split over nor replicate onto "
                                  f"--tensor-model-parallel-size {tp}: use a TP size that divides or is a "
                                  f"multiple of them")
            self.kv_heads = 1
            # The one key/value head of this rank's query heads.
            self.kv_replicated = ctx.tp_rank * attn.num_kv_heads // tp
            linear = nn.Linear(h, 2 * attn.num_kv_heads * d, bias=attn.qkv_bias, dtype=ctx.params_dtype,
                               device=ctx.device)
            describe(linear.weight, sequence_parallel=True)
            if attn.qkv_bias:
                describe(linear.bias, init="zeros", weight_decay=False, sequence_parallel=True)
            self.add_module("key_value", linear)
        for module, table in names.items():
            set_hf_names(self, {f"{module}.{k}": v for k, v in table.items() if k == "weight" or attn.qkv_bias})

    def _gqa_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x -> q [..., n/tp, d] and kv [..., 2, kv heads, d]: this rank's key/value heads (its
        query heads' group's one when replicated)."""
        q = self.query(x)
        q = q.view(*q.shape[:-1], self.heads_per_rank, self.head_dim)
        if self.kv_replicated is None:
            kv = self.key_value(x)
        else:
            # Every rank's K/V path reads the whole input: its gradient there is partial.
            group = self.ctx.tp_group
            full = gather_from_sp(x, group) if self.ctx.sequence_parallel else copy_to_tp(x, group)
            # A replicated nn.Linear: autocast casts its weight at each use (no GEMM copy).
            kv = F.linear(full, self.key_value.weight, self.key_value.bias)
        kv = kv.view(*kv.shape[:-1], 2, -1, self.head_dim)  # [..., 2, kv heads here, d]
        if self.kv_replicated is not None:
            kv = kv.narrow(-2, self.kv_replicated, 1)
        return q, kv

    def _attention_input(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """x -> [..., 3, n/tp, d]: Q, K and V of this rank's heads (each query head beside its
        group's key/value head), Q and K rotated with RoPE. The rotation (and the grouped
        layout) is the QKV GEMM's epilogue, so --dropout-add-backend (the epilogues' backend)
        picks how it runs: 'fused' the one-pass CPU kernel, else PyTorch (rope.attention_input)."""
        if self.kv_heads is not None:
            q, kv = self._gqa_projections(x)
        else:
            qkv = getattr(self, self.qkv_name)(x)  # [s, b, 3h/tp] or [T, 3h/tp]
            # The stride-3 QKV weight gives each token [Q_r | K_r | V_r], each heads x d.
            q, kv = qkv.view(*qkv.shape[:-1], 3, self.heads_per_rank, self.head_dim), None
        if self.theta is None:
            return q if kv is None else grouped_qkv(q, kv)
        cos, sin = inputs.rope.get(self.theta, q.dtype)  # [T, 1, d] or [s, b, 1, d]
        return attention_input(q, kv, cos, sin, self.ctx.dropout_add_backend)

    @property
    def is_global(self) -> bool:
        """The layer attends over the whole sequence (no window)."""
        return self.half_window is None

    def _dropout_p(self) -> float:
        return self.ctx.spec.attention.dropout if self.training else 0.0

    def _varlen_core(self, qkv: torch.Tensor, tokens: TokenLayout) -> torch.Tensor:
        return ops.varlen_attention(qkv, tokens.cu_seqlens, tokens.host_cu_seqlens, dropout_p=self._dropout_p(),
                                    rng_fork=self.ctx.rng.fork, max_seqlen=tokens.max_seqlen, window=self.window)

    def _padded_core(self, qkv: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """qkv [s, b, 3, n/tp, d] -> [s, b, n/tp * d]."""
        s, b = qkv.shape[:2]
        q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # each [b, n/tp, s, d]
        if self.blocked and worth_blocking(s, self.half_window):
            segments = inputs.padded_segments  # packed rows: each sample a segment (its padding too)
            ctx = local_attention(q, k, v, None if segments is not None else inputs.key_padding, self.half_window,
                                  segments=segments, dropout_p=self._dropout_p(), rng_fork=self.ctx.rng.fork)
        else:
            ctx = ops.core_attention(q, k, v, inputs.padded_mask(self.half_window),
                                     backend=self.ctx.attention_backend, dropout_p=self._dropout_p(),
                                     rng_fork=self.ctx.rng.fork)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)

    def _unpadded_window_core(self, qkv: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """qkv [T, 3, n/tp, d] -> [T, n/tp * d]: the real tokens as one row, each sequence a
        segment, by blocks of the window (no padding back to [s, b])."""
        q, k, v = qkv.permute(1, 2, 0, 3).unsqueeze(1).unbind(0)  # each [1, n/tp, T, d]
        ctx = local_attention(q, k, v, None, self.half_window, segments=inputs.token_segments,
                              dropout_p=self._dropout_p(), rng_fork=self.ctx.rng.fork)  # [1, n/tp, T, d]
        return ctx[0].transpose(0, 1).reshape(qkv.size(0), self.heads_per_rank * self.head_dim)

    def _run(self, core, *args):
        if self.selective_recompute and self.training:
            # Selective recompute (Korthikanti et al. 2022): the attention core holds the
            # O(s^2) (or O(T)) activations but is cheap to recompute.
            return checkpoint(core, self.ctx.rng, *args)
        return core(*args)

    def forward(self, x: torch.Tensor, inputs: Optional[AttentionInputs], rows: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """x: [s, b, h] (or [s/tp, b, h] with sequence parallelism), or [T, h] of the real
        tokens that inputs.tokens places (inputs None: [s, b, h] without padding; unpadded: the
        GEMMs skip padding; the varlen core works on [T, ...] as it is, the others pad back).
        `rows` (unpadded only): the output is wanted at these rows of [T, h] alone -> [n, h];
        every token is still attended to."""
        if inputs is None:  # a layer run on its own: [s, b, h], no padding
            inputs = AttentionInputs.unmasked(x.size(0), x.size(1), self.head_dim, x.device)
        qkv = self._attention_input(x, inputs)  # [s, b, 3, n/tp, d] or [T, 3, n/tp, d]
        tokens = inputs.tokens
        if tokens is not None and self.varlen:
            ctx = self._run(self._varlen_core, qkv, tokens)  # [T, n/tp, d]
            ctx = ctx.reshape(ctx.size(0), self.heads_per_rank * self.head_dim)
        elif tokens is not None and self.blocked:
            ctx = self._run(self._unpadded_window_core, qkv, inputs)  # [T, h/tp]
        elif tokens is not None:
            padded = tokens.pad(qkv)  # [s, b, 3, n/tp, d]: padded keys are masked, padded queries dropped
            ctx = tokens.unpad(self._run(self._padded_core, padded, inputs))
        else:
            ctx = self._run(self._padded_core, qkv, inputs)
        if rows is not None:
            ctx = ctx.index_select(0, rows)
        return getattr(self, self.out_name)(ctx)
