"""Deterministic, layout-independent weight initialisation.

Each full weight matrix is drawn from a generator seeded by (seed, parameter name), so
the numbers do not depend on which layers a rank builds or in what order: TP=1, 2, 4
and any pipeline split start from the same model. Layers slice the full matrix after.
"""
from __future__ import annotations

import zlib
from typing import Callable

import torch


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def normal_init(seed: int, name: str, std: float) -> Callable[[torch.Tensor], None]:
    """An init_method filling a full tensor with N(0, std) from the (seed, name) stream."""

    def init(tensor: torch.Tensor) -> None:
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        with torch.no_grad():
            tensor.copy_(torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * std)

    return init


def init_linear_(linear: torch.nn.Linear, seed: int, name: str, std: float) -> None:
    """BERT's init for a replicated nn.Linear: normal weight, zero bias."""
    normal_init(seed, name, std)(linear.weight.data)
    if linear.bias is not None:
        linear.bias.data.zero_()
