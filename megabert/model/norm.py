"""LayerNorm module over `megabert.ops.layer_norm` (fused kernel or PyTorch)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megabert import ops
from megabert.parallel.param_spec import describe


class LayerNorm(nn.Module):
    """LayerNorm over the last dim. With `sequence_parallel` each TP rank normalises its
    own slice of the sequence, so the parameters' gradients are partial and are summed
    over the TP group before the optimizer step (their spec says so)."""

    def __init__(self, hidden_size: int, eps: float, *, backend: str = "torch", sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, bias: bool = True):
        """`bias=False`: no bias parameter (ModernBERT's norm_bias false)."""
        super().__init__()
        self.eps, self.backend = eps, backend
        common = dict(weight_decay=False, sequence_parallel=sequence_parallel)
        self.weight = describe(nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device)),
                               init="ones", **common)
        if bias:
            self.bias = describe(nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device)),
                                 init="zeros", **common)
        else:
            self.register_parameter("bias", None)
            # The fused kernel takes a bias: zeros add nothing (its gradient is computed and dropped).
            self.register_buffer("_zero_bias", torch.zeros(hidden_size, dtype=params_dtype, device=device),
                                 persistent=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, dropout_p: float = 0.0) -> torch.Tensor:
        """With `residual`: layer_norm(residual + dropout(x, dropout_p)) as one torch.compile'd
        epilogue (megabert.ops.epilogues; the transformer layer's 'compiled' backend), this
        module's parameters read inside its own forward (where ZeRO-3 has gathered them)."""
        if residual is not None:
            return ops.bias_dropout_add_layer_norm(x, None, residual, dropout_p, dropout_p > 0.0, self,
                                                   backend="compiled")
        if self.backend == "fused":
            return ops.layer_norm(x, self.weight, self.bias if self.bias is not None else self._zero_bias, self.eps)
        return torch.nn.functional.layer_norm(x, (x.size(-1),), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, backend={self.backend}"
