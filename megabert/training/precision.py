"""Mixed precision: autocast contexts and bf16 GEMM weights with fp32 masters (fp16's dynamic
loss scaling is the optimizer step's: megabert.optim.grad_scaler).

Parameters and optimizer state stay fp32 (the master copy); matmuls run in bf16 or
fp16 under autocast. Autocast casts each fp32 weight to 16 bits at every use (every
micro-batch, and again in a recomputed forward): with --bf16, MasterWeights keeps the
linear layers' weights in bf16 once, so their GEMMs take them as they are (below).
bf16 has fp32's range and needs no scaling.
"""
from __future__ import annotations

import contextlib

import torch

from megabert.tensor_parallel.layers import GEMM_COPY, ColumnParallelLinear, RowParallelLinear


def autocast(device: torch.device, bf16: bool, fp16: bool):
    if not (bf16 or fp16):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if bf16 else torch.float16)


class MasterWeights:
    """bf16 weights for the GEMMs of `model`'s column- and row-parallel linear layers, made
    once per optimizer step instead of once per use.

    Design (issue 41). The registered parameters stay the fp32 masters: the optimizer, its
    state, the gradient reductions, the clipping and the checkpoints see exactly what they
    saw before (checkpoints keep their format, fp32 weights, and resume bitwise). Each
    weight gets a bf16 leaf tensor, its GEMM copy, which the layer multiplies by
    (tensor_parallel.layers.gemm_weight). Its gradient (bf16, from the GEMM) is added into
    the master's fp32 `.grad` by a hook as soon as autograd has it, then dropped: the
    master accumulates over micro-batches in fp32, Megatron's main_grad. After each
    optimizer step one multi-tensor copy rounds all masters into their GEMM copies.

    The maths is autocast's over fp32 parameters, to the bit: autocast's per-use cast
    rounds the fp32 weight to bf16 exactly as the copy does, and its backward converts the
    GEMM's bf16 weight gradient to fp32 and accumulates it in the parameter's fp32 `.grad`,
    as the hook does. What changes is that the cast is made once per step, not at every
    forward of every micro-batch (and recompute), and that the bf16 copies are kept.
    Memory: 2 bytes per weight more for the step (autocast's copies lived for the forward
    and backward of one micro-batch).

    The hook runs the master's own post-accumulate-grad hooks after adding (the overlapped
    DP reduction counts gradients there, megabert.training.overlap): those hooks live in
    torch's private `_post_accumulate_grad_hooks` (torch 2.1 to 2.13 checked). Not wired
    with DeepSpeed (its bf16 optimizer keeps masters of its own), the distributed
    optimizer (its parameters are views of one fp32 buffer) or --compile (the compiled
    graph casts the weights inside itself).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.masters = [m.weight for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                        and m.weight.requires_grad]
        self.copies = [torch.empty_like(w, dtype=dtype).requires_grad_() for w in self.masters]
        self._hooks = [c.register_post_accumulate_grad_hook(self._accumulate(w))
                       for w, c in zip(self.masters, self.copies)]
        self.refresh()

    @staticmethod
    def _accumulate(master: torch.nn.Parameter):
        def hook(copy: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = copy.grad.float()
            else:
                master.grad.add_(copy.grad)
            copy.grad = None
            for fn in (getattr(master, "_post_accumulate_grad_hooks", None) or {}).values():
                fn(master)
        return hook

    @torch.no_grad()
    def refresh(self) -> None:
        """Rounds every master into its GEMM copy: one multi-tensor copy (the step's cast)."""
        if self.masters:
            torch._foreach_copy_(self.copies, self.masters)
        for w, c in zip(self.masters, self.copies):
            setattr(w, GEMM_COPY, (c, w._version))

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Refresh after each step of `optimizer`."""
        self._step_hook = optimizer.register_step_post_hook(lambda *_: self.refresh())

    def close(self) -> None:
        for h in self._hooks + ([self._step_hook] if hasattr(self, "_step_hook") else []):
            h.remove()
        for w in self.masters:
            if hasattr(w, GEMM_COPY):
                delattr(w, GEMM_COPY)
