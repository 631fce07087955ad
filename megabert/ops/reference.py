"""Unfused PyTorch implementations: the reference for tests and the fallback path."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def scaled_masked_softmax_reference(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """softmax(scale * scores) over the last dim with `mask` (bool, True = masked out,
    broadcastable to scores) excluded. A fully masked row gives zeros, as Megatron's kernel.

    Math in fp32 for 16-bit inputs (fp64 stays fp64, so this is also the float64
    oracle the kernels are tested against); the result has the input's dtype.
    """
    x = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    if mask is None:
        return torch.softmax(x, dim=-1).to(scores.dtype)
    # A finite fill keeps fully masked rows NaN-free (uniform), then they are zeroed,
    # which also zeroes their gradient.
    x = x.masked_fill(mask, torch.finfo(x.dtype).min)
    probs = torch.softmax(x, dim=-1)
    # Unconditional: `if all_masked.any()` would wait for the device once per layer.
    probs = probs.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    return probs.to(scores.dtype)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.size(-1),), weight, bias, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, as transformers' Llama-family RMSNorm
    computes it: in fp32 (fp64 stays fp64), the normalised value cast back to x's dtype before
    the weight multiplies it (so a bf16 input with an fp32 weight gives fp32, as there)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# The activations a family's spec names (transformers' ACT2FN names).
ACTIVATIONS = {
    "gelu": F.gelu,  # exact (erf), transformers' "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def gated_activation_reference(u: torch.Tensor, activation: str, gate_first: bool) -> torch.Tensor:
    """act(input) * gate over the last dim of the up-projection's output u = [input; gate]
    ([gate; input] with `gate_first`): GeGLU, SwiGLU. `activation`: a key of ACTIVATIONS."""
    inp, gate = u.chunk(2, dim=-1)
    if gate_first:
        inp, gate = gate, inp
    return ACTIVATIONS[activation](inp) * gate
