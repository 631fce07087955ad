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

Matryoshka representation learning (Kusupati et al. 2022; sentence-transformers'
MatryoshkaLoss around MultipleNegativesRankingLoss): with `dims`, the loss is
sum_d weight_d x InfoNCE of the embeddings cut to their first d components (re-normalised
when the model normalises), so that every prefix is an embedding of its own. The
candidates are gathered once, full size, and cut after: the gradient of every cut reaches
its rank through the one gather's backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megabert.parallel import comm
from megabert.tensor_parallel.mappings import gather_from_dp, group_rank, group_size


@dataclass(frozen=True)
class Matryoshka:
    """The embedding sizes the loss trains and their weights; `normalize`: cut embeddings are
    re-normalised (the model's embeddings are)."""

    dims: tuple[int, ...]
    weights: tuple[float, ...]
    normalize: bool = True

    def cut(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x[..., :dim]
        return F.normalize(x, p=2, dim=-1) if self.normalize else x


def contrastive_loss(embeddings: torch.Tensor, text_mask: Optional[torch.Tensor], *, temperature: float,
                     dp_group: Optional[dist.ProcessGroup], matryoshka: Optional[Matryoshka] = None) -> torch.Tensor:
    """embeddings [b, T, h] (this rank's examples, T >= 2), text_mask [b, T] bool or None
    -> the mean InfoNCE loss of this rank's b queries against the global batch's candidates
    (with `matryoshka`, the weighted sum of it over the embedding sizes)."""
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
    targets = group_rank(dp_group) * b + torch.arange(b, device=embeddings.device)

    def info_nce(q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        logits = q @ c.t() / temperature  # [b, B + B*(T-2)] (the embeddings are fp32 or fp64)
        return F.cross_entropy(logits.masked_fill(~pool_valid, float("-inf")), targets)

    if matryoshka is None:
        return info_nce(queries, pool)
    return sum(w * info_nce(matryoshka.cut(queries, d), matryoshka.cut(pool, d))
               for d, w in zip(matryoshka.dims, matryoshka.weights))
