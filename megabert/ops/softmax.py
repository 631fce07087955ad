"""scaled_masked_softmax front end: the fused kernel when it applies, else PyTorch."""
from __future__ import annotations

from typing import Optional

import torch

from megabert.ops import kernel_ops
from megabert.ops.dispatch import CPU_KERNEL_DTYPES, CUDA_KERNEL_DTYPES, dtype_outside, use_fused_kernel
from megabert.ops.kept_tensor import kept_tensor_function
from megabert.ops.reference import scaled_masked_softmax_reference

# What the kernels take. CUDA: one warp per row holds the row in registers, hence the key limit.
_DTYPES = {"cpu": CPU_KERNEL_DTYPES, "cuda": CUDA_KERNEL_DTYPES}
_MAX_KEYS = {"cuda": 4096}


def _softmax_forward(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float):
    probs = kernel_ops.scaled_masked_softmax_forward(scores, mask, scale)
    return probs, probs, scale


def _softmax_backward(grad_probs: torch.Tensor, probs: torch.Tensor, scale: float, needs_input_grad):
    return kernel_ops.scaled_masked_softmax_backward(grad_probs, probs, scale), None, None


FusedScaledMaskedSoftmax = kept_tensor_function(
    "FusedScaledMaskedSoftmax",
    """probs = softmax(scale * scores) with masked keys excluded (a fully masked row is 0).

    Forward keeps only the probabilities (in the input dtype, as Megatron's kernel):
    grad_scores = scale * probs * (grad_probs - sum(grad_probs * probs)).
    """,
    _softmax_forward, _softmax_backward)


def _outside_limits(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> Optional[str]:
    if scores.dim() != 4:
        return f"scores of {scores.dim()} dims (the kernel takes [b, heads, sq, sk])"
    if mask is not None and mask.dtype != torch.bool:
        return f"a {mask.dtype} mask (the kernel takes bool, True = masked out)"
    max_keys = _MAX_KEYS.get(scores.device.type)
    if max_keys is not None and scores.size(-1) > max_keys:
        return f"{scores.size(-1)} keys on {scores.device.type} (the kernel takes up to {max_keys})"
    return dtype_outside(scores, _DTYPES)


def scaled_masked_softmax(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """softmax(scale * scores) over the last dim, masked positions (True) excluded.

    scores: [b, heads, sq, sk]; mask: bool, broadcastable to scores ([b|1, 1, sq|1, sk]
    typically), or None. A fully masked row gives zeros. Autograd-capable; fp32 math
    for 16-bit inputs, output in the input dtype.
    """
    if not use_fused_kernel("scaled_masked_softmax", scores.device.type, _outside_limits(scores, mask)):
        return scaled_masked_softmax_reference(scores, mask, scale)
    if mask is not None:
        # A broadcast view, not a copy: the kernels read the mask through its strides.
        mask = mask.expand(scores.shape)
        if mask.size(-1) > 1 and mask.stride(-1) != 1:  # broadcast along keys: rare, materialise
            mask = mask.contiguous()
    return FusedScaledMaskedSoftmax.apply(scores.contiguous(), mask, float(scale))
