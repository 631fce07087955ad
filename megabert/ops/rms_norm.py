"""rms_norm front end: the fused CPU kernel when it applies, else PyTorch's chain.

RMSNorm as transformers' Llama-family models compute it (EuroBERT, UltraBERT): fp32 math, the
normalised value cast back to the input's dtype before the weight multiplies it. PyTorch runs
that as eight elementwise ops forward and more backward, each a pass over the activation; the
kernel is one pass each way and saves only the per-row 1/rms (issue 50, item 7).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from megabert.ops import kernel_ops
from megabert.ops.dispatch import CPU_KERNEL_DTYPES, dtype_outside, use_fused_kernel
from megabert.ops.reference import rms_norm_reference


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm over the last dim with a weight. Forward saves the input, the weight and the
    per-row 1/rms (fp32 for 16-bit inputs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        weight = weight.contiguous()
        y, rstd = kernel_ops.rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = kernel_ops.rms_norm_backward(grad_y, x, weight, rstd)
        return grad_x, grad_weight, None


def _outside_limits(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    if x.dim() == 0 or weight.shape != (x.size(-1),):
        return f"RMSNorm of input {tuple(x.shape)} with weight {tuple(weight.shape)}"
    if weight.dtype != x.dtype:
        # PyTorch's chain then multiplies in the promoted dtype (a bf16 input with an fp32
        # weight gives fp32): a dtype pair the kernel does not take.
        return f"RMSNorm of a {x.dtype} input with a {weight.dtype} weight (the kernel takes one dtype)"
    if x.device.type != "cpu":
        return f"a {x.device.type} tensor (the fused RMSNorm is a CPU kernel)"
    return dtype_outside(x, {"cpu": CPU_KERNEL_DTYPES})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x ([s, b, h] or any leading dims), as
    `megabert.ops.reference.rms_norm_reference`. Autograd-capable (grads for x and weight)."""
    if not use_fused_kernel("rms_norm", x.device.type, _outside_limits(x, weight)):
        return rms_norm_reference(x, weight, eps)
    return FusedRMSNorm.apply(x, weight, float(eps))
