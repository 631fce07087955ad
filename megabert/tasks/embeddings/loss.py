"""InfoNCE with in-batch and hard negatives from the whole global batch.

Each example is T texts: its query (slot 0), its positive (slot 1) and hard negatives
(slots 2..T-1; `text_mask` says which slots hold one, rows may have fewer). Every query
is scored against every positive and every hard negative of the global batch:

    loss = mean over queries i of  -log softmax_j(sim(q_i, c_j) / temperature)[pos(i)]

with c = [all positives; all hard negatives], sim the dot product of the (normalised)
embeddings: sentence-transformers' MultipleNegativesRankingLoss (scale = 1/temperature)
over the global batch. A rank scores its own queries; the candidates of every DP rank
come through GatherFromDataParallelRegion, whose backward hands each rank the summed
gradient of its candidates. Each rank's loss is the mean over its queries, the DP
average of them the global batch's loss.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megabert.parallel import comm
from megabert.tensor_parallel.mappings import gather_from_dp, group_rank, group_size


def contrastive_loss(embeddings: torch.Tensor, text_mask: Optional[torch.Tensor], *, temperature: float,
                     dp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """embeddings [b, T, h] (this rank's examples, T >= 2), text_mask [b, T] bool or None
    -> the mean InfoNCE loss of this rank's b queries against the global batch's candidates."""
    b, t, h = embeddings.shape
    queries = embeddings[:, 0]  # [b, h]
    candidates = gather_from_dp(embeddings[:, 1:].contiguous(), dp_group)  # [B, T-1, h], DP ranks in order
    big_b = candidates.size(0)
    if text_mask is None:
        valid = torch.ones(big_b, t - 1, dtype=torch.bool, device=embeddings.device)
    else:
        valid = text_mask[:, 1:].contiguous()
        if group_size(dp_group) > 1:
            parts = [torch.empty_like(valid) for _ in range(group_size(dp_group))]
            comm.all_gather(parts, valid, group=dp_group)
            valid = torch.cat(parts)
    # Positives first ([B, h]), then the hard negatives ([B*(T-2), h]).
    pool = torch.cat([candidates[:, 0], candidates[:, 1:].reshape(-1, h)])
    pool_valid = torch.cat([valid[:, 0], valid[:, 1:].reshape(-1)])
    logits = queries @ pool.t() / temperature  # [b, B + B*(T-2)] (the embeddings are fp32 or fp64)
    logits = logits.masked_fill(~pool_valid, float("-inf"))
    targets = group_rank(dp_group) * b + torch.arange(b, device=embeddings.device)
    return F.cross_entropy(logits, targets)
