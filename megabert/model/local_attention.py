"""Sliding-window attention by blocks: a local layer's cost grows with the window, not the
sequence length.

A query at position i sees the keys within `w` positions (|i - j| <= w, transformers'
bidirectional sliding window). Queries go in blocks of `B`; block j's keys all lie in the
`B + 2w` positions from jB - w, which `unfold` gathers as a view. Scores, softmax, dropout
and the value product run on [.., B, B + 2w] tiles: O(s (B + 2w)) time and memory where the
band-masked dense path (megabert.model.attention.band_mask) spends O(s^2). Keys
outside a row's window, past the sequence or at padding get no probability, so the result
is the dense path's up to float rounding (the same terms, summed in another order).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F


def block_size(half_window: int) -> int:
    """Queries per block: the half window (B = w keeps B + 2w keys per block at 3w)."""
    return max(half_window, 8)


def worth_blocking(seq_length: int, half_window: int) -> bool:
    """Blocks pay once a row's keys (B + 2w) are fewer than the sequence's."""
    return block_size(half_window) + 2 * half_window < seq_length


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding: Optional[torch.Tensor],
                    half_window: int, *, segments: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                    rng_fork=None) -> torch.Tensor:
    """q, k, v: [b, heads, s, d]; key_padding: bool [b, s] (True = padding) or None;
    `segments`: int [b, s] or None, a query sees only keys of its own segment (the unpadded
    layout: all of a batch's real tokens as one row, a segment per sequence; once packed, a
    segment per sample). -> [b, heads, s, d]. `rng_fork()`: the context dropout draws in
    (the per-TP-rank stream)."""
    b, n, s, d = q.shape
    w, blk = half_window, block_size(half_window)
    nb = -(-s // blk)
    sp = nb * blk  # queries padded to whole blocks
    span = blk + 2 * w  # keys a block sees
    scale = d ** -0.5
    # Keys and values padded by w before and w + (sp - s) after: block j's keys are positions
    # jB - w .. jB + B + w - 1 of the sequence, i.e. rows jB .. jB + span - 1 of the padded ones.
    pad = (0, 0, w, w + sp - s)
    kb = F.pad(k, pad).unfold(2, span, blk).transpose(-1, -2)  # [b, n, nb, span, d]
    vb = F.pad(v, pad).unfold(2, span, blk).transpose(-1, -2)
    qb = F.pad(q, (0, 0, 0, sp - s)).view(b, n, nb, blk, d)
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [b, n, nb, B, span]

    # Valid keys: inside the row's window (column c of row r is position jB - w + c, so
    # |r - (c - w)| <= w means r <= c <= r + 2w), inside the sequence, not padding.
    r = torch.arange(blk, device=q.device)[:, None]
    c = torch.arange(span, device=q.device)[None, :]
    band = (c >= r) & (c <= r + 2 * w)  # [B, span]
    real = torch.ones(b, s, dtype=torch.bool, device=q.device) if key_padding is None else ~key_padding
    real = F.pad(real, (w, w + sp - s), value=False).unfold(1, span, blk)  # [b, nb, span]
    keep = band[None, None] & real[:, :, None, :]  # [b, nb, B, span]
    if segments is not None:
        seg_k = F.pad(segments, (w, w + sp - s), value=-1).unfold(1, span, blk)  # [b, nb, span]
        seg_q = F.pad(segments, (0, sp - s), value=-2).view(b, nb, blk)  # [b, nb, B]
        keep = keep & (seg_q[..., :, None] == seg_k[..., None, :])
    scores = scores.masked_fill(~keep[:, None], torch.finfo(scores.dtype).min)
    # A row with no valid key (a padding query) gets a uniform, finite row: never read.
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        with (rng_fork() if rng_fork is not None else contextlib.nullcontext()):
            probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, vb)  # [b, n, nb, B, d]
    return out.reshape(b, n, sp, d)[:, :, :s]
