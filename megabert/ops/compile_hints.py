"""Hints for torch.compile that cost nothing in eager mode.

`import torch._dynamo` takes about as long as `import torch` itself (about 1.9 s of a 4.6 s
tiny pre-training run here), and the public hint functions
(`torch.compiler.assume_constant_result`, `torch._dynamo.maybe_mark_dynamic`) import it.
Only a run that compiles needs dynamo, and such a run has imported it before anything is
traced (`torch.compile` does). So the hints below wait for dynamo instead of loading it:
building the model and running it forward and backward (the Python API, prediction,
conversion and export tools) do not load it. NOTE: a training process still does, when it
builds its optimizer (torch.optim.Optimizer's methods carry torch's @_disable_dynamo,
which imports dynamo on first call).
"""
from __future__ import annotations

import sys

import torch


def assume_constant_result(fn):
    """`torch.compiler.assume_constant_result` without importing dynamo: the decorator only
    marks the function with the attribute dynamo reads when it traces a call
    (torch/_dynamo/decorators.py; tests/test_compile.py checks the mark is still the one
    torch sets and that a fullgraph compile goes through a marked function)."""
    fn._dynamo_marked_constant = True
    return fn


def maybe_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """`torch._dynamo.maybe_mark_dynamic` when dynamo is loaded; without it nothing can be
    compiling, and the mark is a no-op in eager mode."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.maybe_mark_dynamic(t, dim)


def mark_static_address(t: torch.Tensor) -> None:
    """`torch._dynamo.mark_static_address` when dynamo is loaded (a run that compiles loads it
    before building what it marks): a tensor a compiled graph reads at the same address every
    call, which CUDA graphs then read in place instead of copying into a buffer of their own."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.mark_static_address(t)
