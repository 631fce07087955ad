"""Global-norm gradient clipping folded into the optimizer step (issue 41).

Clipping scales every gradient by c = min(1, max_norm / (||g|| + 1e-6)) (torch's
clip_grad_norm_ and Megatron's rule). Done apart, it is one more pass over every gradient
(read, scale, write) before the optimizer reads them again. Here c stays a device tensor
(no .item(), so no host sync) and the optimizer applies it where it reads the gradients:

- torch's fused AdamW (the default optimizer) takes a `grad_scale` tensor that its kernel
  divides each gradient by as it loads it: we hand it 1 / c, so the scaling costs no pass
  of its own and the step stays one fused kernel per tensor;
- our multi-tensor Adam and LAMB (megabert.optim.adam, .lamb) read `clip_coeff` and scale
  the gradients they take in their first foreach op (LAMB: the fp32 copies of 16-bit
  gradients it makes anyway, so for those the scaling is free);
- any other optimizer (AdamW's foreach path, chosen when a parameter sits on a device the
  fused kernel does not serve) gets the gradients scaled in place first, one foreach
  multiply, as before.

The maths is clip-then-step's: the same c, applied to the same gradients; only the
rounding of g * c (or g / (1 / c)) may differ by an ulp.

A non-finite norm (a NaN or inf gradient somewhere) must not reach the weights: the step is
skipped (`guarded_step`). torch's fused AdamW decides that on the device (its `found_inf`:
the kernels return before writing, the step counters are put back), so the host never waits;
the foreach optimizers have no such switch, and the host reads the norm to decide.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from megabert.optim.adam import Adam
from megabert.optim.lamb import Lamb

# torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
NORM_EPS = 1e-6


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)) as a float32 tensor on norm's device (no host sync)."""
    return (max_norm / (norm + NORM_EPS)).clamp(max=1.0).float()


def _fused_adamw(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Adam) and all(g.get("fused") for g in optimizer.param_groups)


def clipped_step(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float,
                 norm: Optional[torch.Tensor]) -> None:
    """optimizer.step() on gradients clipped to global norm `max_norm` (`norm`: their global
    norm, a device tensor; `max_norm` <= 0: no clipping). `params`: the tensors whose
    `.grad` the optimizer steps, used only where the optimizer cannot fold the scaling in."""
    if max_norm <= 0 or norm is None:
        optimizer.step()
        return
    coeff = clip_coefficient(norm, max_norm)
    if _fused_adamw(optimizer):
        # torch's fused Adam/AdamW divide each gradient by `grad_scale` (meant for an AMP
        # loss scale) inside the kernel; its device must be the parameters'.
        optimizer.grad_scale = coeff.reciprocal()
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
        return
    if isinstance(optimizer, (Adam, Lamb)):  # their `clip_coeff`, set for one step
        optimizer.clip_coeff = coeff
        try:
            optimizer.step()
        finally:
            optimizer.clip_coeff = None
        return
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coeff)
    optimizer.step()


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `guarded_step` skips a non-finite step without reading the norm on the host."""
    return _fused_adamw(optimizer)


def guarded_step(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float,
                 norm: torch.Tensor) -> torch.Tensor:
    """clipped_step, or no update at all when `norm` is not finite. Returns the outcome as a
    float32 0-d tensor on norm's device, 1.0 where the step was skipped.

    With torch's fused AdamW nothing here waits for the device: the flag goes in as the
    kernel's `found_inf`. Other optimizers cost one host read of the norm."""
    nonfinite = torch.isfinite(norm).logical_not().float().reshape(())
    if skips_on_device(optimizer):
        optimizer.found_inf = nonfinite
        try:
            clipped_step(optimizer, params, max_norm, norm)
        finally:
            del optimizer.found_inf
    elif math.isfinite(norm.item()):
        clipped_step(optimizer, params, max_norm, norm)
    return nonfinite
