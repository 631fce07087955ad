"""Communication at the edges of tensor-parallel regions, as tiny autograd Functions.

Megatron-LM paper (Shoeybi et al., 2019), section 3: `f` is identity forward and
all-reduce backward; `g` is all-reduce forward and identity backward. An MLP is then
    Y = g(GeLU(f(X) A_col) B_row)
and each op below is the conjugate pair of one of those. Every Function takes its
process group explicitly. With a group of size 1 all of them are identities, and the functions
below return their input without applying one: an autograd Function costs the host tens of
microseconds a call, forward and backward, and a BERT-large step at TP=1 would make ~100 such
calls for nothing (bench/host_overhead.py).

Sequence parallelism (Korthikanti et al., 2022) swaps the all-reduce for an
all-gather / reduce-scatter pair along the sequence dim (dim 0 of [s, b, h]).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megabert.parallel import comm

Group = Optional[dist.ProcessGroup]


def group_size(group: Group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group: Group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    comm.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.size(dim) % n:
        raise ValueError(f"cannot split dim {dim} of size {x.size(dim)} over {n} tensor-parallel ranks")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    # dim 0 is the sequence: sequence parallelism's traffic, counted apart from TP's.
    comm.all_gather(parts, x.contiguous(), group=group, label="sp" if dim == 0 else None)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if dist.get_backend(group) == "gloo":
        # NOTE: gloo has no reduce_scatter; all-reduce then keep our slice (same result).
        return _split(comm.reduce_scatter_by_all_reduce(x.clone(), group, label="sp"), dim, group)
    chunks = [c.contiguous() for c in x.chunk(n, dim=dim)]
    out = torch.empty_like(chunks[0])
    comm.reduce_scatter(out, chunks, group=group, label="sp")
    return out


class CopyToTensorParallelRegion(torch.autograd.Function):
    """f: forward identity; backward all-reduce of the input gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: forward all-reduce (sum of partial products); backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone() if group_size(group) > 1 else x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _edge_function(name: str, doc: str, forward_op, backward_op, dim: int) -> type[torch.autograd.Function]:
    """An autograd Function running `forward_op(x, dim, group)` forward and its conjugate
    `backward_op(grad, dim, group)` backward: the six edges below differ only in those three."""

    def forward(ctx, x, group):
        ctx.group = group
        return forward_op(x, dim, group)

    def backward(ctx, grad):
        return backward_op(grad, dim, ctx.group), None

    members = {"__doc__": doc, "__module__": __name__,
               "forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), members)


ScatterToTensorParallelRegion = _edge_function(
    "ScatterToTensorParallelRegion",
    "Forward: keep this rank's slice of the last dim; backward: all-gather the last dim.",
    _split, _gather, dim=-1)

GatherFromTensorParallelRegion = _edge_function(
    "GatherFromTensorParallelRegion",
    "Forward: all-gather the last dim; backward: keep this rank's slice of the gradient.",
    _gather, _split, dim=-1)

ScatterToSequenceParallelRegion = _edge_function(
    "ScatterToSequenceParallelRegion",
    "Forward: keep this rank's slice of the sequence (dim 0); backward: all-gather dim 0.",
    _split, _gather, dim=0)

GatherFromSequenceParallelRegion = _edge_function(
    "GatherFromSequenceParallelRegion",
    """Forward: all-gather the sequence (dim 0) before a column-parallel GEMM;
    backward: reduce-scatter, since each rank's GEMM produced a partial input gradient.""",
    _gather, _reduce_scatter, dim=0)

ReduceScatterToSequenceParallelRegion = _edge_function(
    "ReduceScatterToSequenceParallelRegion",
    """Forward: reduce-scatter the row-parallel GEMM's partial sums along dim 0;
    backward: all-gather dim 0.""",
    _reduce_scatter, _gather, dim=0)

GatherFromSequenceParallelToReplicated = _edge_function(
    "GatherFromSequenceParallelToReplicated",
    """Forward: all-gather the sequence (dim 0) into a region every TP rank computes
    identically (pooler, LM-head transform); backward: keep this rank's slice, since the
    gradient arriving from a replicated region is already the same on every rank.""",
    _gather, _split, dim=0)


def _skipping_one_rank(function: type[torch.autograd.Function]):
    """`function.apply(x, group)`, or `x` itself on a group of one (the module docstring says why)."""

    def apply(x, group: Group):
        return function.apply(x, group) if group_size(group) > 1 else x

    return apply


copy_to_tp = _skipping_one_rank(CopyToTensorParallelRegion)
reduce_from_tp = _skipping_one_rank(ReduceFromTensorParallelRegion)
scatter_to_tp = _skipping_one_rank(ScatterToTensorParallelRegion)
gather_from_tp = _skipping_one_rank(GatherFromTensorParallelRegion)
scatter_to_sp = _skipping_one_rank(ScatterToSequenceParallelRegion)
gather_from_sp = _skipping_one_rank(GatherFromSequenceParallelRegion)
reduce_scatter_to_sp = _skipping_one_rank(ReduceScatterToSequenceParallelRegion)
gather_from_sp_to_replicated = _skipping_one_rank(GatherFromSequenceParallelToReplicated)


class GatherFromDataParallelRegion(torch.autograd.Function):
    """Rows of every data-parallel rank, for a loss that reads them all (the embedding
    task's negatives: megabert.tasks.embeddings.loss).

    Forward: all-gather dim 0 over the group (the DP group), rank order.
    Backward: all-reduce (sum) the gradient of the gathered tensor, keep this rank's rows.

    Each rank's loss (a mean over its own rows' queries) reads every rank's rows, so a row's
    gradient is the sum of what every rank's loss puts on it: the all-reduce forms that sum.
    The strategies then average parameter gradients over DP, which turns the sum of the
    ranks' losses into their mean: the gradient of the global batch's mean loss, as one
    rank holding the whole global batch computes it (not 1/dp of it, nor dp times it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = group_size(group)
        if n == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(n)]
        comm.all_gather(parts, x.contiguous(), group=group)  # counted under the group's own label (dp)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        n = group_size(ctx.group)
        if n == 1:
            return grad, None
        summed = _all_reduce(grad.clone(), ctx.group)
        return summed.chunk(n, dim=0)[group_rank(ctx.group)].contiguous(), None


gather_from_dp = _skipping_one_rank(GatherFromDataParallelRegion)
