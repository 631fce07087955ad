"""The fused kernels as torch.library custom ops (`torch.ops.megabert.*`).

The pybind11 functions of `megabert.fused_kernels` are opaque to torch.compile: dynamo
cannot trace them and breaks the graph around every call. As custom ops with a fake
(meta) implementation they stay in the graph as single nodes, so `--compile` and the
fused backends combine. The autograd Functions in `ops/` call the public functions of this
file: the custom op while dynamo traces, the pybind11 function itself in eager mode.

NOTE: a custom op costs ~20 us of dispatch per call in eager mode against ~3 us for the
pybind11 call (measured on the CPU), which would show in a GPU step bound by launches;
hence the two routes to the same kernel.

Each op picks the compiled module for its input's device when it runs (the front ends
have already checked that the kernel applies to the call).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from megabert import fused_kernels


def _kernels(x: torch.Tensor):
    kernels = fused_kernels.kernels_for(x.device.type)
    if kernels is None:  # the front ends check first: reaching this is a bug, not a user error
        raise RuntimeError(f"no megabert kernels for {x.device.type} tensors: {fused_kernels.load_error(x.device.type)}")
    return kernels


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    # LayerNorm statistics in the kernels' math type: fp64 for fp64 input, else fp32.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _kernel_op(name: str, kernel_call: Callable, fake: Callable):
    """`kernel_call` as the custom op `torch.ops.megabert.<name>` (`fake` gives its outputs'
    shapes to the tracer), and the front end the autograd Functions call: the custom op while
    dynamo traces, `kernel_call` itself in eager mode (the module docstring says why).
    -> (op, front end)."""
    op = torch.library.custom_op(f"megabert::{name}", kernel_call, mutates_args=())
    op.register_fake(fake)

    @functools.wraps(kernel_call)
    def front_end(*args):
        return op(*args) if torch.compiler.is_compiling() else kernel_call(*args)

    return op, front_end


def _contiguous_like(arg: int) -> Callable:
    """A fake whose one output is shaped and typed as argument `arg`, contiguous."""
    return lambda *args: torch.empty_like(args[arg], memory_format=torch.contiguous_format)


def _scaled_masked_softmax_forward(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """scores: [b, heads, sq, sk] contiguous; mask: bool expanded to the scores' shape
    (a view), last dim contiguous. -> probs, contiguous, the scores' dtype."""
    return _kernels(scores).scaled_masked_softmax_forward(scores, mask, scale)


def _scaled_masked_softmax_backward(grad_probs: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """-> grad of the scores, contiguous."""
    return _kernels(probs).scaled_masked_softmax_backward(grad_probs.contiguous(), probs, scale)


_scaled_masked_softmax_forward_op, scaled_masked_softmax_forward = _kernel_op(
    "scaled_masked_softmax_forward", _scaled_masked_softmax_forward, _contiguous_like(0))
_scaled_masked_softmax_backward_op, scaled_masked_softmax_backward = _kernel_op(
    "scaled_masked_softmax_backward", _scaled_masked_softmax_backward, _contiguous_like(1))


def _layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim -> (y, mean [rows], rstd [rows]); statistics in fp32
    (fp64 for fp64 input)."""
    return tuple(_kernels(x).layer_norm_forward(x.contiguous(), weight.contiguous(), bias.contiguous(), eps))


def _layer_norm_forward_fake(x, weight, bias, eps):
    rows = x.numel() // x.size(-1) if x.size(-1) else 0
    stats = x.new_empty((rows,), dtype=_stat_dtype(x))
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


def _layer_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (grad_x, grad_weight, grad_bias)."""
    return tuple(_kernels(x).layer_norm_backward(grad_y.contiguous(), x, weight, mean, rstd))


def _layer_norm_backward_fake(grad_y, x, weight, mean, rstd):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            torch.empty_like(weight))


_layer_norm_forward_op, layer_norm_forward = _kernel_op(
    "layer_norm_forward", _layer_norm_forward, _layer_norm_forward_fake)
_layer_norm_backward_op, layer_norm_backward = _kernel_op(
    "layer_norm_backward", _layer_norm_backward, _layer_norm_backward_fake)


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim -> (y, rstd [rows]); rstd in fp32 (fp64 for fp64 input)."""
    return tuple(_kernels(x).rms_norm_forward(x.contiguous(), weight.contiguous(), eps))


def _rms_norm_forward_fake(x, weight, eps):
    rows = x.numel() // x.size(-1) if x.size(-1) else 0
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((rows,), dtype=_stat_dtype(x))


def _rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (grad_x, grad_weight)."""
    return tuple(_kernels(x).rms_norm_backward(grad_y.contiguous(), x, weight, rstd))


