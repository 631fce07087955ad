"""dropout_add front end: residual + dropout(x), fused in one pass on the CPU, and its backend.

Issue 10: on the CPU, `residual + F.dropout(x, p)` draws a float mask with bernoulli_
(4.8% of the default pre-training step), divides it, multiplies, then adds: four passes
over memory and a 4-byte mask kept for the backward. The fused kernel draws the mask
with Philox4x32-10 (vectorised, counter-based) and writes out = residual + mask * x / (1-p)
and a 1-byte mask in one pass; the backward is one pass too (grad_residual is grad itself).

The Philox key is drawn from a torch generator (the default CPU generator unless one is
given), one draw per call, so `torch.manual_seed` controls the masks, checkpoints that save
the generator state resume bitwise, activation recompute (which restores it) redraws the
same masks, and inside `RNGStatesTracker.fork()` the draw comes from the forked stream.
The masks differ from PyTorch's dropout for the same seed (another generator).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megabert.errors import ConfigError
from megabert.ops import epilogues, kernel_ops
from megabert.ops.dispatch import CPU_KERNEL_DTYPES, dtype_outside, resolve_backend, use_fused_kernel
from megabert.ops.kept_tensor import kept_tensor_function

_DTYPES = {"cpu": CPU_KERNEL_DTYPES}  # CPU only: there is no CUDA dropout-add kernel
# Philox keys: any 63-bit value (the kernel takes an int64).
_SEED_HIGH = 2**63 - 1


def compiled_unavailable(device_type: str) -> Optional[str]:
    """None when torch.compile can build the fused epilogues (megabert.ops.epilogues) for
    `device_type` tensors, else why it cannot."""
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "torch.compile needs Triton for CUDA kernels and this torch has none"
    return None


def resolve_dropout_add_backend(backend: str, device_type: str = "cpu") -> str:
    """The backend of the layers' epilogues: dropout + residual add (+ post-LN's
    LayerNorm) and bias + GELU (megabert.ops.epilogues). 'auto' -> 'fused' on the CPU when
    its kernels are built (our one-pass dropout + add kernel; the rest PyTorch's), else
    'torch' (PyTorch's op chain), on CUDA too: there the chain measured faster than
    'compiled' (each epilogue one torch.compile'd function) on an H200 (BERT-large bf16,
    phase 1: 744.6 against 510.5 seq/s; phase 2: 150.3 against 111.9): a compiled call's
    guards and autograd wrappers cost the host more than the kernels they fuse save, and
    eager steps there are host-bound (docs/performance.md). 'fused' off the CPU, or
    'compiled' without Triton, is an error. Logged once per choice."""
    if backend == "fused" and device_type != "cpu":
        raise ConfigError(f"--dropout-add-backend fused: the fused dropout + residual add is a CPU kernel; on "
                          f"{device_type} use --dropout-add-backend auto, compiled or torch")
    if backend == "compiled" and device_type == "cuda":
        why = compiled_unavailable(device_type)
        if why is not None:
            raise ConfigError(f"--dropout-add-backend compiled: {why}; use --dropout-add-backend torch")
    return resolve_backend("dropout_add", "--dropout-add-backend", backend, "torch", device_type)


def draw_seed(generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One Philox key from `generator` (the default CPU generator when None), advancing it by
    one draw. A one-element int64 tensor: the kernel reads it, so Python converts nothing."""
    return torch.randint(0, _SEED_HIGH, (1,), dtype=torch.int64, generator=generator)


def _dropout_add_forward(x: torch.Tensor, residual: torch.Tensor, p: float, seed: torch.Tensor):
    out, mask = kernel_ops.dropout_add_forward(x, residual, p, seed)
    return out, mask, p


def _dropout_add_backward(grad_out: torch.Tensor, mask: torch.Tensor, p: float, needs_input_grad):
    grad_x = kernel_ops.dropout_backward(grad_out, mask, p) if needs_input_grad[0] else None
    return grad_x, grad_out, None, None


FusedDropoutAdd = kept_tensor_function(
    "FusedDropoutAdd",
    """out = residual + mask * x / (1 - p), mask ~ Bernoulli(1 - p) from Philox keyed by `seed`
    (a one-element int64 tensor).

    Forward keeps the 1-byte mask; backward: grad_x = mask * grad / (1 - p), grad_residual = grad.
    """,
    _dropout_add_forward, _dropout_add_backward)


def _outside_limits(x: torch.Tensor, residual: torch.Tensor) -> Optional[str]:
    if x.device.type != "cpu":
        return f"a {x.device.type} tensor (the fused dropout + add is a CPU kernel)"
    if x.shape != residual.shape:
        return f"input {tuple(x.shape)} with residual {tuple(residual.shape)} (the kernel takes one shape)"
    if x.dtype != residual.dtype:
        return f"{x.dtype} input with a {residual.dtype} residual (the kernel takes one dtype)"
    if x.device != residual.device:
        return f"input on {x.device} with residual on {residual.device}"
    return dtype_outside(x, _DTYPES)


def dropout_add_reference(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool,
                          generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """residual + dropout(x): PyTorch's dropout (the oracle and the unfused path)."""
    if generator is None or not training or p == 0.0:
        return residual + F.dropout(x, p, training)
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=generator)
    return residual + x * keep / (1.0 - p)


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool = True,
                generator: Optional[torch.Generator] = None, *, backend: str = "fused") -> torch.Tensor:
    """residual + dropout(x, p) (training) or residual + x (eval, or p == 0: no generator draw,
    as F.dropout). Autograd-capable for x and residual.

    `backend` as resolved by `resolve_dropout_add_backend` ('fused', 'compiled' or 'torch'); 'fused'
    runs the kernel where it applies (CPU; fp32, bf16, fp64; one shape) and PyTorch otherwise, said
    once; 'compiled' one torch.compile'd function (megabert.ops.epilogues).
    `generator`: where the Philox key comes from (default: torch's default CPU generator, or the
    stream of the `RNGStatesTracker.fork()` the call runs in). The kernel's own
    `dropout_add_forward(x, residual, p, seed)` (megabert.fused_kernels) returns the mask too.
    """
    if not training or p == 0.0:
        return residual + x
    if backend in ("torch", "compiled"):
        if backend == "compiled" and generator is None:
            return epilogues.run("bias_dropout_add", backend, x, None, residual, p, training)
        return dropout_add_reference(x, residual, p, training, generator)
    if backend != "fused":
        raise ValueError(f"unknown dropout_add backend {backend!r}")
    if not use_fused_kernel("dropout_add", x.device.type, _outside_limits(x, residual)):
        return dropout_add_reference(x, residual, p, training, generator)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_add: p must be in [0, 1), got {p}")
    return FusedDropoutAdd.apply(x, residual, float(p), draw_seed(generator))


def bias_dropout_add_layer_norm(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                                training: bool, layer_norm: Optional[torch.nn.Module] = None, *,
                                backend: str = "torch") -> torch.Tensor:
    """The row-parallel GEMMs' epilogue: residual + dropout(x + bias), then `layer_norm` (a
    megabert LayerNorm module: post-LN's) when given. `backend` 'compiled' runs all of it as
    one torch.compile'd function (megabert.ops.epilogues); 'fused' and 'torch' add the bias,
    then run dropout_add (the CPU kernel or PyTorch's dropout) and the LayerNorm module with
    its own backend."""
    if backend == "compiled":
        if layer_norm is None:
            return epilogues.run("bias_dropout_add", backend, x, bias, residual, p, training)
        weight, ln_bias, precision = layer_norm.affine(residual)
        with precision:
            return epilogues.run("bias_dropout_add_layer_norm", backend, x, bias, residual, p, training,
                                 weight, ln_bias, layer_norm.eps)
    y = dropout_add(x if bias is None else x + bias, residual, p, training, backend=backend)
    return y if layer_norm is None else layer_norm(y)
