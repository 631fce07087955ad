"""Contiguous parameter and gradient buffers split over data parallelism, for the
distributed optimizer (megabert.data_parallel.distributed_optimizer).

The gradients are a GradBuckets (megabert.data_parallel.grad_buckets: the buckets in the
order backward produces gradients, issued as backward fills them), as OverlappedGradReducer
holds them, with three changes, as Megatron-LM's param_and_grad_buffer lays them out:
- every bucket is padded to a multiple of lcm(DP, 128) elements and split in DP equal
  shards; DP rank r owns shard r of every bucket (megabert.data_parallel.bucket_layout);
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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from megabert.data_parallel.bucket_layout import layout_buffers, pieces
from megabert.data_parallel.grad_buckets import Bucket, GradBuckets
from megabert.data_parallel.ring import RingCommunicator
from megabert.parallel import ParallelState, comm
from megabert.parallel.param_spec import ATTR

logger = logging.getLogger(__name__)


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


@dataclass(eq=False)
class ShardedBucket:
    """One bucket of both buffers."""

    grads: Bucket
    """The gradient side, which GradBuckets reduce-scatters: `grads.kept` is this rank's shard."""
    params_flat: torch.Tensor
    """Its span of the parameter buffer: what the all-gather fills."""
    param_shard: torch.Tensor
    """This rank's shard of it: what the optimizer steps."""

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.grads.params

    @property
    def start(self) -> int:
        return self.grads.start


