"""The one line that says a DeepSpeed op's first use compiles it.

DeepSpeed compiles its C++ ops on first use (a JIT build through torch.utils.cpp_extension,
cached per machine) unless they were installed prebuilt (DS_BUILD_<OP>=1). The build prints
nothing for minutes, which reads as a hang: `note_jit_build` says what is being built and
that it happens once, before the build starts. megabert itself needs no DeepSpeed op:
ZeRO-Offload steps with torch's fused AdamW (strategy.py), and the CPU backend's
shared-memory all-reduce is turned off (engine.py); this line is for a DeepSpeed version
whose internals that switch does not know.
"""
from __future__ import annotations

import logging
import os

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


def _first_on_node() -> bool:
    """One process per machine speaks: every process of a node waits on the same build."""
    import torch.distributed as dist

    if "LOCAL_RANK" in os.environ:
        return os.environ["LOCAL_RANK"] == "0"
    return not dist.is_initialized() or dist.get_rank() == 0


def note_jit_build(builder_name: str, what: str) -> None:
    """Logs one line before DeepSpeed compiles op `builder_name` (a class name such as
    CPUAdamBuilder) on first use; silent when it is already built."""
    from deepspeed.accelerator import get_accelerator

    import deepspeed.ops

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.name, False):
        return  # not on this accelerator: DeepSpeed will not build it
    if jit_build_pending(builder) and _first_on_node():
        logger.warning("building DeepSpeed's %s op for %s: a one-time C++ compile, cached for later runs, that "
                       "takes a few minutes (install deepspeed with %s=1 to build it ahead)",
                       # BUILD_VAR is each builder subclass's own (0.19); some accelerators' builders
                       # have none, and DS_BUILD_OPS builds every op.
                       builder.name, what, getattr(builder, "BUILD_VAR", "DS_BUILD_OPS"))
