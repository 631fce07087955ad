"""Attention over the real tokens of a batch (varlen): Q, K, V as [T, heads, d] with
`cu_seqlens`, no padding anywhere (issue 31).

Padded attention spends its scores, mask, softmax, dropout mask and second matmul on
[b, heads, s, s], padding included; at seq 512 on real data that is most of the step. Here
sequence i is tokens cu_seqlens[i] .. cu_seqlens[i + 1] of the unpadded encoder's [T, h]
activations, as FlashAttention's varlen form takes them. One implementation per device:

- CPU: megabert's fused kernel (fp32, bf16, fp64): per (sequence, head) an online-softmax
  forward saving logsumexp, a backward that recomputes the probabilities from it, and the
  attention dropout drawn inside both from Philox (no mask tensor, no bernoulli_).
- CUDA: FlashAttention's varlen kernel (aten._flash_attention_forward / _backward, the
  kernel torch.nn.attention.varlen.varlen_attn calls, which it calls with dropout 0 only)
  where it applies (fp16/bf16, head dim a multiple of 8 up to 256, a GPU of compute
  capability 8.0 or newer), its attention dropout drawn inside the kernel from Philox; else
  (fp32, other head dims) one padded SDPA call with a key padding mask: the padded path's
  cost, which SDPA grouped by length (one call per distinct length) measured 3x over.
- Anything else (the CPU in another dtype, unbuilt kernels): SDPA over the sequences
  grouped by length (no mask).
The choice is a function of device, dtype and head dim, logged once per outcome.

A sliding window (`window=(left, right)`: query i sees keys i - left .. i + right of its
sequence, -1 = unbounded, FlashAttention's window_size) is honoured by every path: the CPU
kernel and FlashAttention skip the key tiles outside it (a local layer costs O(T * window)),
the SDPA paths add a band to their mask.

The CPU kernel's dropout key is one int64 drawn per call from the generator the call runs
under (the per-TP-rank stream inside `rng_fork()`), exactly as dropout_add draws its key:
torch.manual_seed, TP-rank streams, activation recompute (which restores the streams) and
checkpoints that save the generators reproduce the masks. The keep bit of (sequence, head,
query, key) depends only on the key and those indices, never on threads. The CUDA kernel
takes its Philox seed and offset from the CUDA generator the call runs under (the same
stream, swapped in by `rng_fork()`), and backward regenerates the mask from the state that
forward returned, so the same guarantees hold there.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megabert.ops import kernel_ops
from megabert.ops.compile_hints import assume_constant_result
from megabert.ops.dispatch import CPU_KERNEL_DTYPES, say_once, use_fused_kernel
from megabert.ops.dropout_add import draw_seed

# FlashAttention 2's limits: half types, head dims that are multiples of 8 up to 256, Ampere
# or newer.
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


class FusedVarlenAttention(torch.autograd.Function):
    """out = softmax(scale * Q K^T) with dropout, times V, per sequence and head, within the
    window (left, right), on the CPU kernel. Forward saves Q, K, V (the packed input), the
    output and logsumexp [heads, T] (fp32): O(T) statistics instead of O(b s^2) probabilities
    and a mask."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, p: float,
                seed: Optional[torch.Tensor], window_left: int = -1, window_right: int = -1) -> torch.Tensor:
        q, k, v = qkv.unbind(1)
        out, lse = kernel_ops.varlen_attention_forward(q, k, v, cu_seqlens, scale, p, seed, window_left,
                                                       window_right)
        ctx.save_for_backward(qkv, out, lse, cu_seqlens, seed)
        ctx.scale, ctx.p, ctx.window = scale, p, (window_left, window_right)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        qkv, out, lse, cu_seqlens, seed = ctx.saved_tensors
        q, k, v = qkv.unbind(1)
        grad_qkv = kernel_ops.varlen_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens, ctx.scale, ctx.p,
                                                        seed, *ctx.window)
        return grad_qkv, None, None, None, None, None, None


class FlashVarlenAttention(torch.autograd.Function):
    """FlashAttention's varlen kernel with attention dropout inside it. Forward:
    aten._flash_attention_forward over q, k, v [T, heads, d] and cu_seqlens (int32), which
    draws its Philox seed and offset from the current CUDA generator and returns them; it saves
    Q, K, V, the output, logsumexp [heads, T] and that state. Backward:
    aten._flash_attention_backward, which regenerates the same keep mask from the saved state.
    (The 3rd and 4th outputs are (rng_state, unused) in recent torch and (philox_seed,
    philox_offset) in older releases; backward takes them positionally either way.)"""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                scale: float, p: float, window_left: int = -1, window_right: int = -1) -> torch.Tensor:
        # window_size_left / _right: FlashAttention's window_size (-1 = unbounded), which skips
        # the key blocks outside the window.
        out, lse, rng_a, rng_b, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, p, False, False, scale=scale,
            window_size_left=window_left, window_size_right=window_right)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_a, rng_b)
        ctx.max_len, ctx.scale, ctx.p, ctx.window = max_len, scale, p, (window_left, window_right)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, cu_seqlens, rng_a, rng_b = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, ctx.max_len, ctx.max_len, ctx.p, False,
            rng_a, rng_b, scale=ctx.scale, window_size_left=ctx.window[0], window_size_right=ctx.window[1])
        return dq, dk, dv, None, None, None, None, None, None


