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

The step is multi-tensor, per param group: torch._foreach_* ops for the moments, the
update and the norms (one launch per op on CUDA rather than one per tensor), one stacked
all-reduce over the TP group, the trust ratios as one tensor. Nothing in it waits for the
device: the step counters live with the parameters and the bias corrections are tensors
computed from them. Global-norm clipping folds in (megabert.optim.clip.clipped_step): with
`clip_coeff` set, a device tensor, the gradients are scaled by it as the step takes them in
(16-bit gradients: their fp32 copies, which the step makes anyway). The state is torch's layout (per parameter `step`, a float32 scalar,
and fp32 `exp_avg`, `exp_avg_sq`), so checkpoints of the per-tensor version load as they
are.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megabert.parallel import comm
from megabert.parallel.param_spec import spec_of


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
        self.clip_coeff: Optional[torch.Tensor] = None

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        elif state["step"].device != p.device:
            # A checkpoint is read onto the CPU (and the per-tensor version kept its counters
            # there): one copy, then the counter stays with the parameter.
            state["step"] = state["step"].to(p.device)
        return state

    def _norms(self, params: list, fp32_params: list, updates: list) -> tuple[torch.Tensor, torch.Tensor]:
        """||w|| and ||update|| per tensor, [n] each; whole-matrix norms for TP-split tensors
        (`params` are the parameters, whose ParamSpec says which; `fp32_params` their values in
        fp32, where a 16-bit parameter's copy carries no spec)."""
        w = list(torch._foreach_norm(fp32_params, 2, dtype=torch.float32))
        u = list(torch._foreach_norm(updates, 2))
        tp_split = self.tp_group is not None and dist.get_world_size(self.tp_group) > 1
        split = [i for i, p in enumerate(params) if spec_of(p).is_tensor_parallel] if tp_split else []
        if split:
            # Only split tensors' norms are partial: their squares are summed, in one call.
            squares = torch.stack([w[i] for i in split] + [u[i] for i in split]).square()
            comm.all_reduce(squares, group=self.tp_group)
            whole = squares.sqrt()
            for j, i in enumerate(split):
                w[i], u[i] = whole[j], whole[len(split) + j]
        return torch.stack(w), torch.stack(u)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            work = self._updates(group)
            if work is None:
                continue
            params, updates, fp32_params = work
            w_norm, u_norm = self._norms(params, fp32_params, updates)
            self._apply(group, params, updates, w_norm, u_norm)
        return loss

    def _updates(self, group: dict) -> Optional[tuple[list, list, list]]:
        """Steps the moments of `group`'s parameters that have a gradient; returns (params,
        their updates, the params in fp32), or None when none has a gradient."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return None
        beta1, beta2 = group["betas"]
        states = [self._state(p) for p in params]
        grads = [p.grad if p.grad.dtype == torch.float32 else p.grad.float() for p in params]
        if self.clip_coeff is not None:
            torch._foreach_mul_(grads, self.clip_coeff)
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        # update = m_hat / (sqrt(v_hat) + eps), computed in one group-sized buffer (the
        # per-tensor version held the updates too): 1 / (bc1 (sqrt(v) / sqrt(bc2) + eps)) * m.
        updates = torch._foreach_sqrt(exp_avg_sqs)
        if group["bias_correction"]:
            t = torch.stack(steps).double()  # [n]; float64 as the host-side corrections were
            bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
            torch._foreach_mul_(updates, list((bc1 / bc2.sqrt()).unbind(0)))
            torch._foreach_add_(updates, list((bc1 * group["eps"]).unbind(0)))
        else:
            torch._foreach_add_(updates, group["eps"])
        torch._foreach_reciprocal_(updates)
        torch._foreach_mul_(updates, exp_avgs)
        fp32_params = [p if p.dtype == torch.float32 else p.float() for p in params]
        if group["weight_decay"]:
            torch._foreach_add_(updates, fp32_params, alpha=group["weight_decay"])
        return params, updates, fp32_params

    @staticmethod
    def _apply(group: dict, params: list, updates: list, w_norm: torch.Tensor, u_norm: torch.Tensor) -> None:
        # trust = ||w|| / ||u|| clamped to the bounds; 1 where either norm is zero (fresh
        # zero-init biases). A group restored from a checkpoint written before the lower
        # bound existed has no "min_trust_ratio": it trained without one.
        both = (w_norm > 0) & (u_norm > 0)
        ratio = (w_norm / u_norm).clamp(min=group.get("min_trust_ratio", 0.0), max=group["max_trust_ratio"])
        scale = torch.where(both, ratio, torch.ones_like(w_norm)) * -group["lr"]
        torch._foreach_addcmul_(params, updates, list(scale.unbind(0)))
