"""ModernBERT's encoder layer: pre-norm attention with RoPE (global, or local within a
sliding window) and a GeGLU MLP, both tensor-parallel; and the stack of them.

Tensor parallelism (Megatron's split, in transformers' tensor layouts so that a Hugging
Face checkpoint is sliced, never permuted):
- Wqkv [3h, h] is transformers' [3, heads, head_dim] rows: column-parallel with stride 3,
  so rank r holds [Q_r; K_r; V_r], its own heads' query, key and value;
- Wi [2f, h] is [input; gate]: column-parallel with stride 2, so rank r holds
  [input_r; gate_r], matching columns of both halves, and the GeGLU is rank-local;
- both Wo are row-parallel: one all-reduce (or reduce-scatter) per sublayer.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert import ops
from megabert.model.context import BuildContext
from megabert.model.modernbert.local_attention import local_attention, worth_blocking
from megabert.model.modernbert.rope import RotaryTables, rotate_qkv
from megabert.model.unpad import TokenLayout
from megabert.parallel.param_spec import describe_module, set_hf_names
from megabert.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint

ACTIVATIONS = {
    "gelu": F.gelu,  # exact (erf), transformers' "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def band_mask(s: int, half_window: int, device) -> torch.Tensor:
    """[s, s] bool, True = masked: keys more than `half_window` positions from the query
    (transformers' sliding_window_bidirectional_overlay keeps |q - k| <= half_window)."""
    idx = torch.arange(s, device=device)
    return (idx[:, None] - idx[None, :]).abs() > half_window


class AttentionInputs:
    """What every layer of one micro-batch reads besides its activations: the padding mask
    (bool [b, 1, 1, s], True = masked, or None), the unpadded layout (or None), the RoPE
    tables, and each layer type's padded mask (the local layers' adds the band), made once."""

    def __init__(self, mask: Optional[torch.Tensor], tokens: Optional[TokenLayout], rope: RotaryTables,
                 seq_length: int, half_window: int, device, padded_segments: Optional[torch.Tensor] = None):
        self.mask, self.tokens, self.rope = mask, tokens, rope
        # Packed rows in the padded layout (sequence parallelism): int64 [b, s], each position's
        # sample; `mask` is then their block-diagonal [b, 1, s, s].
        self.padded_segments = padded_segments
        self.s, self.half_window, self.device = seq_length, half_window, device
        self._local_mask: Optional[torch.Tensor] = None
        self._segments: Optional[torch.Tensor] = None

    @property
    def key_padding(self) -> Optional[torch.Tensor]:
        """bool [b, s], True = padding (from a [b, 1, 1, s] mask), or None."""
        if self.mask is None:
            return None
        if self.mask.dim() != 4 or self.mask.size(2) != 1:
            raise ValueError("ModernBERT's local layers take a [b, s] padding mask (transformers' attention_mask)")
        return self.mask[:, 0, 0, :]

    @property
    def token_segments(self) -> torch.Tensor:
        """int64 [1, T]: the sequence of each unpadded token (the local layers' segments)."""
        if self._segments is None:
            cu = self.tokens.cu_seqlens
            ids = torch.arange(cu.numel() - 1, device=cu.device)
            self._segments = torch.repeat_interleave(ids, cu[1:] - cu[:-1], output_size=self.tokens.num_tokens)[None]
        return self._segments

    def padded_mask(self, is_global: bool) -> Optional[torch.Tensor]:
        if is_global:
            return self.mask
        if self._local_mask is None:
            band = band_mask(self.s, self.half_window, self.device)[None, None]  # [1, 1, s, s]
            self._local_mask = band if self.mask is None else self.mask | band
        return self._local_mask


class ModernBertAttention(nn.Module):
    def __init__(self, ctx: BuildContext, layer_number: int, hf_prefix: str):
        super().__init__()
        cfg = ctx.config
        self.ctx = ctx
        self.is_global = cfg.is_global_layer(layer_number)
        self.heads_per_rank = cfg.num_attention_heads // ctx.tp_size
        self.head_dim = cfg.head_dim
        self.Wqkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, stride=3, bias=cfg.attention_bias,
                                         **ctx.tp_kwargs())
        self.Wo = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, input_is_parallel=True, bias=cfg.attention_bias,
                                    **ctx.row_parallel_kwargs())
        names = ("weight", "bias") if cfg.attention_bias else ("weight",)
        set_hf_names(self, {f"{m}.{k}": f"{hf_prefix}{m}.{k}" for m in ("Wqkv", "Wo") for k in names})
        self.selective_recompute = cfg.recompute_granularity == "selective"
        # Unpadded under the varlen backend both kinds run ops.varlen_attention, the local layers
        # with the window (w, w), |i - j| <= w as transformers' sliding window: the CPU kernel and
        # FlashAttention skip the key tiles outside it (cost linear in the length), SDPA masks a
        # band. Elsewhere local layers run by blocks of the window (local_attention.py: linear in
        # s); the reference backend "torch" (and short padded rows) run a band-masked dense core.
        self.varlen = ctx.attention_backend == "varlen"
        self.blocked = not self.is_global and ctx.attention_backend != "torch"
        self.half_window = cfg.local_attention // 2
        self.window = (-1, -1) if self.is_global else (self.half_window, self.half_window)

    def _dropout_p(self) -> float:
        return self.ctx.config.attention_dropout if self.training else 0.0

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
            ctx = ops.core_attention(q, k, v, inputs.padded_mask(self.is_global), backend=self.ctx.attention_backend,
                                     dropout_p=self._dropout_p(), rng_fork=self.ctx.rng.fork)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)

    def _unpadded_local_core(self, qkv: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """qkv [T, 3, n/tp, d] -> [T, n/tp * d]: the real tokens as one row, each sequence a
        segment, by blocks of the window (no padding back to [s, b])."""
        q, k, v = qkv.permute(1, 2, 0, 3).unsqueeze(1).unbind(0)  # each [1, n/tp, T, d]
        ctx = local_attention(q, k, v, None, self.half_window, segments=inputs.token_segments,
                              dropout_p=self._dropout_p(), rng_fork=self.ctx.rng.fork)  # [1, n/tp, T, d]
        return ctx[0].transpose(0, 1).reshape(qkv.size(0), self.heads_per_rank * self.head_dim)

    def _run(self, core, *args):
        if self.selective_recompute and self.training:
            return checkpoint(core, self.ctx.rng, *args)  # the core holds the O(s^2) or O(T) activations
        return core(*args)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [s, b, h] (or [s/tp, b, h] with sequence parallelism), or [T, h] of the real tokens
        (unpadded). `rows` (unpadded only): the output is wanted at these rows alone -> [n, h]."""
        qkv = self.Wqkv(x)  # [s, b, 3h/tp] or [T, 3h/tp]
        qkv = qkv.view(*qkv.shape[:-1], 3, self.heads_per_rank, self.head_dim)
        cos, sin = inputs.rope.get(self.is_global, qkv.dtype)  # [T, 1, d] or [s, b, 1, d]
        qkv = rotate_qkv(qkv, cos, sin)
        tokens = inputs.tokens
        if tokens is not None and self.varlen:
            ctx = self._run(self._varlen_core, qkv, tokens)  # [T, n/tp, d]
            ctx = ctx.reshape(ctx.size(0), self.heads_per_rank * self.head_dim)
        elif tokens is not None and self.blocked:
            ctx = self._run(self._unpadded_local_core, qkv, inputs)  # [T, h/tp]
        elif tokens is not None:
            padded = tokens.pad(qkv)  # [s, b, 3, n/tp, d]: padded keys are masked, padded queries dropped
            ctx = tokens.unpad(self._run(self._padded_core, padded, inputs))
        else:
            ctx = self._run(self._padded_core, qkv, inputs)
        if rows is not None:
            ctx = ctx.index_select(0, rows)
        return self.Wo(ctx)


class ModernBertMLP(nn.Module):
    """Wo(dropout(act(input) * gate)) with [input; gate] = Wi x (GeGLU for act = GELU)."""

    def __init__(self, ctx: BuildContext, hf_prefix: str):
        super().__init__()
        cfg = ctx.config
        self.ctx = ctx
        self.Wi = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, stride=2, bias=cfg.mlp_bias,
                                       **ctx.tp_kwargs())
        self.Wo = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, input_is_parallel=True, bias=cfg.mlp_bias,
                                    **ctx.row_parallel_kwargs())
        names = ("weight", "bias") if cfg.mlp_bias else ("weight",)
        set_hf_names(self, {f"{m}.{k}": f"{hf_prefix}{m}.{k}" for m in ("Wi", "Wo") for k in names})
        self.act = ACTIVATIONS[cfg.hidden_activation]
        self.dropout_p = cfg.mlp_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp, gate = self.Wi(x).chunk(2, dim=-1)  # this rank's matching columns of both halves
        y = self.act(inp) * gate
        if self.dropout_p > 0.0 and self.training:
            with self.ctx.rng.fork():  # columns differ per TP rank: the per-rank stream
                y = F.dropout(y, self.dropout_p, True)
        return self.Wo(y)


class ModernBertLayer(nn.Module):
    """x + attn(attn_norm(x)), then + mlp(mlp_norm(.)); layer 0 has no attn_norm (its input
    is the embedding norm's output)."""

    compiled_as_layer = True  # --compile compiles each layer (megabert.model.transformer.compile_layers)

    def __init__(self, ctx: BuildContext, layer_number: int):
        super().__init__()
        cfg = ctx.config
        hf = f"model.layers.{layer_number}."
        self.ctx = ctx
        self.attn_norm = ctx.layer_norm(bias=cfg.norm_bias) if layer_number > 0 else None
        self.attn = ModernBertAttention(ctx, layer_number, hf + "attn.")
        self.mlp_norm = ctx.layer_norm(bias=cfg.norm_bias)
        self.mlp = ModernBertMLP(ctx, hf + "mlp.")
        names = ("weight", "bias") if cfg.norm_bias else ("weight",)
        for norm in ("attn_norm", "mlp_norm") if layer_number > 0 else ("mlp_norm",):
            set_hf_names(self, {f"{norm}.{k}": f"{hf}{norm}.{k}" for k in names})
        self.out_dropout_p = cfg.attention_dropout  # transformers' out_drop after the attention's Wo
        describe_module(self, placement="layer", layer=layer_number)

    def _dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.out_dropout_p == 0.0 or not self.training:
            return residual + x
        # As BERT's layer: replicated activations draw on the default stream (the same mask
        # on every TP rank), sequence-parallel slices on the per-rank stream.
        fork = self.ctx.rng.fork() if self.ctx.sequence_parallel else contextlib.nullcontext()
        with fork:
            return ops.dropout_add(x, residual, self.out_dropout_p, True, backend=self.ctx.dropout_add_backend)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        residual = x if rows is None else x.index_select(0, rows)
        h = self.attn_norm(x) if self.attn_norm is not None else x
        x = self._dropout_add(self.attn(h, inputs, rows), residual)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEncoder(nn.Module):
    """The layers this rank holds, keyed by their global number (as BERT's TransformerBlock),
    and the final norm on the last stage."""

    def __init__(self, ctx: BuildContext, layer_ids: Sequence[int], final_norm: bool):
        super().__init__()
        self.ctx = ctx
        self.layers = nn.ModuleDict({str(i): ModernBertLayer(ctx, i) for i in layer_ids})
        self.final_norm = ctx.layer_norm(bias=ctx.config.norm_bias) if final_norm else None
        if self.final_norm is not None:
            describe_module(self.final_norm, placement="last")
            names = ("weight", "bias") if ctx.config.norm_bias else ("weight",)
            set_hf_names(self, {f"final_norm.{k}": f"model.final_norm.{k}" for k in names})
        self.full_recompute = ctx.config.recompute_granularity == "full"

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, layer_ids: Sequence[int], apply_final_norm: bool,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        for i, layer_id in enumerate(layer_ids):
            layer = self.layers[str(layer_id)]
            layer_rows = rows if i == len(layer_ids) - 1 else None
            if self.full_recompute and self.training:
                x = checkpoint(layer, self.ctx.rng, x, inputs, layer_rows)
            else:
                x = layer(x, inputs, layer_rows)
        if apply_final_norm and self.final_norm is not None:
            x = self.final_norm(x)
        return x
