"""Log lines said once per process: the one record of what was already said.

Backend choices, fallbacks and engine quirks are worth one line, not one per call: ops
dispatch (fused kernel or PyTorch reference), the optimizer's implementation, DeepSpeed's
config. Every such line goes through `say_once`, so there is a single set to reason about
(and a single one for a test to forget: `forget_said`).
"""
from __future__ import annotations

import logging
from typing import Hashable, Optional

_said: set[tuple] = set()


def say_once(logger: logging.Logger, level: int, msg: str, *args, key: Optional[Hashable] = None) -> None:
    """`logger.log(level, msg, *args)` the first time (logger, key) is seen in this process;
    `key` defaults to the message and its arguments."""
    record = (logger.name, (msg, args) if key is None else key)
    if record not in _said:
        _said.add(record)
        logger.log(level, msg, *args)


def forget_said() -> None:
    """Say every line again from now on (a test that asserts what is said first)."""
    _said.clear()
