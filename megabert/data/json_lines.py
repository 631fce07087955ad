"""JSON lines, as every task file that uses them is read: one object per non-blank line, and a
line that is not one is a one-line DataError naming the file and the line."""
from __future__ import annotations

import json
from typing import Iterable, Iterator

from megabert.errors import DataError


def json_objects(lines: Iterable[str], path: str, expected: str = "an object") -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line; `expected` says in the error what a line
    should hold when it is valid JSON but not an object."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not a JSON object ({e.msg}); give one object per line "
                            f"(JSON lines)") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: a JSON {type(row).__name__}, not {expected}")
        yield lineno, row
