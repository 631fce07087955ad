"""The fused kernels' checks against the PyTorch reference computed in float64: random
cases (seeded) and the comparison of outputs and gradients, used by tests/test_fused_kernels.py
in process and by its instruction-set subprocesses."""
import math

import torch

from megabert.ops import layer_norm, scaled_masked_softmax
from megabert.ops.reference import layer_norm_reference, scaled_masked_softmax_reference

# fp32 kernels against the fp64 oracle: a few ulp of fp32 (the polynomial exp is ~2 ulp).
# bf16: the output is rounded to 8 bits of mantissa.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=4e-3, atol=4e-3), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def fused(t: torch.Tensor, name: str) -> bool:
    return type(t.grad_fn).__name__.startswith(name)


def softmax_case(shape, mask_shape, dtype, device="cpu", scale=0.37, fully_masked_rows=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = (torch.randn(shape, generator=gen) * 4).to(dtype)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=gen) < 0.3
        if fully_masked_rows and len(mask_shape) > 1 and mask_shape[-2] > 1:
            mask[..., 0, :] = True  # every query 0 sees no key
    grad = torch.randn(shape, generator=gen).to(dtype)
    return scores.to(device), None if mask is None else mask.to(device), scale, grad.to(device)


def check_softmax(scores, mask, scale, grad):
    x = scores.clone().requires_grad_()
    probs = scaled_masked_softmax(x, mask, scale)
    assert fused(probs, "FusedScaledMaskedSoftmax")
    probs.backward(grad)

    x64 = scores.double().requires_grad_()
    ref = scaled_masked_softmax_reference(x64, mask, scale)
    ref.backward(grad.double())

    assert probs.dtype == scores.dtype and probs.shape == scores.shape
    torch.testing.assert_close(probs.double(), ref, **TOL[scores.dtype])
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL[scores.dtype])


def ln_case(shape, dtype, device="cpu", seed=0, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + offset).to(dtype)
    weight = (1 + 0.5 * torch.randn(h, generator=gen)).to(dtype)
    bias = (0.1 * torch.randn(h, generator=gen)).to(dtype)
    grad = torch.randn(shape, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (x, weight, bias, grad))


def check_layer_norm(x, weight, bias, grad, eps=1e-5):
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = layer_norm(*leaves, eps)
    assert fused(y, "FusedLayerNorm")
    y.backward(grad)

    leaves64 = [t.double().requires_grad_() for t in (x, weight, bias)]
    ref = layer_norm_reference(*leaves64, eps)
    ref.backward(grad.double())

    assert y.dtype == x.dtype and y.shape == x.shape
    tol = dict(TOL[x.dtype])
    if x.dtype == torch.float32:  # grad_weight/bias sum over rows: fp32 rounding grows with sqrt(rows)
        tol["atol"] *= math.sqrt(x.numel() / x.size(-1)) * 4
    torch.testing.assert_close(y.double(), ref, **TOL[x.dtype])
    for ours, theirs in zip(leaves, leaves64):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, **tol)
