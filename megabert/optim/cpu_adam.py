"""DeepSpeedCPUAdam for ZeRO-Offload, and the one line that says its first use compiles it.

DeepSpeed compiles its C++ ops on first use (a JIT build through torch.utils.cpp_extension,
cached per machine) unless they were installed prebuilt (DS_BUILD_CPU_ADAM=1). The build
prints nothing for minutes, which reads as a hang: `note_jit_build` says what is being
built and that it happens once, before the build starts.
"""
from __future__ import annotations

import logging
import os

from megabert.config import OptimConfig

logger = logging.getLogger(__name__)


def jit_build_pending(builder) -> bool:
    """True when loading DeepSpeed op `builder` will compile it: not installed prebuilt and
    not in torch's extension cache yet."""
    try:
        from deepspeed.git_version_info import installed_ops
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return True
    if installed_ops.get(builder.name, False):
        return False
    build_dir = _get_build_directory(builder.name, verbose=False)
    return not os.path.isfile(os.path.join(build_dir, f"{builder.name}.so"))


def note_jit_build(builder_name: str, what: str) -> None:
    """Logs one line before DeepSpeed compiles op `builder_name` (a class name such as
    CPUAdamBuilder) on first use; silent when it is already built."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is not None and jit_build_pending(builder):
        logger.warning("building DeepSpeed's %s op for %s: a one-time C++ compile, cached for later runs, that "
                       "takes a few minutes (install deepspeed with DS_BUILD_%s=1 to build it ahead)",
                       builder.name, what, builder.name.upper())


def build_cpu_adam(groups: list[dict], cfg: OptimConfig):
    """DeepSpeedCPUAdam over `groups` with the AdamW update `cfg` describes."""
    note_jit_build("CPUAdamBuilder", "ZeRO-Offload's CPU optimizer")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(groups, lr=cfg.lr, bias_correction=cfg.bias_correction,
                            betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                            adamw_mode=True)
