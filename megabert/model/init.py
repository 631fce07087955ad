"""Deterministic, layout-independent weight initialisation, by real parameter name.

Once a model is fully constructed (a subclass may have renamed or added modules), each
parameter is initialised from its ParamSpec: a full N(0, std) matrix is drawn from a
generator seeded by (seed, the parameter's name in named_parameters()) and this rank's
slice is kept. The numbers therefore do not depend on which layers a rank builds or in
what order: TP=1, 2, 4 and any pipeline split start from the same model.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn as nn

from megabert.families.spec import EncoderSpec
from megabert.parallel.param_spec import spec_of
from megabert.tensor_parallel.layers import shard


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def init_std(spec: EncoderSpec, name: str) -> float:
    """The standard deviation parameter `name` is drawn with. With InitSpec.scaled_out
    (transformers' ModernBERT and its kin): output projections (each sublayer's, the heads'
    dense) at std / sqrt(2 x layers), a classifier behind a prediction head at hidden ** -0.5
    (transformers' "final_out"); everything else at the spec's std."""
    if spec.init.scaled_out:
        outs = (f".{spec.names.attn_out}.weight", f".{spec.names.mlp_out}.weight", "head.dense.weight")
        if name.endswith(outs):
            return spec.init.std / math.sqrt(2.0 * spec.num_layers)
        if name == "classifier.weight" and spec.classifier.prediction_head:
            return spec.hidden_size ** -0.5
    return spec.init.std


def draw(full: torch.Tensor, seed: int, name: str, std: float, truncate_at: Optional[float]) -> None:
    """Fills `full` with N(0, std) (truncated at +-truncate_at stds) from the (seed, name) stream."""
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    with torch.no_grad():
        if truncate_at is None:
            full.copy_(torch.randn(full.shape, generator=gen, dtype=torch.float32) * std)
        else:
            cutoff = truncate_at * std
            nn.init.trunc_normal_(full, 0.0, std, -cutoff, cutoff, generator=gen)


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, spec: EncoderSpec, tp_rank: int, tp_size: int) -> None:
    """Every parameter of `model` from its ParamSpec, its name and the EncoderSpec's
    initialisation (collective-free: each TP rank draws the full matrix and keeps its slice)."""
    for name, p in model.named_parameters():
        spec_p = spec_of(p, name)
        if p.device.type == "meta":
            continue  # a shape-only model (layout tables, planning) has no numbers to fill
        if spec_p.init == "zeros":
            p.zero_()
        elif spec_p.init == "ones":
            p.fill_(1.0)
        else:
            shape = list(p.shape)
            if spec_p.is_tensor_parallel:
                shape[spec_p.partition_dim] *= tp_size
            full = torch.empty(shape, dtype=torch.float32)
            draw(full, seed, name, init_std(spec, name), spec.init.truncate_at)
            if spec_p.valid_rows is not None:
                # Vocab padding rows start at zero and stay there: no id looks them up and
                # their logits are masked. Random rows would make the matrix norm (and LAMB's
                # trust ratio) depend on how much padding the TP size adds.
                full[spec_p.valid_rows:] = 0.0
            if spec_p.is_tensor_parallel:
                full = shard(full, spec_p.partition_dim, tp_rank, tp_size, spec_p.partition_stride)
            p.copy_(full)
