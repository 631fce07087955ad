"""Argmax over logits split along the vocab, without gathering them.

Masked-LM accuracy needs the predicted token, the argmax over the full vocabulary. With
tensor parallelism each rank holds a [..., V/tp] slice of the logits; gathering them would
cost a [tokens, V] all-gather per evaluation batch. Instead each rank reduces two numbers
per token over the TP group (the max, then the lowest index that reaches it), as the
vocab-parallel cross entropy does for the loss.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megabert.parallel import comm
from megabert.tensor_parallel.mappings import Group, group_rank, group_size


def vocab_parallel_argmax(logits: torch.Tensor, group: Group, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Global vocabulary index [...] (int64) of the largest logit, from this rank's slice
    [..., V/tp] of vocab-parallel logits (rank r holds columns r*V/tp .. (r+1)*V/tp - 1).

    Equals `torch.argmax` on the gathered full logits, ties included: the lowest global
    index wins, as torch.argmax returns the first maximum. Columns at or past `vocab_size`
    (the padding that makes the vocab divisible by 128 x TP) are left out, so a padding row
    can never be predicted whatever its logit. Collective over `group`; no gradient.
    """
    local_vocab = logits.size(-1)
    start = group_rank(group) * local_vocab
    if vocab_size is not None and start + local_vocab > vocab_size:
        # -inf rather than the model's fill value (the dtype's minimum): a real logit
        # that reaches the minimum still beats it, and a tie goes to a lower, real index.
        padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padding, float("-inf"))
    local_index = logits.argmax(dim=-1)  # the first maximum of this slice
    if group_size(group) == 1:
        return local_index
    # fp32 holds half and bf16 values exactly, and every backend reduces it.
    local_max = logits.gather(-1, local_index.unsqueeze(-1)).squeeze(-1).float()
    global_max = local_max.clone()
    comm.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    # Ranks whose slice reaches the global max offer their index; the lowest one wins.
    no_offer = torch.iinfo(torch.int64).max
    index = torch.where(local_max == global_max, local_index + start, torch.full_like(local_index, no_offer))
    comm.all_reduce(index, op=dist.ReduceOp.MIN, group=group)
    return index
