"""The DeepSpeed versions whose private attributes megabert touches, and the guard.

Two places reach inside DeepSpeed: zero_masters (the fp32 master partition shares the
parameter partition's storage: DeepSpeed's `single_partition_of_fp32_groups`,
`fp32_partitioned_groups_flat` and the hp-param views) and DeepSpeedStrategy's pipeline
path (ZeRO-1's `reduce_gradients(pipeline_parallel=True)`); on CPU the engine also marks
DeepSpeed's shared-memory comm op incompatible so it is not JIT-compiled (`__compatible_ops__`). They are checked against the
versions below (pyproject.toml pins the same range). On another version training still
runs, with DeepSpeed's own fp32 copies (4 bytes per parameter and rank more in fp32 ZeRO
runs), and one warning says so; MEGABERT_DEEPSPEED_PATCHES=1 forces the patch on.
"""
from __future__ import annotations

import logging
import os

from megabert.say_once import say_once

logger = logging.getLogger(__name__)

# Checked: ZeRO 1/2/3 equivalence, resume and the master sharing tests pass on these.
KNOWN = ((0, 19, 0), (0, 20, 0))  # [low, high): the 0.19 series


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def known_version(version: str) -> bool:
    low, high = KNOWN
    return low <= _parse(version) < high


def private_patches_allowed() -> bool:
    """Whether megabert may patch DeepSpeed's private attributes (warns once if not)."""
    import deepspeed

    if known_version(deepspeed.__version__) or os.environ.get("MEGABERT_DEEPSPEED_PATCHES") == "1":
        return True
    low, high = (".".join(map(str, v)) for v in KNOWN)
    say_once(logger, logging.WARNING, "deepspeed %s is outside the versions megabert knows (>=%s,<%s): fp32 ZeRO "
             "keeps DeepSpeed's own master copy (the memory-saving patch of its private attributes is off); install a "
             "version in that range, or set MEGABERT_DEEPSPEED_PATCHES=1 to try the patch",
             deepspeed.__version__, low, high)
    return False
