"""Contiguous parameter and gradient buffers split over data parallelism, for the
distributed optimizer (megabert.data_parallel.distributed_optimizer).

The layout is OverlappedGradReducer's (buckets in the order backward produces gradients,
a hook counting each parameter's accumulations), with three changes, as Megatron-LM's
param_and_grad_buffer lays them out:
- every bucket is padded to a multiple of lcm(DP, 128) elements and split in DP equal
  shards; DP rank r owns shard r of every bucket;
- a ready bucket is reduce-scattered, not all-reduced: rank r receives the sum of shard r
  only (half the bytes of a ring all-reduce), in place in the gradient buffer;
- the parameters live in a second buffer of the same layout (each parameter's `.data` is a
  view into it), so after each rank has stepped its shards, one all-gather per bucket
  brings every rank the whole model, with no copy in or out.

A `Piece` is the part of one parameter inside this rank's shard of a bucket: a view of the
parameter buffer (what the optimizer steps) and the same range of the gradient buffer.
A parameter may be split between ranks, or lie wholly in another rank's shard.

The all-gathers are issued together after the optimizer step, in the order forward uses
the buckets; with `overlap_param_gather` a forward pre-hook on each module waits only
for the buckets up to the one holding its parameters, so the first layers compute while
the later buckets are still arriving.

On gloo (CPU) both collectives are rings of point-to-point transfers, in place, run in
issue order by one thread on a communicator of their own (megabert.data_parallel.ring): gloo's
own reduce_scatter and all_gather stage copies of the whole bucket for every call in
flight, and backward issues the reduce-scatters faster than two cores complete them (with
BERT-large at DP=2 that held more than the sharded moments saved), and composing them from
gloo's reduce and broadcast kept the memory but sent more bytes, one link direction at a
time (issue 32). NCCL's run in place as they are.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megabert.data_parallel.overlap import OverlappedGradReducer, _Bucket
from megabert.data_parallel.ring import RingCommunicator
from megabert.parallel import ParallelState, comm
from megabert.parallel.param_spec import ATTR

logger = logging.getLogger(__name__)

# Megatron pads each bucket to lcm(DP, 128) elements so that every shard starts aligned for
# NCCL's fast paths; the padding is at most 127 elements per bucket.
BUCKET_ALIGNMENT = 128


# Parameter all-gathers in flight at once on NCCL: two keep the link busy (one runs while
# the next is waited for). The reduce-scatters are not throttled: backward issues them as
# buckets fill, and a wait in a backward hook could stall one pipeline on another's
# progress; neither holds memory beyond the buffers (both work in place). The ring thread
# (gloo) takes every gather at once: it runs them one after another anyway, and a throttle
# would leave the link idle until forward reached the next bucket.
IN_FLIGHT = 2


@dataclass
class Piece:
    """The elements [lo, hi) of `param` (flattened) that this rank's shards hold."""

    param: torch.nn.Parameter
    lo: int
    hi: int
    tensor: torch.Tensor  # the parameter buffer's view: what the optimizer steps
    grad: torch.Tensor  # the gradient buffer's view, reduced and averaged after `finish`


