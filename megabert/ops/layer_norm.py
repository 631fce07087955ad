"""layer_norm front end (the fused CPU kernel when it applies, else PyTorch) and backend resolution.

The kernel is the CPU's only. On CUDA PyTorch's LayerNorm runs: our CUDA kernel measured
0.70-0.73x of `F.layer_norm` forward + backward on H100 and H200 at both BERT shapes, in
fp32, bf16 and fp16 (docs/performance.md), and was deleted (issue 41: it wins or goes).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from megabert.errors import ConfigError
from megabert.ops import kernel_ops
from megabert.ops.dispatch import CPU_KERNEL_DTYPES, dtype_outside, resolve_backend, use_fused_kernel
from megabert.ops.reference import layer_norm_reference


def resolve_layernorm_backend(backend: str, device_type: str = "cpu") -> str:
    """'auto' -> 'fused' on the CPU when its kernels are built, else 'torch'; on any other
    device 'auto' is 'torch' and 'fused' an error (there is no kernel). Logged once per choice."""
    if backend == "fused" and device_type != "cpu":
        raise ConfigError(f"--layernorm-backend fused: the fused LayerNorm is a CPU kernel (on CUDA PyTorch's "
                          f"LayerNorm is faster: docs/performance.md); on {device_type} use --layernorm-backend "
                          f"auto or torch")
    return resolve_backend("layernorm", "--layernorm-backend", backend, "torch", device_type)


# What the kernel takes: fp32 and bf16 with fp32 math, fp64 with fp64 math (for gradcheck).
_DTYPES = {"cpu": CPU_KERNEL_DTYPES}


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
    if x.device.type != "cpu":
        return f"a {x.device.type} tensor (the fused LayerNorm is a CPU kernel)"
    return dtype_outside(x, _DTYPES)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of x ([s, b, h] or any leading dims). Autograd-capable
    (grads for x, weight and bias); fp32 math for 16-bit inputs, output in x's dtype."""
    if not use_fused_kernel("layer_norm", x.device.type, _outside_limits(x, weight, bias)):
        return layer_norm_reference(x, weight, bias, eps)
    return FusedLayerNorm.apply(x, weight, bias, float(eps))
