"""Corpus -> Megatron `.bin/.idx` (the core of tools/preprocess_data.py).

Why it is fast: the main process only reads blocks of raw bytes and writes finished
bytes. Each worker decodes a block of a few hundred documents, splits sentences,
tokenizes them in one `tokenize_batch` call (for BERT's WordPiece, the cached ASCII
fast path of tokenizers.py) and returns the block already packed as the output dtype
plus its length arrays, so no Python int per token crosses a process boundary or
reaches the writer.

What it writes is what Megatron's tools/preprocess_data.py writes for the same ids:
sentences that tokenize to nothing are dropped, a document left with none is kept
empty, `--append-eod` adds the end-of-document id to the last sentence.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from megabert.data.indexed_dataset import IndexedDatasetWriter, best_dtype
from megabert.corpus.sentence_splitter import split_sentences
from megabert.corpus.columnar_input import COLUMNAR_FORMATS, column_blocks
from megabert.corpus.text_input import (describe_skipped, expand_inputs, input_format, jsonl_records, read_blocks,
    record_unit, text_records)
from megabert.data.tokenizers import build_tokenizer
from megabert.errors import DataError

MAX_BAD_KEPT = 100  # line numbers kept per block for the warning; the count is always exact


@dataclass
class EncodeOptions:
    tokenizer_type: str
    vocab_file: str
    json_keys: tuple = ("text",)
    split_sentences: bool = False
    append_eod: bool = False


@dataclass
class EncodedBlock:
    """One block, encoded: per json key (token bytes, sentence lengths, sentences per document)."""
    outputs: dict
    documents: int
    records: int
    nbytes: int
    bad: list = field(default_factory=list)
    bad_count: int = 0


class Encoder:
    """Turns blocks of raw records into packed token arrays; one instance per worker process."""

    def __init__(self, opts: EncodeOptions):
        self.opts = opts
        self.tokenizer = build_tokenizer(opts.tokenizer_type, opts.vocab_file)
        self.dtype = np.dtype(best_dtype(self.tokenizer.vocab_size))

    def _parse(self, fmt: str, raw: bytes) -> tuple[Optional[list], str]:
        """The texts of one record (one per json key), or None and why it is skipped."""
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"invalid UTF-8 at byte {e.start}"
        if fmt == "text":
            return ([line], "") if line.strip() else (None, "empty text")
        if not line.strip():
            return None, "empty line"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            return None, f"bad JSON ({e.msg} at column {e.colno})"
        except ValueError as e:  # json's own limits (an integer of more than 4300 digits)
            return None, f"bad JSON ({e})"
        if not isinstance(record, dict):
            return None, f"not a JSON object but {type(record).__name__}"
        for key in self.opts.json_keys:
            if key not in record:
                return None, f"missing key {key!r}"
        return self._texts([record[key] for key in self.opts.json_keys])

    def _texts(self, values: list) -> tuple[Optional[list], str]:
        """The record's values (one per json key or column) if all are non-empty text, or None and why."""
        for key, value in zip(self.opts.json_keys, values):
            if value is None:
                return None, f"null {key!r}"
            if not isinstance(value, str):
                return None, f"{key!r} is {type(value).__name__}, not a string"
            if not value.strip():
                return None, f"empty {key!r}"
        return values, ""

    def _records(self, fmt: str, first: int, block) -> Iterator[tuple[int, tuple[Optional[list], str]]]:
        """(line or row number, (texts or None, why skipped)) for every record of a block."""
        if fmt in COLUMNAR_FORMATS:  # block: one list of values per column, already decoded by pyarrow
            return zip(itertools.count(first), map(self._texts, map(list, zip(*block))))
        split = text_records if fmt == "text" else jsonl_records
        return ((n, self._parse(fmt, raw)) for n, raw in split(block, first))

    def encode_block(self, item: tuple) -> EncodedBlock:
        """item: (format, number of the block's first line or row, raw block or columns, bytes of input)."""
        fmt, first, block, nbytes = item
        docs, bad, bad_count, records = [], [], 0, 0
        for line_no, (texts, why) in self._records(fmt, first, block):
            records += 1
            if texts is None:
                bad_count += 1
                if len(bad) < MAX_BAD_KEPT:
                    bad.append((line_no, why))
            else:
                docs.append(texts)
        outputs = {key: self._pack([d[k] for d in docs]) for k, key in enumerate(self.opts.json_keys)}
        return EncodedBlock(outputs, len(docs), records, nbytes, bad, bad_count)

    def _pack(self, texts: list[str]) -> tuple[bytes, np.ndarray, np.ndarray]:
        """Tokenizes documents and packs them as (token bytes, sentence lengths, sentences per doc)."""
        if self.opts.split_sentences:
            per_doc = [split_sentences(t) for t in texts]
            if self.tokenizer.byte_level:
                # A byte-level BPE spells the space before a word into the word's token ("Ġthe"):
                # each sentence after a document's first keeps one, or the document would read
                # "end.The" when its sentences are joined into samples.
                per_doc = [[s if i == 0 else " " + s for i, s in enumerate(doc)] for doc in per_doc]
            sentences = list(itertools.chain.from_iterable(per_doc))
            counts = np.fromiter(map(len, per_doc), np.int64, len(per_doc))
        else:
            sentences, counts = texts, np.ones(len(texts), np.int64)
        ids = self.tokenizer.tokenize_batch(sentences) if sentences else []
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum()))
        # Sentences with no token are dropped, as Megatron does; count what each document keeps.
        doc_of_sentence = np.repeat(np.arange(len(texts)), counts)
        kept = lengths > 0
        counts = np.bincount(doc_of_sentence[kept], minlength=len(texts)).astype(np.int64)
        lengths = lengths[kept]
        if self.opts.append_eod and len(lengths):
            last = np.cumsum(counts)[counts > 0] - 1  # index of each non-empty document's last sentence
            ends = np.cumsum(lengths)[last]
            flat = np.insert(flat, ends, self.tokenizer.eod)
            lengths[last] += 1
        return flat.astype(self.dtype).tobytes(), lengths.astype(np.int32), counts


