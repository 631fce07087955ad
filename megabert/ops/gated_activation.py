"""gated_activation front end: the gated MLP's act(input) * gate (SwiGLU, GeGLU) from the
up-projection's output, as one fused CPU kernel when it applies, else PyTorch's chain.

PyTorch's chain (chunk, act, mul) writes act(input) as a tensor of its own and keeps it for
the backward, which then runs act's backward, two products and a cat of the two halves'
grads: about five passes over [tokens, f] each way. The kernel reads u once and writes y
forward, and reads u and grad_y once and writes grad_u backward (both halves), keeping only
u (issue 50, item 7).

Tensor parallelism needs nothing here: each rank's u is [input_r; gate_r] (the stride-2
split of the up-projection, megabert/model/mlp.py), so the same kernel is exact per rank.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from megabert import fused_kernels
from megabert.ops import kernel_ops
from megabert.ops.dispatch import CPU_KERNEL_DTYPES, dtype_outside, use_fused_kernel
from megabert.ops.reference import gated_activation_reference

# The spec's activation names (transformers' ACT2FN) -> the kernel's. GELU's tanh form is
# computed as x * sigmoid(2u), the same function; ReLU is left to PyTorch (no family gates it).
KERNEL_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                       "gelu_pytorch_tanh": "gelu_tanh"}


class FusedGatedActivation(torch.autograd.Function):
    """y = act(input) * gate, u = [input; gate] ([gate; input] with gate_first) on the last dim."""

    @staticmethod
    def forward(ctx, u: torch.Tensor, activation: str, gate_first: bool) -> torch.Tensor:
        u = u.contiguous()
        ctx.activation, ctx.gate_first = activation, gate_first
        ctx.save_for_backward(u)
        return kernel_ops.gated_activation_forward(u, activation, gate_first)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor):
        (u,) = ctx.saved_tensors
        return kernel_ops.gated_activation_backward(grad_y, u, ctx.activation, ctx.gate_first), None, None


def _outside_limits(u: torch.Tensor, activation: str) -> Optional[str]:
    if activation not in KERNEL_ACTIVATIONS:
        return f"the activation {activation!r} (the kernel takes {', '.join(sorted(KERNEL_ACTIVATIONS))})"
    if u.dim() == 0 or u.size(-1) % 2:
        return f"an up-projection output of shape {tuple(u.shape)} (the last dim must be 2f)"
    if u.device.type != "cpu":
        return f"a {u.device.type} tensor (the fused gated activation is a CPU kernel)"
    if fused_kernels.cpu_isa() == "default":
        # Compute-bound (an exp and a division per element): 4-wide SSE2 loses to PyTorch's
        # AVX2/AVX-512 chain, 0.31-0.85x (docs/performance.md).
        return "the kernel's baseline (SSE2) build, slower than PyTorch's chain (it runs on AVX2 and AVX-512)"
    return dtype_outside(u, {"cpu": CPU_KERNEL_DTYPES})


def runs_fused(activation: str, backend: str, device_type: str) -> bool:
    """Whether a gated MLP with `activation` and --dropout-add-backend `backend` (as given:
    auto, fused, ...) runs the CPU kernel on `device_type` (the planner's question: the kernel
    keeps only u for backward, PyTorch's chain act(input) too)."""
    return (device_type == "cpu" and backend in ("auto", "fused") and activation in KERNEL_ACTIVATIONS
            and fused_kernels.kernels_for("cpu") is not None and fused_kernels.cpu_isa() != "default")


def gated_activation(u: torch.Tensor, activation: str, gate_first: bool = False,
                     backend: str = "fused") -> torch.Tensor:
    """act(input) * gate over the last dim of u = [input; gate] ([gate; input] with `gate_first`)
    -> [..., f]. `activation`: a name of `megabert.ops.reference.ACTIVATIONS`. With `backend`
    'fused' the CPU kernel runs where it applies (else PyTorch, said once); any other backend
    runs PyTorch's chain (which --compile's Inductor fuses). Autograd-capable."""
    if backend != "fused" or not use_fused_kernel("gated_activation", u.device.type, _outside_limits(u, activation)):
        return gated_activation_reference(u, activation, gate_first)
    return FusedGatedActivation.apply(u, KERNEL_ACTIVATIONS[activation], gate_first)
