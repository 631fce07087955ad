"""Where each gradient (and, for the distributed optimizer, each parameter) lives in the
contiguous buffers of data parallelism: the arithmetic alone, no tensor allocated and no
collective issued (megabert.data_parallel.grad_buckets allocates and reduces).

One buffer per dtype holds the parameters back to back in the order backward produces
their gradients (the model's order reversed), and is cut into buckets of at most
`bucket_elements` (a parameter larger than that gets a bucket of its own); a bucket is one
message of the DP reduction.

Sharded (the distributed optimizer, as Megatron-LM's param_and_grad_buffer lays it out):
every bucket is padded to a multiple of lcm(DP, 128) elements and split into DP equal
shards; DP rank r keeps shard r of every bucket. A `Piece` is the part of one parameter
inside this rank's shard of a bucket: a parameter may be split between ranks, or lie
wholly in another rank's shard. `isolate(p)` gives p a bucket of its own (the pipeline's
tied word embeddings: both stages then shard them alike).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# Megatron pads each bucket to lcm(DP, 128) elements so that every shard starts aligned for
# NCCL's fast paths; the padding is at most 127 elements per bucket.
BUCKET_ALIGNMENT = 128


@dataclass(eq=False)
class BucketSpan:
    """One bucket: its parameters (backward order), the elements [start, end) of its dtype's
    buffers (padding included), and [shard_start, shard_end), what this rank keeps of it
    once reduced (the whole span unless sharded)."""

    params: list[torch.nn.Parameter]
    start: int
    end: int
    shard_start: int
    shard_end: int


@dataclass(eq=False)
class BufferLayout:
    """One dtype's buffers: `size` elements, each parameter's first element at `offsets[p]`,
    cut into `buckets` (backward order)."""

    dtype: torch.dtype
    device: torch.device
    size: int
    offsets: dict[torch.nn.Parameter, int]
    buckets: list[BucketSpan]


@dataclass(frozen=True)
class PieceSpan:
    """The elements [lo, hi) of `param` (flattened) that this rank's shards hold, at
    [at, at + hi - lo) of its dtype's buffers."""

    param: torch.nn.Parameter
    lo: int
    hi: int
    at: int


def layout_buffers(order: list[torch.nn.Parameter], bucket_elements: int, *, shards: Optional[int] = None,
                   shard: int = 0, isolate: Optional[Callable[[torch.nn.Parameter], bool]] = None) -> list[BufferLayout]:
    """The buffers of `order` (the parameters in backward order), one per dtype in order of
    first appearance. `shards` None: neither padded nor split (plain DP's all-reduce).
    Otherwise the DP size (1 too: the distributed optimizer's layout is the same at DP=1)
    and `shard` this rank's DP rank: buckets padded to lcm(shards, BUCKET_ALIGNMENT)."""
    if bucket_elements < 1:
        raise ValueError("bucket_elements must be >= 1")
    align = 1 if shards is None else math.lcm(shards, BUCKET_ALIGNMENT)
    out = []
    for dtype in dict.fromkeys(p.dtype for p in order):
        group = [p for p in order if p.dtype == dtype]
        cut: list[tuple[list[torch.nn.Parameter], int, int]] = []  # (members, start, padded end)
        offsets: dict[torch.nn.Parameter, int] = {}
        start, offset, members = 0, 0, []
        for p in group:
            if members and ((isolate is not None and (isolate(p) or isolate(members[-1])))
                            or offset + p.numel() - start > bucket_elements):
                end = _round_up(offset, align)
                cut.append((members, start, end))
                start = offset = end
                members = []
            offsets[p] = offset
            members.append(p)
            offset += p.numel()
        cut.append((members, start, _round_up(offset, align)))
        buckets = []
        for members, start, end in cut:
            lo, hi = start, end
            if shards is not None:
                size = (end - start) // shards
                lo, hi = start + shard * size, start + (shard + 1) * size
            buckets.append(BucketSpan(members, start, end, lo, hi))
        out.append(BufferLayout(dtype, group[0].device, cut[-1][2], offsets, buckets))
    return out


def pieces(layout: BufferLayout) -> list[PieceSpan]:
    """This rank's pieces of `layout`'s parameters, bucket by bucket (backward order)."""
    out = []
    for bucket in layout.buckets:
        for p in bucket.params:
            o = layout.offsets[p]
            a, b = max(o, bucket.shard_start), min(o + p.numel(), bucket.shard_end)
            if a < b:
                out.append(PieceSpan(p, a - o, b - o, a))
    return out


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
