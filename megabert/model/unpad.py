"""Unpadded encoder: the token-wise work on real tokens only.

In a BERT batch every token-wise operation (the QKV, projection and MLP GEMMs, GELU,
LayerNorm, dropout, residual adds: all of a layer's FLOPs but attention's) costs as much
on a padding token as on a real one, and its result is thrown away. NVIDIA's BERT recipe
packs the real tokens of a batch into one [T, h] matrix and runs those operations on it
(its "unpadded" path). Attention takes the same [T, h] with `cu_seqlens` (the varlen
backend, issue 31): each sequence's tokens are contiguous in T, so attention needs no pad
back either; the other attention backends pad back inside the layer.
On real pre-training data 10-40% of positions are padding (short documents, the 10% of
short samples), so that share of the encoder's GEMM FLOPs goes.

Nothing else changes: attention masks padded keys either way, and the loss never reads a
padding position (masked-LM labels are -100 there, the sentence-pair head reads [CLS]), so
the pre-training loss and gradients equal the padded model's (to float rounding; dropout
draws its masks over [T, h] instead of [s, b, h], so with dropout the draws differ).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megabert.model.packed import packed_cu_seqlens
from megabert.ops.compile_hints import maybe_mark_dynamic


class TokenLayout:
    """Where the real tokens of an [s, b] batch are: `indices` into the flattened [s * b]
    positions (Megatron's sequence-first layout), sequence by sequence (batch-major), so that
    sequence i is tokens cu_seqlens[i] .. cu_seqlens[i + 1] of the unpadded [T, h]."""

    def __init__(self, attention_mask: torch.Tensor, packed_seqlens: Optional[torch.Tensor] = None,
                 token_positions: Optional[torch.Tensor] = None):
        """attention_mask: [b, s], transformers' convention (1 = token, 0 = padding).
        packed_seqlens: [b, cap] for packed rows (megabert.model.packed): the sequences are
        then the samples of each row, not the rows. token_positions: int64 [T], row x s +
        column of each real token, row-major, as the host computed them from the same mask
        (megabert.data.packing.with_flat_token_positions), or None to find them on the device."""
        b, s = attention_mask.shape
        self.s, self.b = s, b
        if token_positions is not None:
            flat = token_positions  # T is the host's: nothing waits for the device
        else:
            # NOTE: nonzero() waits for the mask's values: one host sync per micro-batch on a
            # GPU (none when the mask is still on the CPU), whatever the number of layers.
            flat = attention_mask.reshape(-1).nonzero().squeeze(1)  # [T] positions of [b, s], batch-major
        self.indices = (flat % s) * b + flat // s  # the same positions in [s, b]
        self._real = attention_mask.reshape(-1) != 0  # [b * s], batch-major
        self.num_tokens = self.indices.numel()
        if packed_seqlens is None:
            self.cu_seqlens = F.pad((attention_mask != 0).sum(1, dtype=torch.int64).cumsum(0), (1, 0))  # [b + 1]
        else:
            # A row's samples are its real tokens, in order: [b * cap + 1], empty slots empty.
            self.cu_seqlens = packed_cu_seqlens(packed_seqlens)
        self._host_cu_seqlens: Optional[list[int]] = None
        # A host bound on the sequence lengths: the padded length. FlashAttention sizes its grid
        # by it (blocks past a sequence's end return at once, and a batch of pre-training data
        # nearly always holds a sample of about full length), so the CUDA path need not read
        # the lengths back from the device to find their maximum.
        self.max_seqlen: Optional[int] = s
        self.fixed_shape = False  # T follows the data (packed_rows: the flags alone)
        # NOTE: T changes with every batch. Marked (here and on the [T, h] input of the layers),
        # torch.compile'd layers compile one graph for any T, not one for the first batch's T
        # and another once it changes. A no-op in eager mode.
        maybe_mark_dynamic(self.indices, 0)

    @classmethod
    def packed_rows(cls, packed_seqlens: torch.Tensor, seq_length: int) -> "TokenLayout":
        """Every position of packed rows, padding included, with fixed shapes and no host sync:
        T = b * s, and sequences = each row's samples, then its padding as one more sequence
        (attending to itself; no loss reads it): cu_seqlens [b * (cap + 1) + 1], an empty slot a
        zero-length sequence. What the varlen kernels take on packed rows (a step CUDA graphs
        can capture; packed rows are ~95% real tokens, so leaving the padding out would save
        little and make T follow the data)."""
        b = packed_seqlens.size(0)
        layout = cls.__new__(cls)
        layout.s, layout.b = seq_length, b
        flat = torch.arange(b * seq_length, device=packed_seqlens.device)
        layout.indices = (flat % seq_length) * b + flat // seq_length
        layout._real = torch.ones(b * seq_length, dtype=torch.bool, device=packed_seqlens.device)
        layout.num_tokens = b * seq_length
        tails = seq_length - packed_seqlens.sum(1, keepdim=True)
        layout.cu_seqlens = packed_cu_seqlens(torch.cat([packed_seqlens, tails], 1))
        layout._host_cu_seqlens = None
        layout.max_seqlen = seq_length
        layout.fixed_shape = True
        return layout

    def host_cu_seqlens(self) -> list[int]:
        """cu_seqlens as a list (read once per micro-batch: a host sync on a GPU)."""
        if self._host_cu_seqlens is None:
            self._host_cu_seqlens = self.cu_seqlens.tolist()
        return self._host_cu_seqlens

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, ...] -> [T, ...]; the gradient flows back to the real positions."""
        return x.reshape(self.s * self.b, *x.shape[2:]).index_select(0, self.indices)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [s, b, ...] with zeros at padding positions."""
        out = x.new_zeros(self.s * self.b, *x.shape[1:])
        return out.index_copy(0, self.indices, x).reshape(self.s, self.b, *x.shape[1:])

    def rows_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows of [T, ...] at the real tokens among `positions` ([b, s] bool), in T's
        (batch-major) order; padding positions have no row and are left out. Or, for packed_rows'
        layout, `positions` int64 [b, k] (each row's positions): their rows, [b * k], a shape
        that does not follow the data (what megabert.model.packed.head_positions gives)."""
        if positions.dtype != torch.bool:
            if not self.fixed_shape:  # a padding position has no row (and would repeat its neighbour's)
                raise ValueError("TokenLayout.rows_at: positions as indices need a layout of every position "
                                 "(TokenLayout.packed_rows); pass a bool mask")
            b_index = torch.arange(self.b, device=positions.device)[:, None] * self.s
            return (b_index + positions).reshape(-1)  # every position is a row: batch-major r * s + p
        row_of = self._real.cumsum(0) - 1  # [b * s]: a real token's row in T
        return row_of[positions.reshape(-1) & self._real]

    def head_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(rows, keep): the rows of [T, ...] the last layer computes for the heads, and which of
        them pad_rows puts back (None: all). `positions` as rows_at takes them, or, for any
        layout, int64 [n] positions of the batch-major [b * s] (row x s + column) with -1 for none
        (megabert.model.packed.flat_head_positions): [n] rows, a count the host knows, with no
        nonzero() (a host sync on a GPU). A real token's row is the count of real tokens before
        it; a -1, or a padding position (no row), reads row 0 and is not kept, so that each kept
        row is a distinct real token and its gradient flows back once."""
        if positions.dtype == torch.bool or self.fixed_shape:
            return self.rows_at(positions), None
        if positions.dim() != 1:
            raise ValueError(f"TokenLayout.head_rows: int positions are flat ([n], row x s + column), not "
                             f"{tuple(positions.shape)}")
        flat = positions.clamp(min=0)
        keep = (positions >= 0) & self._real.index_select(0, flat)
        row_of = (self._real.cumsum(0) - 1).clamp(min=0)  # before the first real token: clamped, not kept
        return row_of.index_select(0, flat), keep

    def pad_rows(self, x: torch.Tensor, rows: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[n, ...] holding rows `rows` of [T, ...] -> [s, b, ...], zeros everywhere else. `keep`
        (bool [n], head_rows): only those rows are put back, the others (repeats) add zeros and
        take no gradient."""
        out = x.new_zeros(self.s * self.b, *x.shape[1:])
        at = self.indices.index_select(0, rows)
        if keep is None:
            return out.index_copy(0, at, x).reshape(self.s, self.b, *x.shape[1:])
        # Repeated rows may share an index: added as exact zeros, they leave the kept row as it is.
        kept = torch.where(keep.view(-1, *(1,) * (x.dim() - 1)), x, torch.zeros((), dtype=x.dtype, device=x.device))
        return out.index_add(0, at, kept).reshape(self.s, self.b, *x.shape[1:])
