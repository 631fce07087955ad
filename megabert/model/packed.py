"""What a packed batch means to the model (megabert.data.packing makes them).

A packed row holds several samples side by side: `packed_seqlens` [b, cap] gives their lengths
in row order (0 for an empty slot), the row's padding after them. Everything here is derived on
the device from that fixed-shape tensor, with no host value, so a packed step keeps its shapes
(what CUDA graphs need):

- attention stays inside each sample: cu_seqlens over the samples for the varlen kernels, a
  block-diagonal mask for the padded paths;
- the binary head reads each sample's [CLS], the first token of the sample: a fixed [b * cap]
  of slots, an empty slot's label -100;
- the masked LM reads `mlm_positions` [b, slots] (megabert.data.packing.label_positions: each
  row's masked positions, -1 in empty slots, as NVIDIA's masked_lm_positions), a fixed
  [b * slots] of rows whose empty slots have label -100, and the last layer computes the rows
  the heads read as a fixed [b, k] of positions (head_positions).

Unpacked rows need no fixed shape (the unpadded encoder's token count follows the data anyway):
their masked LM reads exactly the masked positions, `mlm_flat_positions` [n] given by the host
(flat_head_positions, gather_flat), with no empty slot and no bool mask, and the unpadded encoder
its real tokens, `token_positions` [T] given by the host (megabert.model.unpad.TokenLayout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fixed_shape_packing(device: torch.device, unpad_input: bool) -> bool:
    """Whether packed rows run the fixed-shape step: on CUDA always (CUDA graphs and one
    compilation need it; the step then reads nothing back from the device), on the CPU with
    --no-unpad-input. The CPU's default unpads packed rows: the ~5% padding they keep and the
    masked-LM slots left empty (a row's cap is a worst case) cost ~15% of a small model's step
    there (docs/performance.md), and the CPU gains nothing from fixed shapes."""
    return device.type == "cuda" or not unpad_input


def sample_starts(packed_seqlens: torch.Tensor) -> torch.Tensor:
    """[b, cap] position of each slot's first token in its row; an empty slot points at 0 (the
    row's first [CLS]: its logits are computed and never read)."""
    starts = packed_seqlens.cumsum(1) - packed_seqlens
    return torch.where(packed_seqlens > 0, starts, torch.zeros_like(starts))


def packed_cu_seqlens(packed_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [b * cap + 1]: sample boundaries in the real tokens of the batch taken row by row
    (the unpadded encoder's [T, h]); an empty slot is an empty sequence."""
    return F.pad(packed_seqlens.reshape(-1).cumsum(0), (1, 0))


def sample_segments(packed_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """int64 [b, s]: each position's sample slot in its row; cap for the padding after them."""
    ends = packed_seqlens.cumsum(1)  # [b, cap]
    positions = torch.arange(seq_length, device=packed_seqlens.device)
    return (positions[None, :, None] >= ends[:, None, :]).sum(-1)


def sample_positions(packed_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """int64 [b, s]: each position's place in its own sample, from 0 (the packer's position_ids;
    the padding counts on from the row's last sample's end)."""
    segment = sample_segments(packed_seqlens, seq_length)
    starts = F.pad(packed_seqlens.cumsum(1), (1, 0))  # [b, cap + 1]: slot k starts at starts[k]
    return torch.arange(seq_length, device=packed_seqlens.device)[None] - starts.gather(1, segment)


def block_diagonal_mask(packed_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """bool [b, 1, s, s], True = masked out: a token attends to the tokens of its own sample;
    the padding after a row's samples attends to that padding only (finite rows no loss reads)."""
    segment = sample_segments(packed_seqlens, seq_length)
    return (segment[:, :, None] != segment[:, None, :])[:, None]


def cls_positions_mask(packed_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """bool [b, s]: True at each sample's first token."""
    mask = torch.zeros(packed_seqlens.size(0), seq_length, dtype=torch.bool, device=packed_seqlens.device)
    return mask.scatter(1, sample_starts(packed_seqlens), True)


def gather_positions(sequence: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """sequence [s, b, h], positions [b, n] (each < s, >= 0) -> [b * n, h]: row r's hidden
    states at its n positions, row by row (fixed shapes: no host value)."""
    rows = torch.arange(positions.size(0), device=positions.device)[:, None].expand_as(positions)
    return sequence[positions.reshape(-1), rows.reshape(-1)]


def gather_cls(sequence: torch.Tensor, packed_seqlens: torch.Tensor) -> torch.Tensor:
    """sequence [s, b, h] -> [b * cap, h]: the hidden state at each slot's first token."""
    return gather_positions(sequence, sample_starts(packed_seqlens))


def gather_labelled(sequence: torch.Tensor, labels: torch.Tensor, mlm_positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [b * slots, h], target [b * slots]) at each row's `mlm_positions` [b, slots]; an
    empty slot (-1) reads the row's first token with target -100, so it adds no loss and no
    gradient (the loss ignores -100)."""
    empty = mlm_positions < 0
    at = mlm_positions.clamp(min=0)
    target = labels.gather(1, at).masked_fill(empty, -100)
    return gather_positions(sequence, at), target.reshape(-1)


def head_positions(packed_seqlens: torch.Tensor, mlm_positions: torch.Tensor, seq_length: int) -> torch.Tensor:
    """int64 [b, k], k = min(seq_length, cap + slots): positions of each row that hold every
    sample's [CLS] and every masked position, ascending and distinct (what the last layer must
    compute for the heads), then as many other positions, ascending, as fill k. A fixed k, so
    the last layer's shapes do not follow the data; distinct, so that putting its rows back
    into [s, b, h] (an index_copy) passes each position's gradient once."""
    k = min(seq_length, packed_seqlens.size(1) + mlm_positions.size(1))
    wanted = cls_positions_mask(packed_seqlens, seq_length)
    # An empty slot (-1) marks position 0, the row's first [CLS], which is wanted anyway.
    wanted = wanted.scatter(1, mlm_positions.clamp(min=0), True)
    positions = torch.arange(seq_length, device=packed_seqlens.device).expand_as(wanted)
    key = torch.where(wanted, positions, positions + seq_length)  # the wanted positions sort first
    return key.sort(dim=1).values[:, :k] % seq_length


def flat_head_positions(mlm_flat_positions: torch.Tensor, labels: torch.Tensor, cls: bool) -> torch.Tensor:
    """int64 [(b +) n]: the positions, as row x s + column, that the heads read in unpacked rows
    (one sample each) given the masked ones (`mlm_flat_positions` [n],
    megabert.data.packing.flat_label_positions): each row's [CLS] (position 0, the pooler's) when
    `cls`, then the masked positions; -1 for a [CLS] that is itself masked (each position once).
    No nonzero(): n is the host tensor's length (the unpadded encoder maps them to its rows:
    megabert.model.unpad.TokenLayout.head_rows)."""
    if not cls:
        return mlm_flat_positions
    b, s = labels.shape
    starts = torch.arange(b, device=labels.device) * s
    return torch.cat([torch.where(labels[:, 0] != -100, -1, starts), mlm_flat_positions])


def gather_flat(sequence: torch.Tensor, labels: torch.Tensor, mlm_flat_positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [n, h], target [n]) at `mlm_flat_positions` [n] (row x s + column, row-major):
    what sequence.transpose(0, 1)[labels != -100] and labels[labels != -100] select, in the same
    order, by index (a bool mask is a nonzero(): a host sync on a GPU)."""
    s, b = sequence.shape[:2]
    at = (mlm_flat_positions % s) * b + mlm_flat_positions // s  # the same positions in [s, b]
    hidden = sequence.reshape(s * b, *sequence.shape[2:]).index_select(0, at)
    return hidden, labels.reshape(-1).index_select(0, mlm_flat_positions)
