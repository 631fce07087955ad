"""What a packed batch means to the model (megabert.data.packing makes them).

A packed row holds several samples side by side: `packed_seqlens` [b, cap] gives their lengths
in row order (0 for an empty slot), the row's padding after them. Everything here is derived on
the device from that fixed-shape tensor, with no host value, so a packed step keeps its shapes
(what CUDA graphs need):

- attention stays inside each sample: cu_seqlens over the samples for the varlen kernels, a
  block-diagonal mask for the padded paths;
- the binary head reads each sample's [CLS], the first token of the sample.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sample_starts(packed_seqlens: torch.Tensor) -> torch.Tensor:
    """[b, cap] position of each slot's first token in its row; an empty slot points at 0 (the
    row's first [CLS]: its logits are computed and never read)."""
    starts = packed_seqlens.cumsum(1) - packed_seqlens
    return torch.where(packed_seqlens > 0, starts, torch.zeros_like(starts))


def packed_cu_seqlens(packed_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [b * cap + 1]: sample boundaries in the real tokens of the batch taken row by row
    (the unpadded encoder's [T, h]); an empty slot is an empty sequence."""
    return F.pad(packed_seqlens.reshape(-1).cumsum(0), (1, 0))


def block_diagonal_mask(packed_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """bool [b, 1, s, s], True = masked out: a token attends to the tokens of its own sample;
    the padding after a row's samples attends to that padding only (finite rows no loss reads)."""
    ends = packed_seqlens.cumsum(1)  # [b, cap]
    positions = torch.arange(seq_length, device=packed_seqlens.device)
    segment = (positions[None, :, None] >= ends[:, None, :]).sum(-1)  # [b, s]: sample slot, cap for padding
    return (segment[:, :, None] != segment[:, None, :])[:, None]


def cls_positions_mask(packed_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """bool [b, s]: True at each sample's first token."""
    mask = torch.zeros(packed_seqlens.size(0), seq_length, dtype=torch.bool, device=packed_seqlens.device)
    return mask.scatter(1, sample_starts(packed_seqlens), True)


def gather_cls(sequence: torch.Tensor, packed_seqlens: torch.Tensor) -> torch.Tensor:
    """sequence [s, b, h] -> [b * cap, h]: the hidden state at each slot's first token."""
    starts = sample_starts(packed_seqlens)  # [b, cap]
    rows = torch.arange(starts.size(0), device=starts.device)[:, None].expand_as(starts)
    return sequence[starts.reshape(-1), rows.reshape(-1)]
