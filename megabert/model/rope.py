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

`attention_input` makes the attention's input from the QKV GEMM's output (or, grouped-query,
the Q and KV GEMMs'): PyTorch's `grouped_qkv` and `rotate_qkv`, or on the CPU one fused kernel
pass each way (FusedRotaryQKV; docs/performance.md has the figures).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from megabert.ops import kernel_ops
from megabert.ops.dispatch import CPU_KERNEL_DTYPES, dtype_outside, use_fused_kernel


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


def grouped_qkv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """q [..., heads, d] and kv [..., 2, kv_heads, d] -> [..., 3, heads, d]: query head h beside
    key/value head h // (heads / kv_heads) (grouped-query attention), in PyTorch."""
    kv = kv.repeat_interleave(q.size(-2) // kv.size(-2), dim=-2)
    return torch.cat((q.unsqueeze(-3), kv), dim=-3)


class FusedRotaryQKV(torch.autograd.Function):
    """The CPU kernel (fused_kernels/csrc/cpu/rope_kernels.h): what `grouped_qkv` then
    `rotate_qkv` make, in one pass each way. x: qkv [rows, 3, heads, d] with kv None, or q
    [rows, heads, d] with kv [rows, 2, kv_heads, d] (strided views of the GEMMs' outputs);
    cos, sin [rows, d/2]. -> [rows, 3, heads, d]. Backward writes the grads of q, k and v into
    one buffer (k's and v's summed over each group), no autograd sums or splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kv: Optional[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        ctx.packed = kv is None
        q, kv = (x.select(1, 0), x.narrow(1, 1, 2)) if ctx.packed else (x, kv)
        ctx.kv_heads = kv.size(2)
        ctx.save_for_backward(cos, sin)
        return kernel_ops.rope_qkv_forward(q, kv, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        grads = kernel_ops.rope_qkv_backward(grad, cos, sin, ctx.kv_heads)  # [rows, heads + 2 kv_heads, d]
        if ctx.packed:  # MHA: the grad of qkv as it is
            return grads.view(grad.shape), None, None, None
        heads = grad.size(2)
        return grads[:, :heads], grads[:, heads:].unflatten(1, (2, ctx.kv_heads)), None, None


def _outside_limits(q: torch.Tensor, kv: Optional[torch.Tensor], cos: torch.Tensor) -> Optional[str]:
    if q.device.type != "cpu":
        return f"a {q.device.type} tensor (the fused RoPE is a CPU kernel)"
    dtypes = {q.dtype, cos.dtype} | ({kv.dtype} if kv is not None else set())
    if len(dtypes) > 1:
        return f"RoPE over {', '.join(sorted(map(str, dtypes)))} tensors (the kernel takes one dtype)"
    return dtype_outside(q, {"cpu": CPU_KERNEL_DTYPES})


def attention_input(q: torch.Tensor, kv: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                    backend: str = "fused") -> torch.Tensor:
    """The attention's input [..., 3, heads, d] with Q and K rotated by (cos, sin) [..., 1, d]
    (RotaryTables.get) and V as it is, from q = qkv [..., 3, heads, d] with kv None, or, with
    grouped-query attention, q [..., heads, d] and kv [..., 2, kv_heads, d] (each query head
    reads its group's key/value head, as `grouped_qkv`). With `backend` 'fused' the CPU kernel
    runs where it applies (else PyTorch, said once); any other backend runs PyTorch's
    `grouped_qkv` and `rotate_qkv`. Autograd-capable."""
    if backend != "fused" or not use_fused_kernel("rope_qkv", q.device.type, _outside_limits(q, kv, cos)):
        return rotate_qkv(q if kv is None else grouped_qkv(q, kv), cos, sin)
    lead = q.shape[:-3] if kv is None else q.shape[:-2]  # [T] unpadded, [s, b] padded
    rows, half = math.prod(lead), q.size(-1) // 2
    x = q.reshape(rows, *q.shape[len(lead):])
    kv = None if kv is None else kv.reshape(rows, *kv.shape[len(lead):])
    cos, sin = (t[..., 0, :half].expand(*lead, half).reshape(rows, half) for t in (cos, sin))
    out = FusedRotaryQKV.apply(x, kv, cos, sin)
    return out.view(*lead, *out.shape[1:])


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
