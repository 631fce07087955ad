"""The data-parallel average of the gradients after backward, when no reducer overlapped it
with backward (--no-overlap-grad-reduce; at DP = 1 there is nothing to average), and the
coalesced all-reduce it runs on: gradients flattened into buckets of BUCKET_ELEMENTS of one
dtype, one all-reduce per bucket. The gradient step's sums over other groups (sequence
parallelism's over TP, the tied embeddings' over the embedding group: megabert.training.grads)
run on the same all-reduce.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megabert.config import BUCKET_ELEMENTS
from megabert.parallel import ParallelState, comm


def _buckets(tensors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    bucket, size = [], 0
    for t in tensors:
        if bucket and (size + t.numel() > BUCKET_ELEMENTS or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


def all_reduce_coalesced(tensors: list[torch.Tensor], group, scale: float = 1.0, label: Optional[str] = None) -> None:
    """Sums `tensors` over `group` in place (then x `scale`), a bucket at a time."""
    for bucket in _buckets(tensors):
        flat = _flatten_dense_tensors(bucket)
        comm.all_reduce(flat, group=group, label=label)
        if scale != 1.0:
            flat.mul_(scale)
        for t, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(reduced)


def average_data_parallel_grads(params: Iterable[torch.nn.Parameter], ps: ParallelState) -> None:
    """Mean over DP replicas: each replica's loss is a mean over its own samples."""
    if ps.dp_size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    all_reduce_coalesced(grads, ps.dp_group, scale=1.0 / ps.dp_size)
