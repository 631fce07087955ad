"""Optimizers (AdamW, LAMB), parameter groups and learning-rate schedules."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megabert.config import OptimConfig
from megabert.optim.lamb import Lamb
from megabert.optim.schedules import LRSchedule
from megabert.parallel.param_spec import spec_of

__all__ = ["Lamb", "LRSchedule", "param_groups", "build_optimizer"]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """BERT's rule, as each parameter's spec states it: no weight decay on biases and
    LayerNorm parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if spec_of(p, name).weight_decay else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig,
                    tp_group: Optional[dist.ProcessGroup] = None) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optimizer == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                    tp_group=tp_group)
    # foreach=False: the per-tensor loop gives bitwise the same update whatever the
    # tensor grouping, which keeps resumed runs and layouts comparable.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                             foreach=False)