class ShardedBuffers(OverlappedGradReducer):
    """Owns the parameters' storage and gradients of `params` (DP > 1 or not). Per step:
    `start(n)` before the first backward, `finish()` after the last (this rank's shards
    then hold the averaged gradients: each piece's `.grad`), the optimizer steps the
    pieces, then `gather_params()`. `isolate(p)`: p gets a bucket of its own (the
    pipeline's tied word embeddings: both stages then shard it alike, so the shards can
    be summed over the embedding group)."""

    def __init__(self, params: list[torch.nn.Parameter], ps: ParallelState, bucket_elements: int, *,
                 isolate: Callable[[torch.nn.Parameter], bool] = lambda p: False, overlap_param_gather: bool = True):
        self._isolate = isolate
        self.param_buffers: dict[torch.dtype, torch.Tensor] = {}
        self.pieces: list[Piece] = []
        self.offsets: dict[torch.nn.Parameter, int] = {}  # where each parameter starts in its dtype's buffers
        super().__init__(params, ps, bucket_elements)
        # Chosen once, from the DP group's backend: gloo's own collectives stage copies (see
        # the module docstring); where the group is a single rank nothing is sent either way.
        # NOTE: new_dp_group is collective over the world; every rank builds its buffers here.
        self.ring: Optional[RingCommunicator] = None
        if ps.dp_size > 1 and dist.get_backend(ps.dp_group) == "gloo":
            chunk_bytes = max(b.grad_shard.numel() * b.grad_shard.element_size() for b in self.buckets)
            self.ring = RingCommunicator(ps.new_dp_group(backend="gloo"), chunk_bytes, device=ps.device, label="dp")
            if ps.is_logging_rank:
                logger.info("distributed optimizer on gloo: gradient buckets reduce-scattered and parameters "
                            "all-gathered as rings of send/recv by a communication thread, in place (gloo's "
                            "reduce_scatter and all_gather copy whole buckets)")
        self.overlap_param_gather = overlap_param_gather
        self._gathers: list[Optional[dist.Work]] = []  # per bucket, forward order; None once waited
        self._waited = 0  # the first bucket (forward order) not yet waited for
        self._pre_hooks = []
        # Per step, how many buckets each forward pre-hook that waited waited for (read by
        # tests and benchmarks): several entries = the gathers were spread over forward.
        self.forward_waits: list[int] = []

    # ---------------------------------------------------------------- layout

    def _build(self, order: list[torch.nn.Parameter], bucket_elements: int) -> None:
        dp, dp_rank = self.ps.dp_size, self.ps.dp_rank
        align = math.lcm(dp, BUCKET_ALIGNMENT)
        for dtype in dict.fromkeys(p.dtype for p in order):
            group = [p for p in order if p.dtype == dtype]
            plan: list[tuple[list[torch.nn.Parameter], int, int]] = []  # (members, start, padded end)
            offsets: dict[torch.nn.Parameter, int] = {}
            start, offset, members = 0, 0, []
            for p in group:
                if members and (self._isolate(p) or self._isolate(members[-1])
                                or offset + p.numel() - start > bucket_elements):
                    end = _round_up(offset, align)
                    plan.append((members, start, end))
                    start = offset = end
                    members = []
                offsets[p] = self.offsets[p] = offset
                members.append(p)
                offset += p.numel()
            plan.append((members, start, _round_up(offset, align)))
            total = plan[-1][2]
            grads = torch.zeros(total, dtype=dtype, device=group[0].device)
            values = torch.zeros(total, dtype=dtype, device=group[0].device)
            self.buffers[dtype], self.param_buffers[dtype] = grads, values
            for members, start, end in plan:
                for p in members:
                    o, n = offsets[p], p.numel()
                    view = values[o:o + n].view_as(p)
                    view.copy_(p.detach())
                    p.data = view  # the parameter now lives in the buffer: the all-gather writes it
                    self._views[p] = grads[o:o + n].view_as(p)
                bucket = _Bucket(grads[start:end], members)
                shard = (end - start) // dp
                lo, hi = start + dp_rank * shard, start + (dp_rank + 1) * shard
                bucket.start, bucket.params_flat = start, values[start:end]
                bucket.grad_shard, bucket.param_shard = grads[lo:hi], values[lo:hi]
                self._add_bucket(bucket)
                for p in members:
                    a, b = max(offsets[p], lo), min(offsets[p] + p.numel(), hi)
                    if a < b:
                        piece = Piece(p, a - offsets[p], b - offsets[p], values[a:b], grads[a:b])
                        setattr(piece.tensor, ATTR, getattr(p, ATTR))  # the spec: norms and sums read it
                        self.pieces.append(piece)

    def bucket_of(self, p: torch.nn.Parameter) -> _Bucket:
        return self._bucket_of[p]

    def _add_bucket(self, bucket) -> None:  # type: ignore[override]
        self.buckets.append(bucket)
        for p in bucket.params:
            self._bucket_of[p] = bucket

    # ---------------------------------------------------------------- gradients

    def start(self, num_micro_batches: int) -> None:
        self.forward_waits = []
        super().start(num_micro_batches)

    def _issue(self, bucket: _Bucket) -> None:
        if self.ring is not None:
            bucket.handle = self.ring.reduce_scatter(bucket.flat)
        else:
            bucket.handle = comm.reduce_scatter_tensor(bucket.grad_shard, bucket.flat, group=self.ps.dp_group,
                                                       async_op=True)

    def _complete(self, bucket: _Bucket, scale: float) -> None:
        bucket.handle.wait()
        bucket.grad_shard.mul_(scale)

    def finish(self) -> None:
        """The DP average of this rank's shards, as each piece's `.grad` (None for a
        parameter that got no gradient, which the optimizer then skips as plain DP does).
        Outside the shards the gradient buffer holds no meaningful values: the model's
        `.grad`s are not the averaged gradients after this; the pieces' are."""
        self.wait_params()  # no all-gather may still write a shard the optimizer is about to step
        super().finish()
        for piece in self.pieces:
            piece.tensor.grad = piece.grad if self._counts[piece.param] else None

    # ---------------------------------------------------------------- parameters

    def gather_params(self) -> None:
        """All-gathers every bucket's parameters after the optimizer stepped the shards, in
        the order forward needs them (on NCCL IN_FLIGHT at a time, each wait issuing the
        next); waits for them all unless `overlap_param_gather`."""
        self.wait_params()
        self._forward_order = list(reversed(self.buckets))
        self._gathers, self._waited = [], 0
        self._issue_gathers()
        if not self.overlap_param_gather:
            self.wait_params()

    def _issue_gathers(self) -> None:
        limit = len(self._forward_order) if self.ring is not None else self._waited + IN_FLIGHT
        while len(self._gathers) < min(limit, len(self._forward_order)):
            b = self._forward_order[len(self._gathers)]
            if self.ring is not None:
                work = self.ring.all_gather(b.params_flat)
            else:
                work = comm.all_gather_into_tensor(b.params_flat, b.param_shard, group=self.ps.dp_group,
                                                   async_op=True)
            self._gathers.append(work)

    def wait_params(self, upto: Optional[int] = None) -> None:
        """Waits for the all-gathers of the buckets up to `upto` (forward order; None: all)."""
        if not self._gathers:
            return
        last = len(self._forward_order) - 1 if upto is None else upto
        while self._waited <= last and self._waited < len(self._forward_order):
            self._issue_gathers()
            self._gathers[self._waited].wait()
            self._gathers[self._waited] = None
            self._waited += 1
            self._issue_gathers()

    def install_forward_hooks(self, model: torch.nn.Module) -> None:
        """A pre-hook on every module that holds parameters directly: before it runs, the
        buckets up to the last one holding its parameters have arrived. A parameter read
        by another module than its own (the last stage's copy of the tied embeddings, read
        by the MLM head) sits in an earlier bucket (forward order) than any module after
        it, since its bucket is the first gathered: buckets are waited for in order."""
        forward_index = {id(b): i for i, b in enumerate(reversed(self.buckets))}
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p in self._bucket_of]
            if not own:
                continue
            upto = max(forward_index[id(self._bucket_of[p])] for p in own)
            self._pre_hooks.append(module.register_forward_pre_hook(
                lambda mod, args, upto=upto: self._wait_in_forward(upto)))

    def _wait_in_forward(self, upto: int) -> None:
        before = self._waited
        self.wait_params(upto)
        if self._waited > before:
            self.forward_waits.append(self._waited - before)

    def close(self) -> None:
        self.wait_params()
        for h in self._pre_hooks:
            h.remove()
        self._pre_hooks = []
        if self.ring is not None:
            self.ring.close()
        super().close()


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
