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
