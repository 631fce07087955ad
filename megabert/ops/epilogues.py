"""The transformer layer's GEMM epilogues, fused: bias + GELU after the MLP's first GEMM
(called inside ColumnParallelLinear's forward), and dropout + residual add (+ the post-LN
LayerNorm, called inside the LayerNorm's forward) after the row-parallel GEMMs; the front
ends take a bias there too, which the model leaves to the row-parallel layer (ZeRO-3
gathers a parameter only while its own module runs).

Eager PyTorch runs each epilogue as a chain of elementwise kernels, each a full pass over
the [tokens, width] activation in memory and its own launch: the bias add, GELU (and in
backward GELU's gradient, then the bias gradient's reduction); the bias add, dropout, the
residual add, LayerNorm. On CUDA these passes are the "norm/elementwise" tail of the step
next to the GEMMs (bench/_kernel_breakdown.py measures it).

Under --compile Inductor fuses the chain inside each compiled layer and these front ends
run the plain chain for it to fuse. Without --compile, the 'compiled' backend (the default
on CUDA where torch.compile has Triton) runs each epilogue as a small function compiled
once with torch.compile, forward and backward each one fused kernel (the LayerNorm's
reduction included). Shapes: dynamo's default (`dynamic=None`), not `dynamic=False`: the
unpadded encoder's [tokens, h] changes its token count every batch, and static shapes
would recompile at each new count until dynamo's recompile limit sends the call back to
eager; with the default the second count compiles one shape-generic graph and that serves
every later batch.

Dropout masks: `fallback_random` makes the compiled function draw its mask with ATen's
own dropout from the default generator, exactly as F.dropout does in eager mode (the same
masks for the same generator state, so switching backends changes no run), and so inside
`RNGStatesTracker.fork()` it draws from the swapped-in TP-rank stream, and activation
recompute, which restores the generator, redraws the same masks (as compile_layers does).
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megabert.ops.dispatch import say_once


def bias_gelu_reference(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gelu(x + bias), exact (erf) GELU as BERT's."""
    # The bias in x's dtype: under bf16 autocast the GEMM's bf16 output stays bf16 (as addmm with its
    # bias would give), rather than promoting the [tokens, 4h] activation to fp32.
    return F.gelu(x if bias is None else x + bias.to(x.dtype))


def bias_dropout_add_reference(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                               training: bool) -> torch.Tensor:
    """residual + dropout(x + bias)."""
    return residual + F.dropout(x if bias is None else x + bias, p, training)


def bias_dropout_add_layer_norm_reference(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                                          p: float, training: bool, weight: torch.Tensor,
                                          ln_bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """layer_norm(residual + dropout(x + bias)) over the last dim (post-LN's sublayer output)."""
    y = bias_dropout_add_reference(x, bias, residual, p, training)
    return F.layer_norm(y, (y.size(-1),), weight, ln_bias, eps)


_REFERENCES = {"bias_gelu": bias_gelu_reference, "bias_dropout_add": bias_dropout_add_reference,
               "bias_dropout_add_layer_norm": bias_dropout_add_layer_norm_reference}


@functools.cache
def _compiled(name: str) -> Callable:
    # One compiled function per epilogue for the process, shared by every layer (they have
    # the same shapes, so one graph serves them all).
    say_once(("epilogue", name), logging.INFO, "%s: torch.compile'd epilogue (one fused kernel each way)", name)
    return torch.compile(_REFERENCES[name], dynamic=None, options={"fallback_random": True})


def run(name: str, backend: str, *args):
    """Epilogue `name` ("bias_gelu", "bias_dropout_add", "bias_dropout_add_layer_norm"; the
    arguments of its reference): its compiled function with `backend` 'compiled', else (or
    inside a layer that --compile traces, where Inductor fuses it anyway) the plain chain."""
    if backend == "compiled" and not torch.compiler.is_compiling():
        return _compiled(name)(*args)
    return _REFERENCES[name](*args)


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], *, backend: str = "torch") -> torch.Tensor:
    """gelu(x + bias); `backend` 'compiled' fuses it (see the module's docstring), else the chain."""
    return run("bias_gelu", backend, x, bias)
