"""User-facing errors: one line that says what is wrong, where, and what to do.

Library code raises these; the entry scripts catch them in `cli_main` and print the
message without a traceback (a traceback for a typo in a flag helps nobody).
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable


class MegabertError(Exception):
    """Base class for errors the user can fix (flags, files, layouts)."""


class ConfigError(MegabertError, ValueError):
    """A flag or a combination of flags is invalid."""


class DataError(MegabertError):
    """An input file is missing, truncated or malformed."""


class CheckpointError(MegabertError):
    """A checkpoint is missing, incomplete or does not match the model."""


class RefusedFileError(CheckpointError):
    """A file from outside holds what no file of its kind holds (a global that would run code,
    a wrong type where a Megatron `Metadata` or dict belongs): refused, nothing in it run."""


class CommunicationError(MegabertError):
    """A collective or transfer failed because a peer rank stopped, died or became
    unreachable (megabert.parallel.failures words it)."""


def cli_main(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Wraps an entry point: MegabertError -> `error: ...` on stderr and exit code 2.

    Set MEGABERT_TRACEBACK=1 to see the full traceback while debugging.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            rc = fn(*args, **kwargs)
            return 0 if rc is None else int(rc)
        except MegabertError as e:
            if os.environ.get("MEGABERT_TRACEBACK") == "1":
                raise
            rank = os.environ.get("RANK", "0")
            prefix = "error: " if rank == "0" else f"error (rank {rank}): "
            # One write of the whole line: with unbuffered stderr (PYTHONUNBUFFERED, as
            # launchers set it) print() writes the text and the newline separately, and
            # two ranks failing together interleaved into one garbled line.
            sys.stderr.write(prefix + str(e) + "\n")
            sys.stderr.flush()
            return 2

    return wrapper
