"""Optimizers (AdamW, LAMB), parameter groups and learning-rate schedules."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megabert.config import OptimConfig
from megabert.optim.adam import Adam
from megabert.optim.lamb import Lamb
from megabert.optim.schedules import LRSchedule
from megabert.parallel.param_spec import spec_of

__all__ = ["Adam", "Lamb", "LRSchedule", "param_groups", "build_optimizer"]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """BERT's rule, as each parameter's spec states it: no weight decay on biases and
    LayerNorm parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if spec_of(p, name).weight_decay else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, tp_group: Optional[dist.ProcessGroup] = None, *,
                    cpu_offload: bool = False) -> torch.optim.Optimizer:
    """The optimizer `cfg` describes, over BERT's parameter groups.

    cpu_offload: ZeRO-Offload keeps the optimizer on the CPU, where DeepSpeed wants its
    own vectorised DeepSpeedCPUAdam (same AdamW update, bias correction switchable)."""
    groups = param_groups(model, cfg.weight_decay)
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optimizer == "lamb":
        if cpu_offload:
            raise ValueError("LAMB cannot run offloaded: DeepSpeedCPUAdam is an Adam")
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                    bias_correction=cfg.bias_correction, min_trust_ratio=cfg.lamb_min_coeff,
                    max_trust_ratio=cfg.lamb_max_coeff, tp_group=tp_group)
    if cpu_offload:
        from megabert.optim.cpu_adam import build_cpu_adam

        return build_cpu_adam(groups, cfg)
    if not cfg.bias_correction:
        return Adam(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                    bias_correction=False)
    # foreach=False: the per-tensor loop gives bitwise the same update whatever the
    # tensor grouping, which keeps resumed runs and layouts comparable.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                             foreach=False)
