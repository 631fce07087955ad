"""LAMB over pieces of parameters, for the distributed optimizer
(megabert.data_parallel.distributed_optimizer): a trust ratio needs the norms of the whole
parameter, and a piece is only the part of it in this rank's shard, so the pieces' squared
norms are summed per parameter over the data-parallel group (and over TP for split
parameters), every param group in one reduction per step. The moments and the update are
megabert.optim.Lamb's own: this class only reduces the norms differently.
"""
from __future__ import annotations

import torch

from megabert.data_parallel.sharded_buffers import Piece
from megabert.optim import Lamb
from megabert.parallel import ParallelState, comm
from megabert.parallel.param_spec import spec_of


class ShardedLamb(Lamb):
    """LAMB over pieces of parameters: a trust ratio needs the norms of the whole
    parameter, so the pieces' squared norms are summed per parameter over the DP ranks
    (and over TP for split parameters), all groups in one reduction per step."""

    def __init__(self, groups, *, pieces: list[Piece], params: list[torch.nn.Parameter], ps: ParallelState,
                 **hyper):
        """`groups`: param groups of the pieces' tensors; `params`: the whole parameters
        they are pieces of; `hyper`: Lamb's hyper-parameters (megabert.optim.build_optimizer
        passes them, with `functools.partial` binding the rest)."""
        super().__init__(groups, **hyper)
        index = {id(p): i for i, p in enumerate(params)}
        self._parent = {id(piece.tensor): index[id(piece.param)] for piece in pieces}
        self._split = torch.tensor([spec_of(p).is_tensor_parallel for p in params], device=ps.device)
        self._n, self._ps = len(params), ps

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        work = [(group, self._updates(group)) for group in self.param_groups]
        work = [(g, w) for g, w in work if w is not None]
        # [2, n_params] float64: squares of ||w|| and ||update|| per whole parameter. A
        # piece's norm squared in float64 is exact, so a parameter held whole by one
        # rank gets the very norm plain LAMB computes.
        sums = torch.zeros(2, self._n, dtype=torch.float64, device=self._ps.device)
        for _, (params, updates, fp32_params) in work:
            idx = torch.tensor([self._parent[id(p)] for p in params], device=sums.device)
            sums[0].index_add_(0, idx, torch.stack(torch._foreach_norm(fp32_params, 2, dtype=torch.float32))
                               .double().square())
            sums[1].index_add_(0, idx, torch.stack(torch._foreach_norm(updates, 2)).double().square())
        ps = self._ps
        if ps.dp_size > 1:
            comm.all_reduce(sums, group=ps.dp_group)  # every rank calls it, with or without pieces
        if ps.tp_size > 1 and bool(self._split.any()):
            split = sums[:, self._split]
            comm.all_reduce(split, group=ps.tp_group)
            sums[:, self._split] = split
        norms = sums.sqrt().float()
        for group, (params, updates, _) in work:
            idx = torch.tensor([self._parent[id(p)] for p in params], device=norms.device)
            self._apply(group, params, updates, norms[0, idx], norms[1, idx])
        return loss
