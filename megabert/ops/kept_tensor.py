"""The autograd Function of a fused kernel pair whose backward reads one tensor the forward
kept (the softmax's probabilities, dropout + add's 1-byte mask) and one plain value (the
scale, p). Their Functions differed only in the kernels they call and in the gradients of
their other inputs, so the ctx bookkeeping between the two passes is written once here.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.function import once_differentiable


def kept_tensor_function(name: str, doc: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd Function called `name` (its grad_fn: `<name>Backward`) from two plain functions:
    `forward(*inputs) -> (output, kept, value)`, the kernel's output, the tensor its backward
    reads and the plain value it needs; `backward(grad_output, kept, value, needs_input_grad)
    -> one gradient per input` (None where there is none). The backward is once-differentiable:
    the kernels have no double backward."""

    def forward_pass(ctx, *inputs):
        output, kept, value = forward(*inputs)
        ctx.save_for_backward(kept)
        ctx.value = value
        return output

    @once_differentiable
    def backward_pass(ctx, grad_output: torch.Tensor):
        (kept,) = ctx.saved_tensors
        return backward(grad_output, kept, ctx.value, ctx.needs_input_grad)

    members = {"__doc__": doc, "__module__": forward.__module__,
               "forward": staticmethod(forward_pass), "backward": staticmethod(backward_pass)}
    return type(name, (torch.autograd.Function,), members)
