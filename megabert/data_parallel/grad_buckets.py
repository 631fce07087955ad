"""The gradient buffers and their buckets, reduced over data parallelism while backward runs:
the component both of megabert's reducers are built on (overlap.py: plain DP's all-reduce;
sharded_buffers.py: the distributed optimizer's reduce-scatter). Each owns one GradBuckets
and hands it a layout and a collective; neither reaches into its counting.

Every parameter's `.grad` is a view into one contiguous buffer per dtype, so autograd
accumulates micro-batch after micro-batch straight into it and a bucket (a slice of the
buffer) is reduced as it stands: no flatten, no copy back. A hook on each parameter's
gradient accumulation counts it; once every parameter of a bucket has its last
micro-batch's gradient, the bucket's collective is issued asynchronously while backward
goes on with earlier layers. Counting accumulations per parameter fits every schedule: a
parameter is done after as many accumulations as there are micro-batches, whichever
pipeline chunk holds it.

Buckets are issued strictly in order, each only after the ones before it, so every DP
rank issues the same collectives in the same order (what gloo and NCCL require) even if
two buckets become ready in another order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from megabert.data_parallel.bucket_layout import BufferLayout


class Waitable(Protocol):
    """An issued collective: torch's Work, the communication door's, a ring's."""

    def wait(self) -> bool: ...


class GradReducer(Protocol):
    """What a training step asks of a DP reducer: `start(n)` before the first of n
    micro-batches' backward, `finish()` after the last (the averaged gradients are then
    in place), `close()` when training ends."""

    def start(self, num_micro_batches: int) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class Bucket:
    """One message of the DP reduction."""

    params: list[torch.nn.Parameter]
    """Its parameters, in the order backward produces their gradients."""
    start: int
    """Where it begins in its dtype's buffers."""
    flat: torch.Tensor
    """Its span of the gradient buffer, padding included: what the collective reads."""
    kept: torch.Tensor
    """What this rank holds reduced and averaged after `finish`: `flat` itself, or this
    rank's shard of it (a view into `flat`)."""


class GradBuckets:
    """The gradients of `params` in the buffers `layouts` describe (their parameters, in
    backward order, are exactly `params`).

    Contract. From `start(n)` to `finish()` every parameter's `.grad` is a view of its
    dtype's buffer. `reduce(bucket)` is called once per bucket and step, in bucket order on
    every rank, as soon as all the bucket's parameters got their n-th gradient (`finish`
    issues the rest), and returns the collective's handle; the collective must leave the
    sum over the DP group in `bucket.kept`. `finish()` waits for every handle and divides
    each `kept` by `dp_size`; a parameter that got no gradient is left with `.grad = None`
    (`received(p)` says which did), so an optimizer skips it as it would without a buffer.
    """

    def __init__(self, params: list[torch.nn.Parameter], layouts: list[BufferLayout], dp_size: int,
                 reduce: Callable[[Bucket], Waitable]):
        self.params = list(params)
        self._reduce, self._scale = reduce, 1.0 / dp_size
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.buckets: list[Bucket] = []
        self._views: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._index: dict[torch.nn.Parameter, int] = {}  # parameter -> its bucket's number
        for layout in layouts:
            buffer = self.buffers[layout.dtype] = torch.zeros(layout.size, dtype=layout.dtype, device=layout.device)
            for span in layout.buckets:
                for p in span.params:
                    o = layout.offsets[p]
                    self._views[p] = buffer[o:o + p.numel()].view_as(p)
                    self._index[p] = len(self.buckets)
                self.buckets.append(Bucket(span.params, span.start, buffer[span.start:span.end],
                                           buffer[span.shard_start:span.shard_end]))
        if set(self._views) != set(self.params) or len(self._views) != len(self.params):
            raise ValueError("the buffer layouts must hold every parameter given, once")
        self._counts: dict[torch.nn.Parameter, int] = {}
        self._pending = [0] * len(self.buckets)  # per bucket: parameters still waiting for gradients
        self._handles: list = [None] * len(self.buckets)
        self._expected = 0
        self._next = 0  # the first bucket not yet issued
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def index_of(self, p: torch.nn.Parameter) -> int:
        """The number of the bucket holding `p` (backward order)."""
        return self._index[p]

    def holds(self, p: torch.nn.Parameter) -> bool:
        return p in self._index

    def received(self, p: torch.nn.Parameter) -> bool:
        """Whether `p` got a gradient in the step `finish` ended."""
        return self._counts.get(p, 0) > 0

    def start(self, num_micro_batches: int) -> None:
        """Zeroes the buffers and points every `.grad` at its view (an optimizer's
        zero_grad(set_to_none=True) or a skipped step may have dropped them)."""
        for buffer in self.buffers.values():
            buffer.zero_()
        for p, view in self._views.items():
            p.grad = view
        self._counts = {p: 0 for p in self.params}
        self._expected = num_micro_batches
        self._next = 0
        self._pending = [len(b.params) for b in self.buckets]
        self._handles = [None] * len(self.buckets)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._expected:
            return  # a backward outside a training step (none is expected between finish and start)
        if p.grad is None or p.grad.data_ptr() != self._views[p].data_ptr():
            raise RuntimeError("a parameter's .grad was replaced during backward; the overlapped DP reduction "
                               "needs it to stay a view of its buffer (use --no-overlap-grad-reduce)")
        self._counts[p] += 1
        if self._counts[p] == self._expected:
            self._pending[self._index[p]] -= 1
            self._issue_ready()

    def _issue_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._handles[self._next] = self._reduce(self.buckets[self._next])
            self._next += 1

    def finish(self) -> None:
        """Issues what backward did not (parameters that got fewer gradients than
        micro-batches), waits for every bucket and averages what this rank keeps. A peer
        lost meanwhile: the door's handle raises CommunicationError once the DP group's
        timeout (--distributed-timeout-minutes) passes."""
        for i in range(self._next, len(self.buckets)):
            self._pending[i] = 0
        self._issue_ready()
        for bucket, handle in zip(self.buckets, self._handles):
            handle.wait()
            bucket.kept.mul_(self._scale)
        for p, n in self._counts.items():
            if n == 0:
                p.grad = None
        self._expected = 0

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
