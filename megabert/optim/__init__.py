"""Optimizers (AdamW, LAMB), parameter groups and learning-rate schedules."""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from megabert.config import OptimConfig
from megabert.optim.adam import Adam
from megabert.optim.lamb import Lamb
from megabert.optim.lr_schedules import LRSchedule
from megabert.parallel.param_spec import spec_of
from megabert.say_once import say_once

__all__ = ["Adam", "Lamb", "LRSchedule", "param_groups", "build_optimizer", "fused_adamw_supports"]

logger = logging.getLogger(__name__)


def _say_once(msg: str) -> None:
    say_once(logger, logging.INFO, msg)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """BERT's rule, as each parameter's spec states it: no weight decay on biases and
    LayerNorm parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if spec_of(p, name).weight_decay else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def fused_adamw_supports(p: torch.Tensor) -> bool:
    """Whether torch's fused AdamW kernel takes `p`: a floating-point tensor on a device
    torch has the kernel for (CPU and CUDA among them; torch's own rule, which its
    AdamW(fused=True) enforces with an error at the first step)."""
    return p.device.type in _get_fused_kernels_supported_devices() and torch.is_floating_point(p)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, tp_group: Optional[dist.ProcessGroup] = None, *,
                    groups: Optional[list[dict]] = None, lamb: Callable[..., Lamb] = Lamb) -> torch.optim.Optimizer:
    """The optimizer `cfg` describes, over BERT's parameter groups; which implementation
    runs is logged once ("optimizer: AdamW (fused)"). ZeRO-Offload steps the same
    optimizer on its CPU partitions (the fused kernel runs there too). A caller that steps
    tensors of its own hands their `groups` (param_groups' order and hyper-parameters) and,
    where those tensors are parts of parameters, `lamb`: what builds LAMB from the groups
    and its hyper-parameters (a Lamb whose trust ratios take the whole parameters' norms)."""
    groups = groups if groups is not None else param_groups(model, cfg.weight_decay)
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optimizer == "lamb":
        _say_once("optimizer: LAMB (multi-tensor)")
        return lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                    bias_correction=cfg.bias_correction, min_trust_ratio=cfg.lamb_min_coeff,
                    max_trust_ratio=cfg.lamb_max_coeff, tp_group=tp_group)
    if not cfg.bias_correction:
        _say_once("optimizer: Adam without bias correction (multi-tensor)")
        return Adam(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                    bias_correction=False)
    # torch's fused AdamW: one kernel per tensor doing the whole update in place (no
    # temporaries), elementwise and deterministic, so a run and its resume are bitwise
    # equal. Its rounding differs from the per-tensor loop (foreach=False) by ~1 ulp.
    # DeepSpeed takes it as a client optimizer: ZeRO-1/2/3 swap the groups' params for
    # flat fp32 partitions on the same device, which the kernel takes too.
    fused = all(fused_adamw_supports(p) for g in groups for p in g["params"])
    _say_once(f"optimizer: AdamW ({'fused' if fused else 'foreach'})")
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                            fused=fused, foreach=not fused)
    opt.register_load_state_dict_post_hook(_keep_implementation(fused))
    return opt


def _keep_implementation(fused: bool):
    """A load_state_dict post-hook: torch restores each group's "fused"/"foreach" from the
    checkpoint, so a checkpoint of the per-tensor loop (before fused was the default) would
    silently switch a resumed run back to it. The implementation stays the one chosen from
    this run's parameters; the fused kernel wants its step counters as float32 on the
    parameter's device (an old checkpoint keeps them on the CPU)."""
    def hook(opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            group["fused"], group["foreach"] = fused, not fused
            if fused:
                for p in group["params"]:
                    state = opt.state.get(p)
                    if state and torch.is_tensor(state.get("step")):
                        state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
    return hook
