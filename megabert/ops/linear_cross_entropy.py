"""The MLM decoder and its loss as one op: logits = x @ weight[:vocab].T + bias[:vocab] and
each row's cross entropy, with a backward that never holds a [rows, vocab] gradient.

Why (issue 31, the seq 512 profile on the CPU): F.linear + F.cross_entropy write the
log-softmax output, a zero-filled gradient for nll_loss and the log-softmax gradient,
each [rows, vocab] (33.6 MB at seq 512, batch 4: past glibc's 32 MB mmap threshold, so
each one is fresh pages from the OS), and the three GEMMs of the backward then read that
gradient back from memory; slicing the padded word embeddings to the vocab adds a
zero-filled [padded vocab, h] gradient and a copy into it. On the 2-core AVX2 VM the
decoder's forward and backward took ~0.3 s of one core per step, about a third of it not
GEMM work.

Here the op walks the vocabulary in chunks of `CPU_CHUNK` columns. The forward keeps the
logits as those column chunks ([rows, chunk] each, 2.25 MB: from the heap, reused step
after step, where one [rows, vocab] buffer was 21 ms of page faults per step on one core)
and puts the [rows, vocab] logits together only if someone asks for them
(`LogitChunks.full`). The backward computes softmax x grad of one chunk into a
[rows, chunk] scratch that stays in cache while dx (summed over chunks), the chunk's rows
of dweight and its part of dbias are computed from it. The one-hot part of the gradient
(-grad at each row's target) is applied after the chunks as a gather of weight rows and an
accumulate into dweight's and dbias's target rows.

On the CPU the log-sum-exp over all chunks is one call of megabert's kernels and each
chunk's softmax x grad one more (one pass, the vectorised polynomial exp, one fork per
call, where PyTorch's logsumexp and sub/exp/mul were about ten ops per chunk, each its own
fork); PyTorch's ops where the kernels are not built (said once) and on CUDA. The loss and
gradients equal F.linear + F.cross_entropy's to float rounding (the sums group
differently), and are deterministic and the same at any thread count but for the GEMMs:
the kernels work row by row, and the CPU's index_put_ with accumulate is serial.
"""
from __future__ import annotations

from typing import Optional

import torch

from megabert import fused_kernels
from megabert.ops.dispatch import use_fused_kernel

# Vocab columns per chunk on the CPU: a [rows, 2048] fp32 chunk is 2.25 MB at rows = 275
# (seq 512, batch 4, 15% masked), within L3 with the weight rows it meets. On the AVX2 VM
# (PyTorch's ops for the elementwise part) 1024-2048 measured best, -25% on the decoder's
# forward + backward against F.linear + F.cross_entropy; 512 and 8192 gave back a third
# of that, the whole vocab in one chunk nearly all of it.
CPU_CHUNK = 2048


