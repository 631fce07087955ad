"""LayerNorm module over `megabert.ops.layer_norm` (fused kernel or PyTorch)."""
from __future__ import annotations

import torch
import torch.nn as nn

from megabert import ops


class LayerNorm(nn.Module):
    """LayerNorm over the last dim. `sequence_parallel` marks the parameters whose
    gradients are partial (each TP rank normalises its own slice of the sequence) and
    must be summed over the TP group before the optimizer step."""

    def __init__(self, hidden_size: int, eps: float, *, backend: str = "torch", sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))
        self.weight.sequence_parallel = sequence_parallel
        self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "fused":
            return ops.layer_norm(x, self.weight, self.bias, self.eps)
        return torch.nn.functional.layer_norm(x, (x.size(-1),), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, backend={self.backend}"