_worker_encoder: Optional[Encoder] = None


def _init_worker(opts: EncodeOptions) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(opts)


def _encode_in_worker(item: tuple) -> EncodedBlock:
    return _worker_encoder.encode_block(item)


def ordered_pool_map(pool, fn, items, in_flight: int, star: bool = False):
    """Like pool.imap (star: pool.starmap's argument tuples) but with at most `in_flight` tasks queued:
    imap reads its input as fast as it can, which would load a whole corpus into memory when the
    workers are the slower side."""
    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, item if star else (item,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


@dataclass
class PreprocessStats:
    documents: int = 0
    records: int = 0
    skipped: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    outputs: list = field(default_factory=list)


def preprocess(input_pattern: str, output_prefix: str, opts: EncodeOptions, workers: int = 1,
               log_interval: int = 1000, strict: bool = False, input_fmt: str = "auto",
               block_bytes: int = 1 << 20, log=None) -> PreprocessStats:
    """Tokenizes every input file into `{output_prefix}_{key}_{sentence|document}.bin/.idx`;
    progress and skipped records go to `log` (default: sys.stderr as it is at the call)."""
    log = sys.stderr if log is None else log
    paths = expand_inputs(input_pattern)
    level = "sentence" if opts.split_sentences else "document"
    prefixes = [f"{output_prefix}_{key}_{level}" for key in opts.json_keys]
    encoder = Encoder(opts)  # also checks the tokenizer before any worker starts
    stats = PreprocessStats(outputs=prefixes)
    start = time.time()
    pool = None
    if workers > 1:
        # fork: workers start in milliseconds; nothing in the parent has started threads yet.
        ctx = mp.get_context("fork" if os.name == "posix" else "spawn")
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(opts,))
    try:
        with contextlib.ExitStack() as stack:  # an error removes every partial output
            writers = [stack.enter_context(IndexedDatasetWriter(p, encoder.dtype)) for p in prefixes]
            for path in paths:
                fmt = input_format(path, input_fmt)
                print(f"Opening {path} ({fmt})", file=log, flush=True)
                items = _blocks(path, fmt, opts.json_keys, block_bytes)
                results = (map(encoder.encode_block, items) if pool is None
                           else ordered_pool_map(pool, _encode_in_worker, items, 2 * workers))
                bad, bad_count, records = [], 0, 0
                for res in results:
                    if res.bad_count and strict:
                        line, why = res.bad[0]
                        raise DataError(f"{path} {record_unit(fmt)} {line}: {why} (without --strict such records "
                                        f"are skipped and counted)")
                    for writer, key in zip(writers, opts.json_keys):
                        writer.add_encoded(*res.outputs[key])
                    bad.extend(res.bad[: MAX_BAD_KEPT - len(bad)])
                    bad_count += res.bad_count
                    records += res.records
                    before = stats.documents
                    stats.documents += res.documents
                    stats.nbytes += res.nbytes
                    if log_interval and stats.documents // log_interval > before // log_interval:
                        _log_progress(stats, start, log)
                stats.records += records
                stats.skipped += bad_count
                if bad_count:
                    print(describe_skipped(path, records, bad, bad_count, unit=record_unit(fmt)), file=log,
                          flush=True)
            if stats.documents == 0:
                raise DataError(f"--input {input_pattern} holds no usable document "
                                f"({stats.skipped} of {stats.records} records skipped); check --json-keys")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    stats.seconds = time.time() - start
    _log_progress(stats, start, log, final=True)
    return stats


def _blocks(path: str, fmt: str, keys: tuple, block_bytes: int) -> Iterator[tuple]:
    """The work items of one input: (format, first line or row, block, bytes of input)."""
    if fmt in COLUMNAR_FORMATS:
        # Rows per block: about block_bytes of text for documents of a few KB, as for jsonl.
        rows = max(1, block_bytes // 4096)
        return ((fmt, first, columns, nbytes) for first, columns, nbytes in column_blocks(path, fmt, keys, rows))
    return ((fmt, first, block, len(block)) for first, block in read_blocks(path, fmt, block_bytes))


def _log_progress(stats: PreprocessStats, start: float, log, final: bool = False) -> None:
    elapsed = max(time.time() - start, 1e-9)
    word = "Done:" if final else "Processed"
    print(f"{word} {stats.documents} documents ({stats.documents / elapsed:.1f} docs/s, "
          f"{stats.nbytes / elapsed / 1024 / 1024:.2f} MB/s)", file=log, flush=True)

