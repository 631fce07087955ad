"""Pipeline schedules: 1F1B and interleaved 1F1B (Narayanan et al., 2021), and the
forward-only pass used for evaluation.

A stage model exposes

    stage                               its StageLayout (megabert.parallel.layout): num_chunks
                                        on this rank (1 unless interleaved), global_chunk(v),
                                        is_first_chunk(v) / is_last_chunk(v)
    forward_chunk(v, hidden, batch)     chunk v: hidden [s, b, h] -> hidden, or, for the
                                        model's very last chunk, the model output that
                                        `output_loss` turns into (loss, metrics)

Global chunk g = v * pp_size + pp_rank: chunk 0 holds the embeddings, the last one the
heads and the loss. Each micro-batch's loss is scaled by loss_scale / num_micro before
its backward, so the accumulated gradients are the mean over the global batch exactly
as without pipelining, and the losses equal PP=1's.

1F1B: stage s runs pp - s - 1 warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards; at most pp - s micro-batches' activations
are alive. Interleaved: the same with V chunks per rank, visited in groups of pp
micro-batches, which shrinks the bubble by V at the cost of V times the messages.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megabert.errors import ConfigError
from megabert.parallel import ParallelState
from megabert.pipeline_parallel.p2p import PipeComm


@dataclass
class _Step:
    """What one micro-batch left on one chunk for its backward."""

    input: Optional[torch.Tensor]
    output: torch.Tensor


def release_storage(out: torch.Tensor) -> None:
    """Frees a sent stage output's [s, b, h] buffer, keeping the tensor as backward's root.

    Backward needs only the output's autograd node (and its shape); what the node's
    functions saved for themselves stays with them. The data is the next stage's input from
    now on, so keeping it here would hold one extra activation per micro-batch in flight
    (Megatron-LM's deallocate_output_tensor). The buffer goes once the asynchronous send
    has let go of it (PipeComm drops completed sends). A zero-stride view of one element
    keeps the tensor's shape, so `torch.autograd.backward(out, grad)` still checks the
    gradient's shape against it."""
    out.data = torch.empty((), dtype=out.dtype, device=out.device).expand(out.shape)


def check_interleaving(num_micro: int, ps: ParallelState, num_chunks: int) -> None:
    if num_chunks > 1 and num_micro % ps.pp_size:
        raise ConfigError(f"the interleaved schedule needs the number of micro-batches per step ({num_micro} = "
                          f"--global-batch-size / (--micro-batch-size x data-parallel size)) to be a multiple of "
                          f"--pipeline-model-parallel-size {ps.pp_size}; change the batch sizes or drop "
                          f"--num-layers-per-virtual-pipeline-stage")


class PipelineSchedule:
    """Runs one global batch through this rank's stage(s). Collective over the pipeline."""

    keeps_grads = False  # a runner's flag (training.strategy): the strategy sets .grad to None before a step

    def __init__(self, model, ps: ParallelState, comm: PipeComm, num_micro: int, task,
                 autocast: Callable[[], AbstractContextManager] = nullcontext):
        """`task.train_loss(last chunk's output, batch) -> (loss, {name: scalar})` (a
        training.strategy.TrainingTask)."""
        check_interleaving(num_micro, ps, model.stage.num_chunks)
        self.model, self.stage, self.ps, self.comm, self.num_micro = model, model.stage, ps, comm, num_micro
        self.task, self.autocast = task, autocast
        self.V, self.P, self.rank = self.stage.num_chunks, ps.pp_size, ps.pp_rank

    # ---------------------------------------------------------------- bookkeeping

    def _chunk_of(self, k: int, forward: bool) -> int:
        """Local chunk of this rank's k-th forward (or backward) step."""
        v = (k % (self.P * self.V)) // self.P
        return v if forward else self.V - 1 - v

    def _micro_of(self, k: int) -> int:
        return (k // (self.P * self.V)) * self.P + k % self.P

    def _tag(self, global_chunk: int, micro: int) -> int:
        """Names a message by the chunk that receives it and its micro-batch."""
        return global_chunk * self.num_micro + micro

    # ---------------------------------------------------------------- one step of work

    def _forward(self, v: int, micro: int, batches: list[dict], metrics: list[dict], scale: float,
                 output_fn: Optional[Callable] = None) -> _Step:
        g = self.stage.global_chunk(v)
        x = None if self.stage.is_first_chunk(v) else self.comm.recv_forward(self._tag(g, micro))
        with self.autocast():
            out = self.model.forward_chunk(v, x, batches[micro])
        if self.stage.is_last_chunk(v):
            if output_fn is not None:  # forward only: whatever the caller wants of the output
                metrics.append(output_fn(out))
                return _Step(x, out)
            loss, m = self.task.train_loss(out, batches[micro])
            metrics.append({k: t.detach() for k, t in m.items()})
            return _Step(x, loss * scale)
        self.comm.send_forward(out, self._tag(g + 1, micro))
        if out.requires_grad:
            release_storage(out)
        return _Step(x, out)

    def _backward(self, v: int, micro: int, step: _Step) -> None:
        g = self.stage.global_chunk(v)
        if self.stage.is_last_chunk(v):
            torch.autograd.backward(step.output)
        else:
            grad = self.comm.recv_backward(self._tag(g, micro))
            torch.autograd.backward(step.output, grad.to(step.output.dtype))
        if step.input is not None:
            self.comm.send_backward(step.input.grad, self._tag(g - 1, micro))

    # ---------------------------------------------------------------- schedules

    def forward_backward(self, batches: list[dict], loss_scale: float = 1.0) -> list[dict]:
        """Forward and backward of every micro-batch; returns the per-micro-batch metrics
        (on the last stage; an empty list elsewhere). Gradients accumulate in .grad."""
        assert len(batches) == self.num_micro
        scale = loss_scale / self.num_micro
        metrics: list[dict] = []
        total = self.num_micro * self.V
        if self.V == 1:
            warmup = min(self.P - self.rank - 1, total)
        elif self.num_micro == self.P:
            warmup = total  # too few micro-batches to reach a steady state: all forwards first
        else:
            warmup = min((self.P - self.rank - 1) * 2 + (self.V - 1) * self.P, total)
        saved: dict[tuple[int, int], _Step] = {}
        fwd_k = bwd_k = 0

        def forward_next():
            nonlocal fwd_k
            v, m = self._chunk_of(fwd_k, True), self._micro_of(fwd_k)
            saved[(v, m)] = self._forward(v, m, batches, metrics, scale)
            fwd_k += 1

        def backward_next():
            nonlocal bwd_k
            v, m = self._chunk_of(bwd_k, False), self._micro_of(bwd_k)
            self._backward(v, m, saved.pop((v, m)))
            bwd_k += 1

        for _ in range(warmup):
            forward_next()
        for _ in range(total - warmup):  # steady state: one forward, one backward
            forward_next()
            backward_next()
        while bwd_k < total:
            backward_next()
        self.comm.wait_sends()
        return metrics

    @torch.no_grad()
    def forward_only(self, batches: list[dict], output_fn: Callable) -> list:
        """Evaluation and prediction: every micro-batch through every chunk, no backward;
        the last stage returns `output_fn(output)` per micro-batch (other stages: [])."""
        metrics: list = []
        for m in range(len(batches)):
            for v in range(self.V):
                self._forward(v, m, batches, metrics, 1.0, output_fn)
        self.comm.wait_sends()
        return metrics
