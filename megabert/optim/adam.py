"""Adam with decoupled weight decay (AdamW, Loshchilov & Hutter 2019) and a switch for the
bias correction of its moments.

torch.optim.AdamW always corrects the moments for their zero start. The DeepSpeed BERT
recipe (bing_bert, "bias_correction": false, as Google's original BERT AdamWeightDecay)
trains without it: the early updates are then larger (step 1 moves by
(1 - b1) / sqrt(1 - b2) = 3.16 x lr instead of lr for the default betas), which the
recipe's warmup keeps in check. `build_optimizer` uses this class only when bias
correction is off; with it on, torch's AdamW is the same update, bitwise.

The update, per tensor (no multi-tensor kernels, so a result does not depend on how the
parameters are grouped):
    p <- p * (1 - lr * wd)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    m_hat, v_hat = m / (1 - b1^t), v / (1 - b2^t)   (or m, v without bias correction)
    p <- p - lr * m_hat / (sqrt(v_hat) + eps)
"""
from __future__ import annotations

import math

import torch


class Adam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 bias_correction: bool = True):
        if lr <= 0 or eps <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or weight_decay < 0:
            raise ValueError(f"invalid Adam hyper-parameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # The names and dtypes of torch's AdamW state, so checkpoints read the same way.
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if wd:
                    p.mul_(1 - lr * wd)
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                if group["bias_correction"]:
                    step = state["step"].item()
                    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
                    p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
                else:
                    p.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(eps), value=-lr)
        return loss
