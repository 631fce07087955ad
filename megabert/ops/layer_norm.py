"""layer_norm front end (the fused kernel when it applies, else PyTorch) and backend resolution."""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from megabert.ops import kernel_ops
from megabert.ops.dispatch import CPU_KERNEL_DTYPES, CUDA_KERNEL_DTYPES, dtype_outside, resolve_backend, use_fused_kernel
from megabert.ops.reference import layer_norm_reference


def resolve_layernorm_backend(backend: str, device_type: str = "cpu") -> str:
    """'auto' -> 'fused' on the CPU when its kernels are built, else 'torch' (on CUDA
    always 'torch'; see dispatch.resolve_backend). Logged once per choice."""
    return resolve_backend("layernorm", "--layernorm-backend", backend, "torch", device_type)


# What the kernels take. CUDA: one block per row holds the row in registers, hence the width limit.
_DTYPES = {"cpu": CPU_KERNEL_DTYPES, "cuda": CUDA_KERNEL_DTYPES}
_MAX_HIDDEN = {"cuda": 8192}


class FusedLayerNorm(torch.autograd.Function):
    """LayerNorm over the last dim with weight and bias.

    Forward saves the input, the weight and the per-row mean and 1/std (fp32 for 16-bit
    inputs), so the backward needs no second reduction over the input for them.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        weight = weight.contiguous()
        y, mean, rstd = kernel_ops.layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = kernel_ops.layer_norm_backward(grad_y, x, weight, mean, rstd)
        return grad_x, grad_weight, grad_bias, None


def _outside_limits(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> Optional[str]:
    if weight is None or bias is None:
        return "LayerNorm without weight or bias"
    if x.dim() == 0 or weight.shape != (x.size(-1),) or bias.shape != (x.size(-1),):
        return f"input {tuple(x.shape)} with weight {tuple(weight.shape)}, bias {tuple(bias.shape)}"
    if weight.dtype != x.dtype or bias.dtype != x.dtype:
        return f"{weight.dtype} weight / {bias.dtype} bias with a {x.dtype} input (the kernel takes one dtype)"
    max_hidden = _MAX_HIDDEN.get(x.device.type)
    if max_hidden is not None and x.size(-1) > max_hidden:
        return f"hidden size {x.size(-1)} on {x.device.type} (the kernel takes up to {max_hidden})"
    return dtype_outside(x, _DTYPES)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of x ([s, b, h] or any leading dims). Autograd-capable
    (grads for x, weight and bias); fp32 math for 16-bit inputs, output in x's dtype."""
    if not use_fused_kernel("layer_norm", x.device.type, _outside_limits(x, weight, bias)):
        return layer_norm_reference(x, weight, bias, eps)
    return FusedLayerNorm.apply(x, weight, bias, float(eps))
