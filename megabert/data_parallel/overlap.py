"""Data-parallel gradient averaging overlapped with backward.

Every parameter's `.grad` is a view into one contiguous buffer per dtype, so autograd
accumulates micro-batch after micro-batch straight into it and a bucket (a slice of the
buffer) is all-reduced as it stands: no flatten, no copy back. Buckets follow the
parameters in reverse order, the order backward produces their gradients. A hook on each
parameter's gradient accumulation counts it; once every parameter of a bucket has its
last micro-batch's gradient, the bucket's all-reduce is issued asynchronously while
backward goes on with earlier layers. `finish` waits for them just before the optimizer.

Why not torch's DistributedDataParallel: it wraps the module and reduces on every
backward (accumulation needs `no_sync`), knows nothing of pipeline stages whose chunks end
their backward at different times, and would own the buckets that our ParamSpec-driven
reductions (sequence-parallel LayerNorms over TP, the pipeline's tied embeddings) read.
Counting accumulations per parameter fits every schedule: a parameter is done after as
many accumulations as there are micro-batches, whichever chunk or stage holds it.

Buckets are issued strictly in order, each only after the ones before it, so every DP
rank issues the same collectives in the same order (what gloo and NCCL require) even if
two buckets become ready in another order. Averaging (sum, then x 1/DP) commutes with the
TP and embedding-group sums applied after `finish`, so their order changes nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megabert.parallel import ParallelState, comm


class _Bucket:
    def __init__(self, flat: torch.Tensor, params: list[torch.nn.Parameter]):
        self.flat, self.params = flat, params
        self.pending = len(params)
        self.handle: Optional[dist.Work] = None


class OverlappedGradReducer:
    """Owns the gradients of `params` (LocalStrategy at DP > 1). Per optimizer step:
    `start(num_micro_batches)` before the first backward, `finish()` after the last."""

    def __init__(self, params: list[torch.nn.Parameter], ps: ParallelState, bucket_elements: int):
        if bucket_elements < 1:
            raise ValueError("bucket_elements must be >= 1")
        self.ps = ps
        self.params = list(params)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self._views: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._bucket_of: dict[torch.nn.Parameter, _Bucket] = {}
        self._counts: dict[torch.nn.Parameter, int] = {}
        self._expected = 0
        self._next = 0  # the first bucket not yet issued
        self.issued_in_backward = 0  # buckets the last step issued before `finish`
        self._build(list(reversed(self.params)), bucket_elements)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _build(self, order: list[torch.nn.Parameter], bucket_elements: int) -> None:
        for dtype in dict.fromkeys(p.dtype for p in order):
            group = [p for p in order if p.dtype == dtype]
            buffer = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
            self.buffers[dtype] = buffer
            start, members, offset = 0, [], 0
            for p in group:
                if members and offset + p.numel() - start > bucket_elements:
                    self._add_bucket(buffer[start:offset], members)
                    start, members = offset, []
                self._views[p] = buffer[offset:offset + p.numel()].view_as(p)
                members.append(p)
                offset += p.numel()
            self._add_bucket(buffer[start:offset], members)

    def _add_bucket(self, flat: torch.Tensor, members: list[torch.nn.Parameter]) -> None:
        bucket = _Bucket(flat, members)
        self.buckets.append(bucket)
        for p in members:
            self._bucket_of[p] = bucket

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
        for bucket in self.buckets:
            bucket.pending, bucket.handle = len(bucket.params), None

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._expected:
            return  # a backward outside a training step (none is expected between finish and start)
        if p.grad is None or p.grad.data_ptr() != self._views[p].data_ptr():
            raise RuntimeError("a parameter's .grad was replaced during backward; the overlapped DP reduction "
                               "needs it to stay a view of its buffer (use --no-overlap-grad-reduce)")
        self._counts[p] += 1
        if self._counts[p] == self._expected:
            self._bucket_of[p].pending -= 1
            self._issue_ready()

    def _issue_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._issue(self.buckets[self._next])
            self._next += 1

    def _issue(self, bucket: _Bucket) -> None:
        """Starts a ready bucket's reduction (megabert.data_parallel.sharded_buffers reduce-scatters it)."""
        bucket.handle = comm.all_reduce(bucket.flat, group=self.ps.dp_group, async_op=True)

    def _complete(self, bucket: _Bucket, scale: float) -> None:
        """Waits for a bucket's reduction and averages what this rank keeps of it. A peer
        lost meanwhile: the door's handle raises CommunicationError once the DP group's
        timeout (--distributed-timeout-minutes) passes."""
        bucket.handle.wait()
        bucket.flat.mul_(scale)

    def finish(self) -> None:
        """Issues what backward did not (parameters that got fewer gradients than
        micro-batches), waits for every bucket and averages. Parameters that got no
        gradient at all are left with `.grad = None`, so the optimizer skips them as it
        would without the buffer."""
        self.issued_in_backward = self._next  # read by tests and benchmarks
        for bucket in self.buckets[self._next:]:
            bucket.pending = 0
        self._issue_ready()
        scale = 1.0 / self.ps.dp_size
        for bucket in self.buckets:
            self._complete(bucket, scale)
        for p, n in self._counts.items():
            if n == 0:
                p.grad = None
        self._expected = 0

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
