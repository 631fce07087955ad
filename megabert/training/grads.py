"""The gradient step between backward and the optimizer: the sums that model parallelism
needs, the global norm and the clipping.

Sequence-parallel LayerNorm grads are summed over TP (each rank saw only its slice of the
sequence) and the pipeline's two copies of the tied word embeddings over the embedding
group; the average over DP (megabert.data_parallel: overlapped with backward, or
averaging.py after it) commutes with both. Then the global norm is taken over the
model-parallel group for clipping (megabert.optim.clip folds the clip into the optimizer
step). Which parameter needs what is read from its ParamSpec. The norm stays on the device
(foreach kernels): no host synchronisation per parameter.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from megabert.data_parallel.averaging import all_reduce_coalesced
from megabert.parallel import ParallelState, comm
from megabert.parallel.param_spec import ParamSpec, spec_of


def _sum_grads(params: Iterable[torch.nn.Parameter], wanted: Callable[[ParamSpec], bool], group,
               label=None) -> None:
    grads = [p.grad for p in params if p.grad is not None and wanted(spec_of(p))]
    if grads:
        all_reduce_coalesced(grads, group, label=label)


def sync_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], ps: ParallelState) -> None:
    if ps.tp_size > 1:
        _sum_grads(params, lambda s: s.sequence_parallel, ps.tp_group, label="sp")


def sync_tied_embedding_grads(params: Iterable[torch.nn.Parameter], ps: ParallelState) -> None:
    """Pipeline: the first stage's word embeddings and the last stage's copy (the MLM
    projection) are one parameter. Summing their gradients over the embedding group
    gives both the full gradient, so identical optimizer steps keep them equal."""
    if ps.pp_size > 1:
        _sum_grads(params, lambda s: s.placement == "tied", ps.embedding_group)


def grad_norm(params: Iterable[torch.nn.Parameter], ps: ParallelState, dp_sharded: bool = False) -> torch.Tensor:
    """Global L2 norm of the model's gradients, a float64 scalar on the device (read it
    with one .item(), or not at all). A replicated parameter is counted once (on TP rank
    0) and split ones on every rank, so the sum over the model-parallel group is the norm
    of the full model's gradient. The last pipeline stage's copy of the tied word
    embeddings is left out: the first stage counts it. `dp_sharded`: `params` are this
    rank's shards of the DP-averaged gradients (the distributed optimizer's pieces, each
    carrying its parameter's spec): the squares are then summed over every rank."""
    grads = []
    for p in params:
        if p.grad is None:
            continue
        spec = spec_of(p)
        if spec.placement == "tied" and ps.pp_size > 1 and not ps.is_first_stage:
            continue
        if spec.is_tensor_parallel or ps.tp_rank == 0:
            grads.append(p.grad)  # gradients are leaves: nothing to detach
    total = torch.zeros((), dtype=torch.float64, device=ps.device)
    if grads:
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        total = torch.stack(norms).double().pow(2).sum()
    if dp_sharded and ps.dp_size > 1:
        comm.all_reduce(total)  # the world: DP x TP x PP
    elif ps.tp_size * ps.pp_size > 1:
        comm.all_reduce(total, group=ps.mp_group)
    return total.sqrt()

