"""Deterministic, layout-independent weight initialisation, by real parameter name.

Once a model is fully constructed (a subclass may have renamed or added modules), each
parameter is initialised from its ParamSpec: a full N(0, std) matrix is drawn from a
generator seeded by (seed, the parameter's name in named_parameters()) and this rank's
slice is kept. The numbers therefore do not depend on which layers a rank builds or in
what order: TP=1, 2, 4 and any pipeline split start from the same model.
"""
from __future__ import annotations

import zlib
from typing import Callable

import torch
import torch.nn as nn

from megabert.parallel.param_spec import spec_of
from megabert.tensor_parallel.layers import shard


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def normal_init(seed: int, name: str, std: float) -> Callable[[torch.Tensor], None]:
    """An init_method filling a full tensor with N(0, std) from the (seed, name) stream."""

    def init(tensor: torch.Tensor) -> None:
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        with torch.no_grad():
            tensor.copy_(torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * std)

    return init


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, std: float, tp_rank: int, tp_size: int) -> None:
    """Every parameter of `model` from its spec and its name (collective-free: each TP
    rank draws the full matrix and keeps its slice)."""
    for name, p in model.named_parameters():
        spec = spec_of(p, name)
        if p.device.type == "meta":
            continue  # a shape-only model (layout tables, planning) has no numbers to fill
        if spec.init == "zeros":
            p.zero_()
        elif spec.init == "ones":
            p.fill_(1.0)
        else:
            shape = list(p.shape)
            if spec.is_tensor_parallel:
                shape[spec.partition_dim] *= tp_size
            full = torch.empty(shape, dtype=torch.float32)
            normal_init(seed, name, std)(full)
            if spec.valid_rows is not None:
                # Vocab padding rows start at zero and stay there: no id looks them up and
                # their logits are masked. Random rows would make the matrix norm (and LAMB's
                # trust ratio) depend on how much padding the TP size adds.
                full[spec.valid_rows:] = 0.0
            if spec.is_tensor_parallel:
                full = shard(full, spec.partition_dim, tp_rank, tp_size, spec.partition_stride)
            p.copy_(full)
