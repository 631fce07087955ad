"""Rotary position embeddings (Su et al. 2021), rotate-half layout, as transformers' RoPE
families apply them.

Each layer type may rotate with its own base (EncoderSpec.attention.rope_theta: ModernBERT's
global and local layers, UltraBERT's full and sliding ones). In the padded [s, b] layout a
token's position is its slot in the row, as transformers counts; in the unpadded [T] one it is
the token's offset from its sequence's start in cu_seqlens, so that once samples are packed
into a row each sample starts at 0.
NOTE: with right padding (what ModernBERT's tokenizer does) the two agree; with left padding
the unpadded layout counts from the first real token and transformers from the row's start.

The numbers follow transformers' ModernBertRotaryEmbedding and apply_rotary_pos_emb: the
angles in fp32, cos/sin cast to the activations' dtype, the rotation in fp32, the result
cast back.
"""
from __future__ import annotations


import torch


def inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """[d/2]: 1 / theta^(2i/d)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """positions [...] (int) -> cos, sin [..., d] in `dtype` (each half of d repeats the angles)."""
    freqs = positions[..., None].float() * inverse_frequencies(head_dim, theta, positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated by angles whose cos/sin broadcast to it; fp32 math, x's dtype out."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class RotaryQKV(torch.autograd.Function):
    """qkv [..., 3, heads, d] -> a new [..., 3, heads, d] with Q and K rotated (as `rotate`)
    and V copied: the attention's input in one buffer. The rotation of a half-split pair
    (x1, x2) is (x1 cos - x2 sin, x2 cos + x1 sin), so forward and backward are four fused
    multiply-adds over the halves of Q and K and one copy of V, where `rotate` twice and a
    stack made about fifteen passes over [T, heads, d] tensors (chunk, neg, cat, mul, add,
    stack and their backward). Forward + backward at T = 1415, 4 heads of 64, 2 cores:
    1.6-1.9 ms against 2.7-3.4 ms on a quiet machine; under load (each small op's fork
    preempted) 1.4 ms against 25 ms (minimum of 7).
    cos, sin: the tables' first halves, broadcast to [..., 1, d/2]."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_pairs(qkv, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_pairs(grad, cos, sin, -1.0), None, None  # the transpose: rotate back


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """Q and K of x [..., 3, heads, d] rotated by +-angle (fp32 math, fp64 for fp64; x's dtype
    out), V copied."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half = x.size(-1) // 2
    math_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    qk = x.narrow(-3, 0, 2).to(math_dtype)  # a view in the math type
    x1, x2 = qk[..., :half], qk[..., half:]
    cos, sin = cos.unsqueeze(-3).to(math_dtype), sin.unsqueeze(-3).to(math_dtype)  # [..., 1, 1, d/2]
    if x.dtype == math_dtype:
        o = out.narrow(-3, 0, 2)
        o1, o2 = o[..., :half], o[..., half:]
        torch.mul(x1, cos, out=o1)
        o1.addcmul_(x2, sin, value=-sign)
        torch.mul(x2, cos, out=o2)
        o2.addcmul_(x1, sin, value=sign)
    else:
        out.narrow(-3, 0, 2).copy_(torch.cat((x1 * cos - sign * x2 * sin, x2 * cos + sign * x1 * sin), -1))
    out.select(-3, 2).copy_(x.select(-3, 2))
    return out


def rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qkv [..., 3, heads, d] with Q and K rotated by (cos, sin) [..., 1, d] as `rotate`
    does, V as it is, in one new tensor."""
    half = qkv.size(-1) // 2
    return RotaryQKV.apply(qkv, cos[..., :half], sin[..., :half])


def unpadded_positions(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T]: each token's offset within its sequence (sequence i is tokens cu_seqlens[i] ..
    cu_seqlens[i + 1])."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=num_tokens)
    return torch.arange(num_tokens, device=cu_seqlens.device) - starts


def padded_positions(s: int, b: int, device) -> torch.Tensor:
    """[s, b]: each slot's index in its row, as transformers counts (padding slots too)."""
    return torch.arange(s, device=device)[:, None].expand(s, b)


class RotaryTables:
    """cos/sin of one micro-batch for every RoPE base, made on first use and read by every
    layer (O(tokens x d) once, not per layer). `positions`: [T] unpadded or [s, b] padded."""

    def __init__(self, positions: torch.Tensor, head_dim: int):
        self.positions, self.head_dim = positions, head_dim
        self._tables: dict = {}

    def get(self, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [..., 1, d] in `dtype` (the activations'): broadcast over [..., heads, d]."""
        key = (theta, dtype)
        if key not in self._tables:
            cos, sin = cos_sin(self.positions, self.head_dim, theta, dtype)
            self._tables[key] = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return self._tables[key]
