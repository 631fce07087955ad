"""fp16's dynamic loss scaling: the loss is multiplied by a scale so small gradients survive,
and a step whose gradients overflowed is skipped and the scale lowered (Micikevicius et al.,
2018; Megatron's DynamicGradScaler with hysteresis). Part of the optimizer step, beside the
optimizers, as Megatron's megatron/core/optimizer/grad_scaler.py."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megabert.config import OptimConfig
from megabert.parallel import comm


class DynamicLossScaler:
    def __init__(self, cfg: OptimConfig):
        self.static = cfg.loss_scale is not None
        self.scale = float(cfg.loss_scale if self.static else cfg.initial_loss_scale)
        self.min_scale, self.window, self.hysteresis = cfg.min_loss_scale, cfg.loss_scale_window, cfg.hysteresis
        self._good_steps = 0
        self._hysteresis_left = self.hysteresis

    def found_overflow(self, params, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> bool:
        """Any inf/NaN in any rank's gradients (all ranks must agree to skip together)."""
        grads = [p.grad for p in params if p.grad is not None]
        # One device-side reduction and one host read, whatever the number of parameters.
        flag = torch.zeros(1, device=device)
        if grads:
            flag = torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any().float().reshape(1)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def unscale_(self, params) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        if self.static:
            return
        if overflow:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self._good_steps += 1
            if self._good_steps % self.window == 0:
                self.scale *= 2.0
                self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
