"""Point-to-point transfers between neighbouring pipeline stages.

Sends are asynchronous (isend; the handle and the tensor are kept until the send completes),
receives block until the tensor is there. A schedule that is a valid order of the
pipeline's forward/backward DAG therefore cannot deadlock: a rank only ever waits for
something its neighbour produces without waiting on this rank first.

Activations travel forward on `pp_group` and gradients backward on
`pp_backward_group`. With NCCL (which ignores tags) each communicator matches
messages in issue order per (src, dst), and a schedule issues the sends and the
receives of one kind in the same (chunk, micro-batch) order on both ends; giving each
kind its own communicator keeps that order even when the two kinds flow between the
same pair of ranks (two stages, interleaved). gloo also gets a tag per message.

Stage s sends to s+1 and receives from s-1, with wrap-around: in the interleaved
schedule the last stage's model chunk v feeds the first stage's chunk v+1.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megabert.parallel import ParallelState, comm


def pipeline_dtype(bf16: bool) -> torch.dtype:
    """What stages exchange. Under bf16 the activations and their gradients travel as
    bf16 (Megatron's choice): half the bytes of fp32, and bf16 has fp32's range, so nothing
    overflows; the receiving stage's first LayerNorm runs in fp32 under autocast anyway.
    fp32 and fp16 runs exchange fp32 (scaled fp16 gradients could overflow in transit)."""
    return torch.bfloat16 if bf16 else torch.float32


class PipeComm:
    """Sends and receives [s, b, h] activations and their gradients for one pipeline."""

    def __init__(self, ps: ParallelState, shape: tuple[int, ...], dtype: torch.dtype):
        self.ps, self.shape, self.dtype = ps, tuple(shape), dtype
        self.next_rank = ps.pp_rank_to_global(ps.pp_rank + 1)
        self.prev_rank = ps.pp_rank_to_global(ps.pp_rank - 1)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        # gloo matches by tag; NCCL ignores it (see the module docstring).
        self._use_tags = ps.backend == "gloo"

    def _tag(self, tag: int) -> int:
        return tag if self._use_tags else 0

    def _send(self, tensor: torch.Tensor, dst: int, group, tag: int) -> None:
        t = tensor.detach().to(self.dtype).contiguous()
        if tuple(t.shape) != self.shape:
            raise RuntimeError(f"pipeline stage produced a tensor of shape {tuple(t.shape)}, the receiving stage "
                               f"expects {self.shape}: every micro-batch must have --seq-length and "
                               f"--micro-batch-size")
        # Completed sends let go of their buffers (a sent stage output is freed then).
        self._pending = [(work, buf) for work, buf in self._pending if not work.is_completed()]
        self._pending.append((comm.isend(t, dst, group=group, tag=self._tag(tag)), t))

    def _recv(self, src: int, group, tag: int) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=self.dtype, device=self.ps.device)
        comm.irecv(t, src, group=group, tag=self._tag(tag)).wait()
        return t

    def send_forward(self, activation: torch.Tensor, tag: int) -> None:
        self._send(activation, self.next_rank, self.ps.pp_group, tag)

    def recv_forward(self, tag: int) -> torch.Tensor:
        """The previous stage's output, as a leaf that collects its gradient."""
        return self._recv(self.prev_rank, self.ps.pp_group, tag).requires_grad_()

    def send_backward(self, grad: Optional[torch.Tensor], tag: int) -> None:
        if grad is None:  # the input did not reach the loss (cannot happen in BERT): say so
            raise RuntimeError("pipeline stage input received no gradient; the stage's output does not depend "
                               "on its input")
        self._send(grad, self.prev_rank, self.ps.pp_backward_group, tag)

    def recv_backward(self, tag: int) -> torch.Tensor:
        return self._recv(self.next_rank, self.ps.pp_backward_group, tag)

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
