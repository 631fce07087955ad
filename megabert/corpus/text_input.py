"""Reading raw corpora: jsonl or plain text, optionally gzip/bzip2/xz/zstd compressed (parquet and
`datasets.save_to_disk` directories: columnar_input.py).

Files are read in blocks of whole records so that worker processes receive a few
hundred documents per message (one pickle per block, not per line) and the
main process never splits lines itself. Plain text holds one document per
paragraph: documents are separated by empty lines.
"""
from __future__ import annotations

import bz2
import glob
import gzip
import lzma
import os
from typing import BinaryIO, Iterator

from megabert.corpus.columnar_input import (ARROW_SUFFIXES, COLUMNAR_FORMATS, PARQUET_SUFFIXES, column_blocks,
    is_arrow_dataset_dir)
from megabert.errors import DataError

COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd")
TEXT_SUFFIXES = (".txt", ".text")


def expand_inputs(pattern: str) -> list[str]:
    """--input as a file, a `datasets.save_to_disk` directory or a glob (`'shards/*.jsonl.zst'`),
    sorted so runs are reproducible."""
    paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    if not paths:
        raise DataError(f"--input {pattern} matches no file")
    for p in paths:
        if os.path.isdir(p):
            if not is_arrow_dataset_dir(p):
                raise DataError(f"--input {p} is a directory without a state.json, not one written by datasets' "
                                f"save_to_disk: give files or a glob (e.g. '{os.path.join(p, '*.parquet')}')")
        elif not os.path.isfile(p):
            raise DataError(f"--input file {p} does not exist")
    return paths


def input_format(path: str, requested: str = "auto") -> str:
    """'jsonl', 'text', 'parquet' or 'arrow': from --input-format, else from the path (a directory is
    a save_to_disk dataset: arrow; .parquet/.pq: parquet; .arrow: arrow; .txt/.text: text; else jsonl)."""
    if requested != "auto":
        return requested
    if os.path.isdir(path):
        return "arrow"
    if path.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if path.endswith(ARROW_SUFFIXES):
        return "arrow"
    name = path
    for suffix in COMPRESSED:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return "text" if name.endswith(TEXT_SUFFIXES) else "jsonl"


def open_binary(path: str) -> BinaryIO:
    """A readable binary stream of the decompressed file."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".bz2"):
        return bz2.open(path, "rb")
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    if path.endswith((".zst", ".zstd")):
        import zstandard

        # read_across_frames: the Pile's shards are concatenations of several zstd frames.
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True,
                                                          closefd=True)
    return open(path, "rb")


def read_blocks(path: str, fmt: str, block_bytes: int = 1 << 20) -> Iterator[tuple[int, bytes]]:
    """Yields (number of the block's first line, counted from 1, block) with whole records only:
    a jsonl block ends at a newline, a text block at an empty line."""
    sep = b"\n\n" if fmt == "text" else b"\n"
    line_no, carry = 1, b""
    try:
        with open_binary(path) as stream:
            while True:
                chunk = stream.read(block_bytes)
                if not chunk:
                    break
                data = carry + chunk
                cut = data.rfind(sep)
                if cut < 0:
                    carry = data
                    continue
                cut += len(sep)
                block, carry = data[:cut], data[cut:]
                yield line_no, block
                line_no += block.count(b"\n")
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise DataError(f"cannot read --input {path}: {e}") from None
    except Exception as e:  # zstandard raises its own ZstdError for corrupt frames
        if type(e).__name__ == "ZstdError":
            raise DataError(f"cannot read --input {path}: {e}") from None
        raise
    if carry:
        yield line_no, carry


def jsonl_records(block: bytes, first_line: int) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) for every line of a jsonl block."""
    lines = block.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    return zip(range(first_line, first_line + len(lines)), lines)


def text_records(block: bytes, first_line: int) -> Iterator[tuple[int, bytes]]:
    """(number of the first line, raw paragraph) for every paragraph of a text block."""
    start, parts = None, []
    for n, line in enumerate(block.split(b"\n"), start=first_line):
        if line.strip():
            if start is None:
                start = n
            parts.append(line)
        elif start is not None:
            yield start, b"\n".join(parts)
            start, parts = None, []
    if start is not None:
        yield start, b"\n".join(parts)


def record_unit(fmt: str) -> str:
    """What a record's number counts in messages: lines of a jsonl/text file, rows of a table."""
    return "row" if fmt in COLUMNAR_FORMATS else "line"


def describe_skipped(path: str, total: int, bad: list[tuple[int, str]], count: int, shown: int = 10,
                     unit: str = "line") -> str:
    """One warning line: how many records were skipped and the first few with their line numbers."""
    first = "; ".join(f"{unit} {n}: {why}" for n, why in bad[:shown])
    more = f"; ... and {count - shown} more" if count > shown else ""
    return f"warning: skipped {count} of {total} records in {path} ({first}{more})"


def text_stream(path: str, fmt: str, key: str = "text") -> Iterator[str]:
    """Every document's text (of one json key), malformed records skipped: for tokenizer training."""
    import json

    if fmt in COLUMNAR_FORMATS:
        for _, (column,), _ in column_blocks(path, fmt, (key,)):
            yield from (t for t in column if isinstance(t, str) and t.strip())
        return
    for first, block in read_blocks(path, fmt):
        records = text_records(block, first) if fmt == "text" else jsonl_records(block, first)
        for _, raw in records:
            try:
                text = raw.decode("utf-8") if fmt == "text" else json.loads(raw).get(key)
            except (UnicodeDecodeError, ValueError, AttributeError):
                continue
            if isinstance(text, str) and text.strip():
                yield text

