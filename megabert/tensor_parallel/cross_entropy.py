"""Cross entropy over logits split along the vocab, without gathering them.

Gathering [tokens, vocab] logits to one rank costs vocab/tp times more memory and
traffic than needed; instead each rank reduces three scalars per token over the TP
group (max, target logit, sum of exps), as in Megatron-LM.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megabert.parallel import comm
from megabert.tensor_parallel.mappings import Group, group_rank, group_size


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token -log softmax(logits)[target], reducing max, target logit and
    sum-exp over the TP group. Backward: softmax - one_hot(target), local slice only.
    Targets equal to `ignore_index` give zero loss and zero gradient."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        ctx.in_dtype = logits.dtype
        logits = logits.float()
        tp = group_size(group)
        local_vocab = logits.size(-1)
        start = group_rank(group) * local_vocab

        logits_max = logits.max(dim=-1)[0]
        if tp > 1:
            comm.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        ignored = target == ignore_index
        outside = (target < start) | (target >= start + local_vocab) | ignored
        local_target = (target - start).masked_fill(outside, 0)
        flat = shifted.view(-1, local_vocab)
        arange = torch.arange(flat.size(0), device=flat.device)
        target_logit = flat[arange, local_target.view(-1)].view_as(target).masked_fill(outside, 0.0)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if tp > 1:
            both = torch.stack([target_logit, sum_exp])
            comm.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target, ignored = ctx.saved_tensors
        grad = softmax  # reused in place: the saved buffer is not needed after this
        flat = grad.view(-1, grad.size(-1))
        arange = torch.arange(flat.size(0), device=flat.device)
        flat[arange, local_target.view(-1)] -= (~outside).view(-1).to(flat.dtype)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss [...] from vocab-parallel logits [..., V/tp] and full-vocab targets [...]."""
    if group_size(group) == 1:  # the whole vocab is here: PyTorch's fused kernel is faster
        flat = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1),
                               ignore_index=ignore_index, reduction="none")
        return flat.view_as(target)
    return VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)
