"""megabert's compiled kernels (CPU: softmax, LayerNorm, RMSNorm, gated activation, RoPE, dropout + add,
attention, MLM cross entropy; CUDA: the fused softmax).

The extensions are built ahead of time by setup.py; nothing is compiled on first use.
`_cpu` (C++, OpenMP, vectorised per instruction set) is always built; `_cuda` only
where torch has CUDA and nvcc was found at install time. Use them through
`megabert.ops`, which checks each call against the kernels' limits and falls back
to PyTorch, saying so once.

The CPU module runs its row kernels with the widest instruction set the CPU has
(avx512, avx2 or the compiler's baseline); MEGABERT_CPU_ISA, or torch's own
ATEN_CPU_CAPABILITY, caps it (default | avx2 | avx512).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import torch


def _load(name: str) -> tuple[Optional[ModuleType], Optional[str]]:
    # Reported by is_available()/load_error() and logged by megabert.ops, never silently used.
    try:
        return importlib.import_module(f"megabert.fused_kernels.{name}"), None
    except ImportError as e:
        return None, f"{type(e).__name__}: {e}"


_cpu, _cpu_error = _load("_cpu")
# Read once: describe() is called per op call (its log line), also inside torch.compile'd
# code, which cannot trace into the extension.
_cpu_isa = _cpu.isa() if _cpu is not None else None
if torch.version.cuda is None and torch.version.hip is None:
    _cuda, _cuda_error = None, f"this torch ({torch.__version__}) has no CUDA, so the CUDA kernels were not built"
else:
    _cuda, _cuda_error = _load("_cuda")
    if _cuda is None:
        _cuda_error = f"{_cuda_error} (was nvcc on PATH or CUDA_HOME set when `make install` ran?)"


def is_available(device_type: str = "cpu") -> bool:
    """True when the compiled extension for `device_type` ('cpu' or 'cuda') loaded."""
    return kernels_for(device_type) is not None


def load_error(device_type: str = "cpu") -> Optional[str]:
    """Why the extension for `device_type` did not load (None when it did)."""
    return {"cpu": _cpu_error, "cuda": _cuda_error}.get(device_type, f"no kernels for {device_type} tensors")


def kernels_for(device_type: str) -> Optional[ModuleType]:
    """The compiled module for tensors on `device_type`, or None."""
    return {"cpu": _cpu, "cuda": _cuda}.get(device_type)


def cpu_isa() -> Optional[str]:
    """The instruction set the CPU kernels run with ('avx512', 'avx2' or 'default'), None unbuilt."""
    return _cpu_isa if _cpu is not None else None


def describe(device_type: str) -> str:
    """A short name for the kernels that run on `device_type`, for logs and benchmarks."""
    if device_type == "cpu" and _cpu is not None:
        return f"megabert CPU kernels ({_cpu_isa})"
    if device_type == "cuda" and _cuda is not None:
        return "megabert CUDA kernels"
    return f"no megabert kernels for {device_type}"