def flash_varlen_available() -> bool:
    """Whether this torch was built with FlashAttention and the current GPU runs it (compute
    capability 8.0 or newer)."""
    if not (torch.cuda.is_available() and torch.backends.cuda.is_flash_attention_available()):
        return False
    return torch.cuda.get_device_capability()[0] >= 8


def choose_varlen_impl(device_type: str, dtype: torch.dtype, head_dim: int, cpu_kernel_reason: Optional[str],
                       flash_available: bool) -> tuple[str, Optional[str]]:
    """('fused' | 'flash' | 'padded' | 'grouped_sdpa', why not the device's fast path or None).
    `cpu_kernel_reason`: why the CPU kernel does not apply (None when it does)."""
    if device_type == "cpu":
        return ("fused", None) if cpu_kernel_reason is None else ("grouped_sdpa", cpu_kernel_reason)
    if device_type != "cuda":
        return "grouped_sdpa", f"{device_type} tensors (varlen kernels exist for cpu and cuda)"
    if not flash_available:
        return "padded", (f"this torch ({torch.__version__}) or GPU has no FlashAttention (it needs a "
                                f"FlashAttention build of torch and compute capability 8.0 or newer)")
    if dtype not in _FLASH_DTYPES:
        return "padded", f"{str(dtype).removeprefix('torch.')} (FlashAttention takes float16 and bfloat16)"
    if head_dim % 8 or head_dim > _FLASH_MAX_HEAD_DIM:
        return "padded", (f"head dim {head_dim} (FlashAttention takes multiples of 8 up to "
                                f"{_FLASH_MAX_HEAD_DIM})")
    return "flash", None


# NOTE: as dispatch.use_fused_kernel: under torch.compile the answer is a constant of the
# graph and the log line is said for real; it depends only on the arguments and on which
# extensions loaded.
@assume_constant_result
def varlen_impl(device_type: str, dtype: torch.dtype, head_dim: int) -> str:
    """The implementation a call runs ('fused', 'flash', 'padded' or 'grouped_sdpa'), said once
    per outcome: at INFO for the device's kernel and for 'padded' (what CUDA runs in fp32 under
    `--attention-backend auto`), at WARNING for 'grouped_sdpa'."""
    cpu_reason = None
    if device_type == "cpu":
        cpu_reason = _cpu_dtype_reason(dtype)
        if not use_fused_kernel("varlen_attention", device_type, cpu_reason):
            cpu_reason = cpu_reason or "unbuilt CPU kernels"
    impl, reason = choose_varlen_impl(device_type, dtype, head_dim, cpu_reason,
                                      device_type == "cuda" and flash_varlen_available())
    if device_type != "cpu":
        level = logging.WARNING if impl == "grouped_sdpa" else logging.INFO
        say_once(("varlen_attention", device_type, impl, reason), level,
                 "varlen attention on %s: %s%s", device_type, impl, "" if reason is None else f" ({reason})")
    return impl


def _cpu_dtype_reason(dtype: torch.dtype) -> Optional[str]:
    if dtype in CPU_KERNEL_DTYPES:
        return None
    names = ", ".join(str(d).removeprefix("torch.") for d in CPU_KERNEL_DTYPES)
    return f"{str(dtype).removeprefix('torch.')} on cpu (the kernel takes {names})"


