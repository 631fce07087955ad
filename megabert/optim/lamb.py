"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning"): Adam moments
with a per-tensor trust ratio ||w|| / ||update||, which keeps BERT stable at 32k-64k
batch sizes (the NVIDIA and DeepSpeed BERT recipes).

With tensor parallelism a weight is split over ranks, but its trust ratio must use the
norms of the whole matrix, or TP=2 would train a different model than TP=1: the squared
norms of split tensors are summed over the TP group.

The trust ratio is clamped to [min_trust_ratio, max_trust_ratio] (DeepSpeed's min_coeff /
max_coeff: 0.01 and 0.3 in its BERT tutorial, 10 in the original LAMB code); a tensor
whose weight or update norm is zero (a fresh zero-initialised bias) takes ratio 1,
unclamped, as DeepSpeed's fused LAMB does.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 bias_correction: bool = True, min_trust_ratio: float = 0.0, max_trust_ratio: float = 10.0,
                 tp_group: Optional[dist.ProcessGroup] = None):
        if lr <= 0 or eps <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps}")
        if not 0 <= min_trust_ratio <= max_trust_ratio:
            raise ValueError(f"invalid LAMB trust-ratio bounds [{min_trust_ratio}, {max_trust_ratio}]")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        min_trust_ratio=min_trust_ratio, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)
        self.tp_group = tp_group

    def _norms(self, params: list, updates: list) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.stack([p.detach().float().pow(2).sum() for p in params])
        u = torch.stack([x.float().pow(2).sum() for x in updates])
        split = torch.tensor([bool(getattr(p, "tensor_model_parallel", False)) for p in params])
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1 and split.any():
            both = torch.stack([w * split, u * split])  # only split tensors' norms are partial
            dist.all_reduce(both, group=self.tp_group)
            w = torch.where(split, both[0], w)
            u = torch.where(split, both[1], u)
        return w.sqrt(), u.sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params, updates = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                g = p.grad.float()
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if group["bias_correction"]:
                    step = state["step"].item()
                    m = m / (1 - beta1 ** step)
                    v = v / (1 - beta2 ** step)
                update = m / (v.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update = update.add(p.float(), alpha=group["weight_decay"])
                params.append(p)
                updates.append(update)
            if not params:
                continue
            w_norm, u_norm = self._norms(params, updates)
            # trust = ||w|| / ||u|| clamped to the bounds; 1 where either norm is zero (fresh
            # zero-init biases). A group restored from a checkpoint written before the lower
            # bound existed has no "min_trust_ratio": it trained without one.
            both = (w_norm > 0) & (u_norm > 0)
            ratio = (w_norm / u_norm).clamp(min=group.get("min_trust_ratio", 0.0), max=group["max_trust_ratio"])
            trust = torch.where(both, ratio, torch.ones_like(w_norm))
            for p, update, t in zip(params, updates, trust):
                p.add_((update * (-group["lr"] * t)).to(p.dtype))
        return loss