class ShardedBuffers:
    """Owns the parameters' storage and gradients of `params` (DP > 1 or not). Per step:
    `start(n)` before the first backward, `finish()` after the last (this rank's shards
    then hold the averaged gradients: each piece's `.grad`), the optimizer steps the
    pieces, then `gather_params()`. `isolate(p)`: p gets a bucket of its own (the
    pipeline's tied word embeddings: both stages then shard it alike, so the shards can
    be summed over the embedding group)."""

    def __init__(self, params: list[torch.nn.Parameter], ps: ParallelState, bucket_elements: int, *,
                 isolate: Callable[[torch.nn.Parameter], bool] = lambda p: False, overlap_param_gather: bool = True):
        self.ps = ps
        self.params = list(params)
        self.ring: Optional[RingCommunicator] = None  # chosen below, once the shards' sizes are known
        layouts = layout_buffers(list(reversed(self.params)), bucket_elements, shards=ps.dp_size, shard=ps.dp_rank,
                                 isolate=isolate)
        self.param_buffers: dict[torch.dtype, torch.Tensor] = {}
        self.offsets: dict[torch.nn.Parameter, int] = {}  # where each parameter starts in its dtype's buffers
        for layout in layouts:
            values = self.param_buffers[layout.dtype] = torch.zeros(layout.size, dtype=layout.dtype,
                                                                    device=layout.device)
            self.offsets.update(layout.offsets)
            for p, o in layout.offsets.items():
                view = values[o:o + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view  # the parameter now lives in the buffer: the all-gather writes it
        self.grads = GradBuckets(self.params, layouts, ps.dp_size, self._reduce_scatter)
        self.pieces: list[Piece] = []
        self.buckets: list[ShardedBucket] = []
        grad_buckets = iter(self.grads.buckets)  # the layouts' buckets, in the layouts' order
        for layout in layouts:
            values, grads = self.param_buffers[layout.dtype], self.grads.buffers[layout.dtype]
            for span in layout.buckets:
                self.buckets.append(ShardedBucket(next(grad_buckets), values[span.start:span.end],
                                                  values[span.shard_start:span.shard_end]))
            for s in pieces(layout):
                n = s.hi - s.lo
                piece = Piece(s.param, s.lo, s.hi, values[s.at:s.at + n], grads[s.at:s.at + n])
                setattr(piece.tensor, ATTR, getattr(s.param, ATTR))  # the spec: norms and sums read it
                self.pieces.append(piece)
        # Chosen once, from the DP group's backend: gloo's own collectives stage copies (see
        # the module docstring); where the group is a single rank nothing is sent either way.
        # NOTE: new_dp_group is collective over the world; every rank builds its buffers here.
        if ps.dp_size > 1 and dist.get_backend(ps.dp_group) == "gloo":
            chunk_bytes = max(b.grads.kept.numel() * b.grads.kept.element_size() for b in self.buckets)
            self.ring = RingCommunicator(ps.new_dp_group(backend="gloo"), chunk_bytes, device=ps.device, label="dp")
            if ps.is_logging_rank:
                logger.info("distributed optimizer on gloo: gradient buckets reduce-scattered and parameters "
                            "all-gathered as rings of send/recv by a communication thread, in place (gloo's "
                            "reduce_scatter and all_gather copy whole buckets)")
        self.overlap_param_gather = overlap_param_gather
        self._gathers: list[Optional[dist.Work]] = []  # per bucket, forward order; None once waited
        self._waited = 0  # the first bucket (forward order) not yet waited for
        self._pre_hooks = []
        # Called with a bucket's parameters once its all-gather has landed (register_gather_hook).
        # (An OrderedDict: RemovableHandle holds a weak reference to it, which a dict refuses.)
        self._gather_hooks: OrderedDict[int, Callable[[list[torch.nn.Parameter]], None]] = OrderedDict()

    @property
    def buffers(self) -> dict[torch.dtype, torch.Tensor]:
        """The gradient buffers, one per dtype."""
        return self.grads.buffers

    def bucket_of(self, p: torch.nn.Parameter) -> ShardedBucket:
        return self.buckets[self.grads.index_of(p)]

    # ---------------------------------------------------------------- gradients

    def start(self, num_micro_batches: int) -> None:
        self.grads.start(num_micro_batches)

    def _reduce_scatter(self, bucket: Bucket):
        if self.ring is not None:
            return self.ring.reduce_scatter(bucket.flat)
        return comm.reduce_scatter_tensor(bucket.kept, bucket.flat, group=self.ps.dp_group, async_op=True)

    def finish(self) -> None:
        """The DP average of this rank's shards, as each piece's `.grad` (None for a
        parameter that got no gradient, which the optimizer then skips as plain DP does).
        Outside the shards the gradient buffer holds no meaningful values: the model's
        `.grad`s are not the averaged gradients after this; the pieces' are."""
        self.wait_params()  # no all-gather may still write a shard the optimizer is about to step
        self.grads.finish()
        for piece in self.pieces:
            piece.tensor.grad = piece.grad if self.grads.received(piece.param) else None

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
            for hook in self._gather_hooks.values():
                hook(self._forward_order[self._waited].params)
            self._waited += 1
            self._issue_gathers()

    def register_gather_hook(self, hook: Callable[[list[torch.nn.Parameter]], None]) -> RemovableHandle:
        """`hook(params)` runs as soon as the all-gather of the bucket holding `params` has
        been waited for (with `overlap_param_gather`, in the forward pre-hook that needs
        them). NOTE: the gathers write the parameters through views of the buffer, which
        leaves the parameters' own version counters where they were: what keeps something
        derived from a parameter's values (MasterWeights' bf16 copies) current hooks here."""
        handle = RemovableHandle(self._gather_hooks)
        self._gather_hooks[handle.id] = hook
        return handle

    def install_forward_hooks(self, model: torch.nn.Module) -> None:
        """A pre-hook on every module that holds parameters directly: before it runs, the
        buckets up to the last one holding its parameters have arrived. A parameter read
        by another module than its own (the last stage's copy of the tied embeddings, read
        by the MLM head) sits in an earlier bucket (forward order) than any module after
        it, since its bucket is the first gathered: buckets are waited for in order."""
        forward_index = {id(b): i for i, b in enumerate(reversed(self.buckets))}
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if self.grads.holds(p)]
            if not own:
                continue
            upto = max(forward_index[id(self.bucket_of(p))] for p in own)
            self._pre_hooks.append(module.register_forward_pre_hook(
                lambda mod, args, upto=upto: self.wait_params(upto)))

    def close(self) -> None:
        self.wait_params()
        for h in self._pre_hooks:
            h.remove()
        self._pre_hooks = []
        if self.ring is not None:
            self.ring.close()
        self.grads.close()