def band(n: int, window: tuple[int, int], device) -> Optional[torch.Tensor]:
    """bool [n, n], True = query i may see key j (i - left <= j <= i + right; -1 = unbounded),
    or None when the window bounds nothing."""
    left, right = window
    if (left < 0 or left >= n) and (right < 0 or right >= n):
        return None
    offset = torch.arange(n, device=device)[None, :] - torch.arange(n, device=device)[:, None]  # j - i
    keep = torch.ones(n, n, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= offset >= -left
    if right >= 0:
        keep &= offset <= right
    return keep


def grouped_sdpa(qkv: torch.Tensor, cu_seqlens: list[int], dropout_p: float,
                 window: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """Varlen attention as one SDPA call per distinct sequence length: the sequences of a
    length gathered to [g, heads, L, d] with no mask but the window's band (so SDPA may take
    its flash kernel), the outputs put back in token order. qkv: [T, 3, heads, d] -> [T, heads, d]."""
    total, _, heads, d = qkv.shape
    by_length: dict[int, list[int]] = {}
    for i in range(len(cu_seqlens) - 1):
        length = cu_seqlens[i + 1] - cu_seqlens[i]
        if length > 0:
            by_length.setdefault(length, []).append(cu_seqlens[i])
    outputs, order = [], []
    for length, starts in by_length.items():
        positions = [start + j for start in starts for j in range(length)]
        index = torch.tensor(positions, dtype=torch.int64, device=qkv.device)
        group = qkv.index_select(0, index).view(len(starts), length, 3, heads, d)
        q, k, v = group.permute(2, 0, 3, 1, 4).unbind(0)  # each [g, heads, L, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=band(length, window, qkv.device), dropout_p=dropout_p)
        outputs.append(out.transpose(1, 2).reshape(len(starts) * length, heads, d))
        order.extend(positions)
    if not outputs:
        return qkv.new_empty((total, heads, d))
    # Token i of the concatenation came from position order[i]: invert that permutation.
    inverse = torch.empty(total, dtype=torch.int64)
    inverse[torch.tensor(order, dtype=torch.int64)] = torch.arange(total)
    return torch.cat(outputs).index_select(0, inverse.to(qkv.device))


def padded_sdpa(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, dropout_p: float,
                window: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """Varlen attention as one padded SDPA call: the n sequences laid out as [n, heads,
    max_len, d] with a key padding mask, the real rows taken back. What CUDA runs where
    FlashAttention does not apply (fp32, odd head dims): the padded path's cost, with no host
    work beyond `max_len`. qkv: [T, 3, heads, d] -> [T, heads, d]."""
    total, _, heads, d = qkv.shape
    n = cu_seqlens.numel() - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(n, device=qkv.device), lengths, output_size=total)
    rows = torch.arange(total, device=qkv.device) - cu_seqlens[seq] + seq * max_len  # token -> row of [n * max_len]
    padded = qkv.new_zeros(n * max_len, 3, heads, d).index_copy(0, rows, qkv)
    q, k, v = padded.view(n, max_len, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)  # each [n, heads, s, d]
    # True = attend. An empty sequence attends to its zero padding: finite rows no token reads.
    keep = (torch.arange(max_len, device=qkv.device)[None, :] < lengths[:, None]) | (lengths == 0)[:, None]
    keep = keep[:, None, None, :]  # [n, 1, 1, s]
    local = band(max_len, window, qkv.device)
    if local is not None:
        keep = keep & local  # [n, 1, s, s]: every row keeps its own key, so none is empty
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(n * max_len, heads, d).index_select(0, rows)


def varlen_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, host_cu_seqlens: Callable[[], list[int]], *,
                     dropout_p: float = 0.0, rng_fork=None, max_seqlen: Optional[int] = None,
                     window: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V over each sequence's own tokens.

    qkv: [T, 3, heads, d] (Q, K, V of each token's heads; a view of the QKV GEMM's output);
    cu_seqlens: int64 [n + 1] on qkv's device, sequence i is tokens cu_seqlens[i] ..
    cu_seqlens[i + 1]; `host_cu_seqlens()` the same as a list (called only by the paths that
    need it on the host: one device sync per call on a GPU unless the caller caches it).
    `rng_fork()`: the context dropout draws in (the per-TP-rank stream). `max_seqlen`: a bound
    on the sequence lengths known on the host (packed rows: the row length), so that the CUDA
    paths read nothing back from the device. `window` (left, right): query i sees keys
    i - left .. i + right of its sequence (-1 = unbounded; ModernBERT's local layers: (w, w)).
    -> [T, heads, d].
    """
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"varlen attention: window {window} must hold -1 (unbounded) or key counts >= 0")
    fork = rng_fork if rng_fork is not None and dropout_p > 0.0 else contextlib.nullcontext
    head_dim = qkv.size(-1)
    impl = varlen_impl(qkv.device.type, qkv.dtype, head_dim)
    if impl == "fused":
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"varlen attention: dropout p must be in [0, 1), got {dropout_p}")
        seed = None
        if dropout_p > 0.0:
            with fork():
                seed = draw_seed()
        return FusedVarlenAttention.apply(qkv, cu_seqlens, 1.0 / math.sqrt(head_dim), float(dropout_p), seed, left,
                                          right)
    if impl in ("flash", "padded"):
        if max_seqlen is not None:
            max_len = max_seqlen
        else:
            host = host_cu_seqlens()
            max_len = max((b - a for a, b in zip(host, host[1:])), default=0)
        with fork():
            if impl == "padded":
                return padded_sdpa(qkv, cu_seqlens, max_len, dropout_p, window)
            q, k, v = qkv.unbind(1)
            return FlashVarlenAttention.apply(q, k, v, cu_seqlens.to(torch.int32), max_len,
                                              1.0 / math.sqrt(head_dim), float(dropout_p), left, right)
    with fork():
        return grouped_sdpa(qkv, host_cu_seqlens(), dropout_p, window)
