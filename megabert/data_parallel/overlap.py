"""Data-parallel gradient averaging overlapped with backward: each bucket of the gradient
buffer (megabert.data_parallel.grad_buckets) is all-reduced as soon as backward has filled
it, while backward goes on with earlier layers; `finish` waits for them just before the
optimizer.

Why not torch's DistributedDataParallel: it wraps the module and reduces on every
backward (accumulation needs `no_sync`), knows nothing of pipeline stages whose chunks end
their backward at different times, and would own the buckets that our ParamSpec-driven
reductions (sequence-parallel LayerNorms over TP, the pipeline's tied embeddings) read.

Averaging (sum, then x 1/DP) commutes with the TP and embedding-group sums applied after
`finish`, so their order changes nothing.
"""
from __future__ import annotations

import torch

from megabert.data_parallel.bucket_layout import layout_buffers
from megabert.data_parallel.grad_buckets import Bucket, GradBuckets
from megabert.parallel import ParallelState, comm


class OverlappedGradReducer:
    """Owns the gradients of `params` (LocalStrategy at DP > 1). Per optimizer step:
    `start(num_micro_batches)` before the first backward, `finish()` after the last."""

    def __init__(self, params: list[torch.nn.Parameter], ps: ParallelState, bucket_elements: int):
        self.ps = ps
        self.params = list(params)
        layouts = layout_buffers(list(reversed(self.params)), bucket_elements)
        self.grads = GradBuckets(self.params, layouts, ps.dp_size, self._all_reduce)

    def _all_reduce(self, bucket: Bucket):
        return comm.all_reduce(bucket.flat, group=self.ps.dp_group, async_op=True)

    @property
    def buckets(self) -> list[Bucket]:
        return self.grads.buckets

    @property
    def buffers(self) -> dict[torch.dtype, torch.Tensor]:
        return self.grads.buffers

    def start(self, num_micro_batches: int) -> None:
        self.grads.start(num_micro_batches)

    def finish(self) -> None:
        self.grads.finish()

    def close(self) -> None:
        self.grads.close()