def _rms_norm_backward_fake(grad_y, x, weight, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


_rms_norm_forward_op, rms_norm_forward = _kernel_op("rms_norm_forward", _rms_norm_forward, _rms_norm_forward_fake)
_rms_norm_backward_op, rms_norm_backward = _kernel_op("rms_norm_backward", _rms_norm_backward,
                                                      _rms_norm_backward_fake)


def _gated_activation_forward(u: torch.Tensor, activation: str, gate_first: bool) -> torch.Tensor:
    """act(input) * gate from u [..., 2f] = [input; gate] ([gate; input] with gate_first) -> [..., f];
    activation: silu, gelu (erf) or gelu_tanh."""
    return _kernels(u).gated_activation_forward(u.contiguous(), activation, gate_first)


def _gated_activation_forward_fake(u, activation, gate_first):
    return u.new_empty((*u.shape[:-1], u.size(-1) // 2))


def _gated_activation_backward(grad_y: torch.Tensor, u: torch.Tensor, activation: str,
                               gate_first: bool) -> torch.Tensor:
    """-> grad_u [..., 2f], both halves."""
    return _kernels(u).gated_activation_backward(grad_y.contiguous(), u, activation, gate_first)


_gated_activation_forward_op, gated_activation_forward = _kernel_op(
    "gated_activation_forward", _gated_activation_forward, _gated_activation_forward_fake)
_gated_activation_backward_op, gated_activation_backward = _kernel_op(
    "gated_activation_backward", _gated_activation_backward, _contiguous_like(1))


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as the kernel reads them: rows contiguous, one row stride for both."""
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        return cos.contiguous(), sin.contiguous()
    return cos, sin


def _rope_qkv_forward(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [rows, heads, d], kv [rows, 2, kv_heads, d] (views with any row and head strides), cos, sin
    [rows, d/2] -> the attention's input [rows, 3, heads, d]: Q and K rotated, each query head
    beside key/value head h // (heads / kv_heads)."""
    q, kv = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, kv))
    return _kernels(q).rope_qkv_forward(q, kv, *_rope_tables(cos, sin))


def _rope_qkv_forward_fake(q, kv, cos, sin):
    return q.new_empty((q.size(0), 3, q.size(1), q.size(2)))


def _rope_qkv_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """-> [rows, heads + 2 kv_heads, d]: each row's grads of q, then of k and v (summed over each group)."""
    return _kernels(grad).rope_qkv_backward(grad.contiguous(), *_rope_tables(cos, sin), kv_heads)


def _rope_qkv_backward_fake(grad, cos, sin, kv_heads):
    return grad.new_empty((grad.size(0), grad.size(2) + 2 * kv_heads, grad.size(3)))


_rope_qkv_forward_op, rope_qkv_forward = _kernel_op("rope_qkv_forward", _rope_qkv_forward, _rope_qkv_forward_fake)
_rope_qkv_backward_op, rope_qkv_backward = _kernel_op("rope_qkv_backward", _rope_qkv_backward,
                                                      _rope_qkv_backward_fake)


def _dropout_add_forward(x: torch.Tensor, residual: torch.Tensor, p: float,
                         seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + keep * x / (1 - p), keep from Philox keyed by `seed` (one int64) -> (out, keep: bool)."""
    return tuple(_kernels(x).dropout_add_forward(x.contiguous(), residual.contiguous(), p, seed))


def _dropout_add_forward_fake(x, residual, p, seed):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, dtype=torch.bool, memory_format=torch.contiguous_format))


def _dropout_backward(grad: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """-> keep * grad / (1 - p)."""
    return _kernels(grad).dropout_backward(grad.contiguous(), mask, p)


_dropout_add_forward_op, dropout_add_forward = _kernel_op(
    "dropout_add_forward", _dropout_add_forward, _dropout_add_forward_fake)
_dropout_backward_op, dropout_backward = _kernel_op("dropout_backward", _dropout_backward, _contiguous_like(0))


# ---------------------------------------------------------------- varlen attention (CPU)
# window_left / window_right: query i sees keys i - left .. i + right of its sequence
# (FlashAttention's window_size; -1 = unbounded on that side).

def _varlen_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              scale: float, p: float, seed: Optional[torch.Tensor], window_left: int = -1,
                              window_right: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v: [T, heads, d] (heads adjacent, token stride free) -> (out [T, heads, d], lse [heads, T])."""
    return tuple(_kernels(q).varlen_attention_forward(q, k, v, cu_seqlens, scale, p, seed, window_left, window_right))


def _varlen_attention_forward_fake(q, k, v, cu_seqlens, scale, p, seed, window_left=-1, window_right=-1):
    return q.new_empty(q.shape), q.new_empty((q.size(1), q.size(0)), dtype=_stat_dtype(q))


def _varlen_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                               p: float, seed: Optional[torch.Tensor], window_left: int = -1,
                               window_right: int = -1) -> torch.Tensor:
    """-> grad of the packed [T, 3, heads, d] q, k, v."""
    return _kernels(q).varlen_attention_backward(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, scale, p, seed,
                                                 window_left, window_right)


def _varlen_attention_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens, scale, p, seed, window_left=-1,
                                    window_right=-1):
    return q.new_empty((q.size(0), 3, q.size(1), q.size(2)))


_varlen_attention_forward_op, varlen_attention_forward = _kernel_op(
    "varlen_attention_forward", _varlen_attention_forward, _varlen_attention_forward_fake)
_varlen_attention_backward_op, varlen_attention_backward = _kernel_op(
    "varlen_attention_backward", _varlen_attention_backward, _varlen_attention_backward_fake)
