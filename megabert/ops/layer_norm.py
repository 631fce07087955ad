"""layer_norm front end and backend resolution."""
from __future__ import annotations

import logging

import torch

from megabert.ops.reference import layer_norm_reference

logger = logging.getLogger(__name__)


def resolve_layernorm_backend(backend: str) -> str:
    """'auto' -> 'fused' when the kernels are built, else 'torch'."""
    from megabert import fused_kernels

    if backend == "auto":
        return "fused" if fused_kernels.is_available() else "torch"
    if backend == "fused" and not fused_kernels.is_available():
        from megabert.errors import ConfigError

        raise ConfigError(f"--layernorm-backend fused: the fused kernels are not built "
                          f"({fused_kernels.load_error()}); run `make install` or use --layernorm-backend torch")
    return backend


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim. Autograd-capable."""
    return layer_norm_reference(x, weight, bias, eps)
