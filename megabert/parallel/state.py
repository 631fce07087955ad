"""One explicit description of the rank grid and its process groups.

Layout (Megatron's order): tensor-parallel ranks are adjacent (they talk the most, so
they share a node), then data-parallel, then pipeline-parallel:

    rank = tp_rank + tp_size * (dp_rank + dp_size * pp_rank)

Layers receive the group they need (`tp_group`, ...) as an argument; nothing in the
library looks groups up in module globals.

Every group is created with the run's timeout (--distributed-timeout-minutes) and a
`group_desc` that names it in a lost peer's error (megabert.parallel.failures):
`dist.new_group` without `timeout=` waits torch's default, 30 minutes on gloo, not the
timeout the world group was made with.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megabert.parallel.layout import PipelinePosition, data_parallel_size


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, tp_size: int, dp_size: int) -> int:
    return tp_rank + tp_size * (dp_rank + dp_size * pp_rank)


@dataclass
class ParallelState(PipelinePosition):
    """The rank grid of one process and the groups it belongs to (is_first_stage and
    is_last_stage: PipelinePosition's)."""

    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    backend: str
    tp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    dp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    pp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    # Same ranks as pp_group: pipeline backward traffic (gradients) gets its own
    # communicator, so activations and gradients never queue behind each other.
    pp_backward_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    mp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)  # tp x pp: one model replica
    embedding_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)  # first + last stage (None between)
    local_rank: int = 0
    launcher: str = "single"
    # How long any op on these groups waits for a peer (--distributed-timeout-minutes);
    # groups made later (new_dp_group) get it too. None: an offline state, no groups.
    timeout: Optional[datetime.timedelta] = None

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    def pp_rank_to_global(self, pp_rank: int) -> int:
        return rank_of(self.tp_rank, self.dp_rank, pp_rank % self.pp_size, self.tp_size, self.dp_size)

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline (it holds the loss)."""
        return self.pp_rank_to_global(self.pp_size - 1)

    @classmethod
    def offline(cls, pp_size: int = 1, pp_rank: int = 0) -> "ParallelState":
        """A one-rank view without process groups, for describing a layout: shape-only
        (meta) models that export spec tables. Collectives are not available."""
        return cls(rank=0, world_size=pp_size, tp_size=1, pp_size=pp_size, dp_size=1, tp_rank=0, pp_rank=pp_rank,
                   dp_rank=0, device=torch.device("meta"), backend="none")

    def new_dp_group(self, backend: Optional[str] = None) -> dist.ProcessGroup:
        """A second communicator over this rank's data-parallel ranks, for traffic that runs
        beside the DP group's own collectives (the distributed optimizer's ring thread on
        gloo: megabert.data_parallel.ring), on the run's timeout. Collective over the world, as
        `build`: every rank calls it, and it creates every DP group in build's order."""
        if self.timeout is None:
            raise RuntimeError("an offline ParallelState has no process groups")
        mine = None
        for ranks in _dp_ranks(self.tp_size, self.dp_size, self.pp_size):
            g = dist.new_group(ranks, timeout=self.timeout, backend=backend, group_desc="dp_ring")
            if self.rank in ranks:
                mine = g
        return mine

    @classmethod
    def build(cls, tp_size: int, pp_size: int, *, device: torch.device, backend: str,
              timeout: datetime.timedelta, local_rank: int = 0, launcher: str = "single") -> "ParallelState":
        """Creates every group, each waiting at most `timeout` for a peer. Collective: all
        ranks must call it with the same sizes."""
        world, rank = dist.get_world_size(), dist.get_rank()
        dp_size = data_parallel_size(world, tp_size, pp_size)
        tp_rank = rank % tp_size
        dp_rank = (rank // tp_size) % dp_size
        pp_rank = rank // (tp_size * dp_size)
        groups: dict[str, dist.ProcessGroup] = {}

        # NOTE: new_group is collective over the whole world and must be called for every
        # group in the same order on every rank, including groups this rank is not in.
        def make(name: str, ranks_list: list[list[int]]) -> None:
            for ranks in ranks_list:
                g = dist.new_group(ranks, timeout=timeout, group_desc=name)
                if rank in ranks:
                    groups[name] = g

        r = lambda t, d, p: rank_of(t, d, p, tp_size, dp_size)  # noqa: E731
        make("tp", [[r(t, d, p) for t in range(tp_size)] for p in range(pp_size) for d in range(dp_size)])
        make("dp", _dp_ranks(tp_size, dp_size, pp_size))
        pp_ranks = [[r(t, d, p) for p in range(pp_size)] for d in range(dp_size) for t in range(tp_size)]
        make("pp", pp_ranks)
        if pp_size > 1:
            make("pp_backward", pp_ranks)
        make("mp", [[r(t, d, p) for p in range(pp_size) for t in range(tp_size)] for d in range(dp_size)])
        # Tied word embeddings live on the first and the last stage; their gradients are
        # summed over this group (it is the pp group itself when pp_size <= 2).
        make("embedding", [sorted({r(t, d, 0), r(t, d, pp_size - 1)}) for d in range(dp_size) for t in range(tp_size)])
        return cls(rank=rank, world_size=world, tp_size=tp_size, pp_size=pp_size, dp_size=dp_size,
                   tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank, device=device, backend=backend,
                   tp_group=groups["tp"], dp_group=groups["dp"], pp_group=groups["pp"],
                   pp_backward_group=groups.get("pp_backward"), mp_group=groups["mp"],
                   embedding_group=groups.get("embedding"), local_rank=local_rank, launcher=launcher,
                   timeout=timeout)


def _dp_ranks(tp_size: int, dp_size: int, pp_size: int) -> list[list[int]]:
    """The global ranks of every data-parallel group, in the order groups are created."""
    return [[rank_of(t, d, p, tp_size, dp_size) for d in range(dp_size)]
            for p in range(pp_size) for t in range(tp_size)]
