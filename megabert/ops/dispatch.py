"""Per call: the fused kernel or the PyTorch reference, and a log line the first time.

The kernels cover the shapes and dtypes BERT trains with; anything else (float16 on
CPU, keys longer than a CUDA kernel handles, a CUDA torch built without the CUDA
extension) runs the unfused PyTorch reference. That is correct but slower, so the
first call of each kind says so (WARNING: visible without any logging set-up), and
the first fused call says which kernels run (INFO). Nothing falls back silently.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from megabert import fused_kernels
from megabert.errors import ConfigError
from megabert.say_once import say_once as _say_once
from megabert.ops.compile_hints import assume_constant_result

logger = logging.getLogger("megabert.ops")


def say_once(key: tuple, level: int, msg: str, *args) -> None:
    """Log `msg` the first time `key` is seen in this process (megabert.say_once)."""
    _say_once(logger, level, msg, *args, key=key)


# NOTE: under torch.compile this runs in Python when dynamo traces the call, and its
# answer is a constant of the graph (assume_constant_result): the log lines are said for
# real, and dynamo neither breaks the graph at the logger nor guards on megabert.say_once's set (which
# would recompile once the first line was said). The answer depends only on the
# arguments and on which extensions loaded at import.
@assume_constant_result
def use_fused_kernel(op: str, device_type: str, outside_limits: Optional[str]) -> bool:
    """Whether `op` on a `device_type` tensor runs the compiled kernel (else the PyTorch
    reference). `outside_limits` is the caller's reason why this call is beyond the
    kernel (None when it is within); each distinct reason is logged once."""
    if fused_kernels.kernels_for(device_type) is None:
        say_once((op, device_type, "unbuilt"), logging.WARNING,
                 "%s: no fused kernel for %s tensors (%s); using PyTorch", op, device_type,
                 fused_kernels.load_error(device_type))
        return False
    if outside_limits is not None:
        say_once((op, device_type, outside_limits), logging.WARNING,
                 "%s: %s is outside the fused kernel's limits; using PyTorch for such calls", op, outside_limits)
        return False
    say_once((op, device_type, "fused"), logging.INFO, "%s: %s", op, fused_kernels.describe(device_type))
    return True


# The dtypes the compiled kernels take. CPU: fp32 and bf16 with fp32 math, fp64 with fp64 math
# (for gradcheck). CUDA (softmax, LayerNorm): the half types and fp32, with fp32 math.
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
CUDA_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dtype_outside(x: torch.Tensor, supported: dict[str, tuple[torch.dtype, ...]]) -> Optional[str]:
    """A reason string when x's dtype is not among those the kernel for its device takes."""
    allowed = supported.get(x.device.type, ())
    if x.dtype in allowed:
        return None
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    return f"{str(x.dtype).removeprefix('torch.')} on {x.device.type} (the kernel takes {names})"


def resolve_backend(what: str, flag: str, backend: str, unfused: str, device_type: str) -> str:
    """The backend a model on `device_type` uses for `what`. 'auto' on the CPU is 'fused'
    when the CPU kernels are built, else `unfused`; on CUDA it is `unfused` (SDPA's flash /
    memory-efficient attention, PyTorch's LayerNorm: megabert's CUDA LayerNorm lost to it,
    0.70-0.73x, and was deleted; docs/performance.md), so our one CUDA kernel, the softmax, is
    opt-in with `flag` fused. 'fused' without built kernels is an error naming `flag`. Logged
    once per choice."""
    if backend == "auto":
        backend = "fused" if device_type == "cpu" and fused_kernels.is_available(device_type) else unfused
    elif backend == "fused" and not fused_kernels.is_available(device_type):
        raise ConfigError(f"{flag} fused: the fused {device_type} kernels are not built "
                          f"({fused_kernels.load_error(device_type)}); run `make install` or use {flag} {unfused}")
    say_once((what, backend), logging.INFO, "%s backend: %s", what, backend)
    return backend
