"""Unfused PyTorch implementations: the reference for tests and the fallback path."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def scaled_masked_softmax_reference(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """softmax(scale * scores) over the last dim with `mask` (bool, True = masked out,
    broadcastable to scores) excluded. A fully masked row gives zeros, as Megatron's kernel.

    Math in fp32 whatever the input dtype; the result has the input's dtype.
    """
    x = scores.float() * scale
    if mask is None:
        return torch.softmax(x, dim=-1).to(scores.dtype)
    # A finite fill keeps fully masked rows NaN-free (uniform), then they are zeroed,
    # which also zeroes their gradient.
    x = x.masked_fill(mask, torch.finfo(torch.float32).min)
    probs = torch.softmax(x, dim=-1)
    all_masked = mask.all(dim=-1, keepdim=True)
    if all_masked.any():
        probs = probs.masked_fill(all_masked, 0.0)
    return probs.to(scores.dtype)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.size(-1),), weight, bias, eps)
