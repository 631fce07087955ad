"""scaled_masked_softmax front end."""
from __future__ import annotations

from typing import Optional

import torch

from megabert.ops.reference import scaled_masked_softmax_reference


def scaled_masked_softmax(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """softmax(scale * scores) over the last dim, masked positions (True) excluded.

    scores: [b, heads, sq, sk]; mask: bool, broadcastable to scores. Autograd-capable.
    """
    return scaled_masked_softmax_reference(scores, mask, scale)
