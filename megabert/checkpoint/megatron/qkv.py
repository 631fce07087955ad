"""The row order of Megatron's fused QKV, per `checkpoint_version` and per TP shard.

A shard of `linear_qkv` / `query_key_value` holds whole heads (np_l = heads / tp of them) and
3 x np_l x hn rows, ordered (legacy Megatron, megatron/legacy/model/transformer.py and
`fix_query_key_value_ordering` in megatron/training/checkpointing.py):

    version 0 (key absent)   [3, np_l, hn]
    version 1.0              [np_l, hn, 3]
    version 2.0, 3.0, mcore  [np_l, 3, hn]

The order is per shard, so a version-0 checkpoint saved at TP=2 is not [3, np, hn] once its
shards are concatenated: each shard is reordered on its own, then merged. megabert's QKV is
[Q; K; V] over all heads, i.e. [3, np, hn] of the full matrix (split with stride 3 over TP).
"""
from __future__ import annotations

import torch


def _rows(t: torch.Tensor, *dims: int) -> torch.Tensor:
    return t.reshape(*dims, *t.shape[1:])


def to_v2(shard: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """One TP shard of QKV (weight [rows, h] or bias [rows]) holding `heads` heads, in the
    order of `version` -> the order of version 2.0 ([heads, 3, hn])."""
    hn = shard.size(0) // (3 * heads)
    if version < 1.0:
        out = _rows(shard, 3, heads, hn).transpose(0, 1)
    elif version < 2.0:
        out = _rows(shard, heads, hn, 3).transpose(1, 2)
    else:
        return shard
    return out.reshape(shard.shape).contiguous()


def from_v2(shard: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """The inverse of to_v2: a version-2.0-ordered shard -> the order of `version`."""
    hn = shard.size(0) // (3 * heads)
    v2 = _rows(shard, heads, 3, hn)
    if version < 1.0:
        out = v2.transpose(0, 1)
    elif version < 2.0:
        out = v2.transpose(1, 2)
    else:
        return shard
    return out.reshape(shard.shape).contiguous()


def v2_to_megabert(full: torch.Tensor, heads: int) -> torch.Tensor:
    """Full QKV in version-2.0 order ([np, 3, hn]) -> megabert's [Q; K; V] ([3, np, hn])."""
    hn = full.size(0) // (3 * heads)
    return _rows(full, heads, 3, hn).transpose(0, 1).reshape(full.shape).contiguous()


def megabert_to_v2(full: torch.Tensor, heads: int) -> torch.Tensor:
    """megabert's [Q; K; V] -> version-2.0 order, full matrix."""
    hn = full.size(0) // (3 * heads)
    return _rows(full, 3, heads, hn).transpose(0, 1).reshape(full.shape).contiguous()
