"""megabert's compiled kernels (fused scaled-masked softmax and LayerNorm).

The extensions are built ahead of time by setup.py; nothing is compiled on first use.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

_cpu: Optional[ModuleType] = None
_cpu_error: Optional[str] = None
try:
    _cpu = importlib.import_module("megabert.fused_kernels._cpu")
except ImportError as e:  # reported by is_available()/load_error(), never silently used
    _cpu_error = str(e)


def is_available() -> bool:
    """True when the compiled extension loaded."""
    return _cpu is not None


def load_error() -> Optional[str]:
    """Why the extension did not load (None when it did)."""
    return _cpu_error