class LinearCrossEntropy(torch.autograd.Function):
    """(x [n, h], weight [V', h], bias [V'], target [n]) -> (loss [n], *logit chunks [n, chunk]),
    the chunks covering the first `vocab` <= V' rows of weight in order (the rows past
    vocab are padding: no logit, zero gradient). Rows whose target is `ignore_index` have
    zero loss and pass no gradient from it; gradients also flow back through the chunks."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, vocab: int, ignore_index: int, chunk: int, kernels):
        chunks = [torch.addmm(bias[begin:end], x, weight[begin:end].t())
                  for begin, end in _spans(vocab, chunk)]  # each [n, end - begin], contiguous
        if kernels is not None:  # one pass over every chunk's rows, one fork
            lse = kernels.cross_entropy_lse(chunks)  # [n]
        else:
            partial = torch.stack([torch.logsumexp(c, dim=1) for c in chunks], dim=1)  # [n, chunks]
            lse = torch.logsumexp(partial, dim=1)  # [n]
        valid = target != ignore_index
        safe_target = target.masked_fill(~valid, 0)
        # The target's logit as its own dot product: no [n, vocab] tensor to gather from.
        target_logit = torch.einsum("nh,nh->n", x, weight.index_select(0, safe_target)) + bias[safe_target]
        loss = (lse - target_logit).masked_fill(~valid, 0.0)
        ctx.save_for_backward(x, weight, lse, safe_target, valid, *chunks)
        ctx.vocab, ctx.chunk, ctx.kernels = vocab, chunk, kernels
        # An output nobody used gets None, not a tensor of zeros.
        ctx.set_materialize_grads(False)
        return (loss, *chunks)

    @staticmethod
    def backward(ctx, grad_loss, *grad_chunks):
        nothing = (None,) * 8
        if grad_loss is None and all(g is None for g in grad_chunks):
            return nothing
        x, weight, lse, safe_target, valid, *chunks = ctx.saved_tensors
        vocab, chunk, kernels = ctx.vocab, ctx.chunk, ctx.kernels
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        n = x.size(0)
        # d loss_r / d logits_r = grad_r * (softmax_r - one_hot(target_r)), plus the chunks' grads.
        g_rows = grad_loss.masked_fill(~valid, 0.0).contiguous() if grad_loss is not None else None  # [n]
        g = g_rows.unsqueeze(1) if g_rows is not None else None  # [n, 1]
        grad_x = torch.zeros_like(x) if want_x else None
        grad_w = torch.empty_like(weight) if want_w else None
        grad_b = weight.new_empty(weight.size(0)) if want_b else None
        if want_w:
            grad_w[vocab:].zero_()
        if want_b:
            grad_b[vocab:].zero_()
        scratch = x.new_empty(n, min(chunk, vocab))
        for (begin, end), logits, grad_logits in zip(_spans(vocab, chunk), chunks, grad_chunks):
            p = scratch[:, : end - begin]  # [n, chunk]
            if g is not None:
                if kernels is not None:
                    kernels.cross_entropy_grad(logits, lse, g_rows, p)
                else:
                    torch.sub(logits, lse.unsqueeze(1), out=p)
                    p.exp_().mul_(g)
                if grad_logits is not None:
                    p.add_(grad_logits)
            elif grad_logits is not None:
                p.copy_(grad_logits)
            else:
                p.zero_()
            if want_x:
                grad_x.addmm_(p, weight[begin:end])
            if want_w:
                torch.mm(p.t(), x, out=grad_w[begin:end])
            if want_b:
                torch.sum(p, dim=0, out=grad_b[begin:end])
        if g is not None:  # the one-hot part: -grad_r at (r, target_r)
            if want_x:
                grad_x.sub_(weight.index_select(0, safe_target) * g)
            if want_w:
                grad_w.index_put_((safe_target,), -(x * g), accumulate=True)
            if want_b:
                grad_b.index_put_((safe_target,), -g.squeeze(1), accumulate=True)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _spans(vocab: int, chunk: int) -> list[tuple[int, int]]:
    return [(begin, min(vocab, begin + chunk)) for begin in range(0, vocab, chunk)]


class LogitChunks:
    """The logits of `linear_cross_entropy` as its column chunks; `full()` puts them
    together into [*lead, vocab] the first time it is called (autograd flows back through
    the chunks into the op), so a training step that reads only the loss never allocates them."""

    def __init__(self, chunks: tuple[torch.Tensor, ...], lead: tuple[int, ...]):
        self._chunks, self._lead = chunks, lead
        self._full: Optional[torch.Tensor] = None

    def full(self) -> torch.Tensor:
        if self._full is None:
            whole = self._chunks[0] if len(self._chunks) == 1 else torch.cat(self._chunks, dim=1)
            self._full = whole.view(*self._lead, whole.size(1))
        return self._full


def supports_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear_cross_entropy` takes these: fp32 or fp64, one dtype, no autocast
    (under autocast the GEMM's dtype is autocast's to choose; the unfused path keeps it)."""
    return (x.dtype in (torch.float32, torch.float64) and weight.dtype == x.dtype
            and not torch.is_autocast_enabled(x.device.type))


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, target: torch.Tensor,
                         vocab: int, ignore_index: int = -100) -> tuple[torch.Tensor, LogitChunks]:
    """(per-row loss [...], logits) of x [..., h] against the first `vocab` rows of weight
    [V', h] and bias [V'], full-vocab targets [...] (`ignore_index`: no loss). Gradients
    reach x, all of weight and bias (zero past vocab), through the loss and the logits."""
    if not supports_linear_cross_entropy(x, weight):
        raise ValueError(f"linear_cross_entropy takes float32 or float64 x and weight of one dtype outside "
                         f"autocast, got {x.dtype} and {weight.dtype}")
    lead = tuple(x.shape[:-1])
    if x.device.type == "cpu":
        chunk = CPU_CHUNK
        kernels = fused_kernels.kernels_for("cpu") if use_fused_kernel("MLM cross entropy", "cpu", None) else None
    else:
        # NOTE: one chunk and PyTorch's ops elsewhere (cuBLAS wants the whole GEMM; the cache
        # argument and the kernels are the CPU's).
        chunk, kernels = vocab, None
    loss, *chunks = LinearCrossEntropy.apply(x.reshape(-1, x.size(-1)), weight, bias, target.reshape(-1), vocab,
                                             ignore_index, chunk, kernels)
    return loss.view(lead), LogitChunks(tuple(chunks), lead)
