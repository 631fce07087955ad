"""A user's text file read as UTF-8, with a bad byte reported by its line, not as a traceback.

Python's text mode raises UnicodeDecodeError with an offset into its own read buffer and no file
name; a user needs the file, the line and what to do. A byte-order mark at the start (Windows
editors write one) is dropped, as `utf-8-sig` does.
"""
from __future__ import annotations

from typing import Iterator

from megabert.errors import DataError


def utf8_lines(path: str) -> Iterator[str]:
    """The lines of `path` (each with its line end), decoded as UTF-8."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, lineno, raw, e) from None
            yield line.removeprefix("\ufeff") if lineno == 1 else line


def read_utf8(path: str) -> str:
    """The whole of `path`, decoded as UTF-8 (for formats read in one piece: JSON)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        start = data.rfind(b"\n", 0, e.start) + 1
        end = data.find(b"\n", e.start)
        line = data[start:end if end >= 0 else len(data)]
        e.start -= start
        raise _not_utf8(path, data.count(b"\n", 0, e.start + start) + 1, line, e) from None


def _not_utf8(path: str, lineno: int, line: bytes, e: UnicodeDecodeError) -> DataError:
    return DataError(f"{path}:{lineno}: byte {line[e.start]:#04x} at column {e.start + 1} is not UTF-8 ({e.reason}); "
                     f"save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
