"""Adam with decoupled weight decay (AdamW, Loshchilov & Hutter 2019) and a switch for the
bias correction of its moments.

torch.optim.AdamW always corrects the moments for their zero start. The DeepSpeed BERT
recipe (bing_bert, "bias_correction": false, as Google's original BERT AdamWeightDecay)
trains without it: the early updates are then larger (step 1 moves by
(1 - b1) / sqrt(1 - b2) = 3.16 x lr instead of lr for the default betas), which the
recipe's warmup keeps in check. `build_optimizer` uses this class only when bias
correction is off; with it on, it is torch's AdamW(foreach=False) update, bitwise on the CPU.

The update, per tensor:
    p <- p * (1 - lr * wd)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    m_hat, v_hat = m / (1 - b1^t), v / (1 - b2^t)   (or m, v without bias correction)
    p <- p - lr * m_hat / (sqrt(v_hat) + eps)
run as torch._foreach_* ops over each param group (one launch per op on CUDA instead of
one per tensor). Global-norm clipping folds in (megabert.optim.clip.clipped_step): with
`clip_coeff` set, a device tensor, the step scales the gradients by it first, in place, as
clip-then-step did, with no host sync. Each element is computed by the same elementwise ops whatever the
grouping; on the CPU the foreach ops are the per-tensor ops, so the result does not depend
on how the parameters are grouped. The sqrt(v) temporary spans the group.
"""
from __future__ import annotations

from typing import Optional

import torch


class Adam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 bias_correction: bool = True):
        if lr <= 0 or eps <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or weight_decay < 0:
            raise ValueError(f"invalid Adam hyper-parameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.clip_coeff: Optional[torch.Tensor] = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            grads = [p.grad for p in params]
            if self.clip_coeff is not None:
                torch._foreach_mul_(grads, self.clip_coeff)
            states = [self._state(p) for p in params]
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            if wd:
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            denom = torch._foreach_sqrt(exp_avg_sqs)
            if group["bias_correction"]:
                # The corrections in float64 from the host-side step counters, as torch's
                # AdamW computes them in Python: no device sync, the same rounding.
                t = torch.stack(steps).double()
                torch._foreach_div_(denom, list((1 - beta2 ** t).sqrt().unbind(0)))
                torch._foreach_add_(denom, eps)
                torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / (1 - beta1 ** t))
            else:
                torch._foreach_add_(denom, eps)
                torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr)
        return loss

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            # The names and dtypes of torch's AdamW state (step a float32 scalar on the host),
            # so checkpoints read the same way.
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state
