"""Megatron's memory-mapped indexed dataset (MMIDIDX `.bin` + `.idx`), reader and writer.

Byte-compatible with megatron-core's `IndexedDataset` / `IndexedDatasetBuilder`, so
existing corpora work as they are. The `.idx` layout (little-endian):

    b"MMIDIDX\\x00\\x00"   magic, 9 bytes
    <Q  version (1)
    <B  dtype code of the tokens in .bin (DTYPES below)
    <Q  N, the number of sequences (sentences, or documents when not split)
    <Q  D, the number of document indices (documents + 1)
    int32[N] sequence lengths, int64[N] byte pointers into .bin, int64[D] document indices
    int8[N]  sequence modes, only in megatron-core's multimodal datasets

`.bin` holds the token ids back to back with no header. Every check below raises a
DataError naming the file, because a truncated or foreign file otherwise surfaces as
an IndexError deep inside a DataLoader worker.
"""
from __future__ import annotations

import array
import os
import shutil
import struct
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from megabert.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34

# Megatron's dtype codes; the order is part of the file format.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def best_dtype(vocab_size: int) -> type:
    """uint16 when every id fits with room to spare (Megatron's < 65500 rule), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def _read_header(path: str) -> tuple[type, int, int]:
    """Returns (dtype, sequence count, document-index count) after checking magic and version."""
    if not os.path.isfile(path):
        raise DataError(f"index file {path} does not exist: check --data-path (it takes the prefix P of P.bin/P.idx)")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        raise DataError(f"index file {path} is truncated ({len(head)} bytes, the header alone is {HEADER_BYTES}); "
                        f"rebuild it with tools/preprocess_data.py")
    if head[:9] != MAGIC:
        raise DataError(f"{path} is not a Megatron MMIDIDX index (magic {head[:9]!r}); "
                        f"rebuild it with tools/preprocess_data.py")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != VERSION:
        raise DataError(f"index file {path} has version {version}; only version {VERSION} is supported")
    if code not in DTYPES:
        raise DataError(f"index file {path} has unknown dtype code {code} (known: {sorted(DTYPES)})")
    return DTYPES[code], n_seq, n_doc


class IndexedDataset(torch.utils.data.Dataset):
    """Read-only view of P.bin/P.idx; `ds[i]` is sequence i as a numpy array (a view of the mmap).

    Attributes: `dtype`, `sequence_lengths` int32[N], `sequence_pointers` int64[N],
    `document_indices` int64[D] (document d is sequences [doc[d], doc[d+1])), and
    `sequence_modes` int8[N] or None.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False):
        self._open(path_prefix, multimodal)

    def _open(self, path_prefix: str, multimodal: bool) -> None:
        self.path_prefix, self.multimodal = path_prefix, multimodal
        ipath, bpath = idx_path(path_prefix), bin_path(path_prefix)
        self.dtype, n_seq, n_doc = _read_header(ipath)
        itemsize = np.dtype(self.dtype).itemsize
        body = 4 * n_seq + 8 * n_seq + 8 * n_doc
        size = os.path.getsize(ipath)
        # A multimodal index carries one int8 mode per sequence after the document indices.
        if size not in (HEADER_BYTES + body, HEADER_BYTES + body + n_seq):
            raise DataError(f"index file {ipath} has {size} bytes but its header ({n_seq} sequences, {n_doc} document "
                            f"indices) needs {HEADER_BYTES + body}: the file is truncated or corrupt, rebuild it")
        if multimodal and size != HEADER_BYTES + body + n_seq:
            raise DataError(f"index file {ipath} has no sequence modes but was opened as multimodal")
        self._idx_mmap = np.memmap(ipath, mode="r", dtype=np.uint8)
        buf, off = self._idx_mmap, HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buf, np.int32, n_seq, off)
        self.sequence_pointers = np.frombuffer(buf, np.int64, n_seq, off + 4 * n_seq)
        self.document_indices = np.frombuffer(buf, np.int64, n_doc, off + 12 * n_seq)
        self.sequence_modes = (np.frombuffer(buf, np.int8, n_seq, off + body) if multimodal else None)
        self._validate(ipath, bpath, itemsize)
        # An empty .bin cannot be memory-mapped; an empty dataset needs no buffer.
        nbytes = os.path.getsize(bpath)
        self._bin_mmap = np.memmap(bpath, mode="r", dtype=np.uint8) if nbytes else np.zeros(0, np.uint8)

    def _validate(self, ipath: str, bpath: str, itemsize: int) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        n_seq = len(lengths)
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != n_seq:
            raise DataError(f"index file {ipath}: document indices must run from 0 to the sequence count {n_seq}, "
                            f"got {docs[:1].tolist()}..{docs[-1:].tolist()}; the file is corrupt, rebuild it")
        if len(docs) > 1 and np.any(np.diff(docs) < 0):
            raise DataError(f"index file {ipath}: document indices are not sorted; the file is corrupt, rebuild it")
        if n_seq and lengths.min() < 0:
            raise DataError(f"index file {ipath}: negative sequence length; the file is corrupt, rebuild it")
        if not os.path.isfile(bpath):
            raise DataError(f"data file {bpath} does not exist next to {ipath}: copy both P.bin and P.idx")
        expected = int(lengths.sum(dtype=np.int64)) * itemsize
        actual = os.path.getsize(bpath)
        if actual != expected:
            raise DataError(f"data file {bpath} has {actual} bytes but {ipath} describes {expected} "
                            f"({np.dtype(self.dtype).name} tokens): one of the two is truncated or they come "
                            f"from different runs; rebuild them together")
        if n_seq and (pointers[0] != 0 or pointers[-1] + int(lengths[-1]) * itemsize != actual):
            raise DataError(f"index file {ipath}: sequence pointers do not match the sequence lengths; "
                            f"the file is corrupt, rebuild it")

    # Pickling reopens the files: DataLoader workers started with spawn get their own maps.
    def __getstate__(self):
        return self.path_prefix, self.multimodal

    def __setstate__(self, state):
        self._open(*state)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx."""
        n = int(self.sequence_lengths[idx])
        if length is None:
            length = n - offset
        itemsize = np.dtype(self.dtype).itemsize
        start = int(self.sequence_pointers[idx]) + offset * itemsize
        return np.frombuffer(self._bin_mmap, self.dtype, length, start) if length else np.zeros(0, self.dtype)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise IndexError("IndexedDataset slices must be contiguous")
            if stop <= start:
                return []
            flat = self.tokens(start, stop)
            return np.split(flat, np.cumsum(self.sequence_lengths[start:stop - 1]))
        if idx < 0:
            idx += len(self)
        return self.get(idx)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """All tokens of sequences [start, stop) as one contiguous view."""
        if stop <= start:
            return np.zeros(0, self.dtype)
        count = int(self.sequence_lengths[start:stop].sum(dtype=np.int64))
        return (np.frombuffer(self._bin_mmap, self.dtype, count, int(self.sequence_pointers[start])) if count
                else np.zeros(0, self.dtype))

    def document(self, d: int) -> list[np.ndarray]:
        """The sequences (sentences) of document d."""
        return self[int(self.document_indices[d]):int(self.document_indices[d + 1])]


class IndexedDatasetWriter:
    """Writes P.bin while sequences arrive and P.idx at `finalize()`.

    Use as a context manager: an exception inside the block removes both files, so a
    failed run never leaves a dataset that looks complete.
    """

    def __init__(self, path_prefix: str, dtype: type = np.int32):
        if np.dtype(dtype) not in CODES:
            raise DataError(f"dtype {np.dtype(dtype).name} has no Megatron code; use one of "
                            f"{[np.dtype(t).name for t in DTYPES.values()]}")
        self.path_prefix, self.dtype = path_prefix, np.dtype(dtype)
        os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
        self._bin = open(bin_path(path_prefix), "wb")
        # array.array grows without Python int objects per element; tens of millions of sentences fit.
        self._lengths = array.array("i")
        self._docs = array.array("q", [0])

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if not self._bin.closed:
                self.finalize()
        else:
            self._bin.close()
            for path in (bin_path(self.path_prefix), idx_path(self.path_prefix)):
                if os.path.exists(path):
                    os.remove(path)

    def add_item(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Appends one sequence to the current document."""
        arr = np.asarray(ids.numpy() if isinstance(ids, torch.Tensor) else ids, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        self._docs.append(len(self._lengths))

    def add_document(self, ids: Sequence[int] | np.ndarray, lengths: Iterable[int]) -> None:
        """Appends a whole document: `ids` are its sequences back to back, `lengths` their sizes."""
        arr = np.asarray(ids, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        self._lengths.extend(lengths)
        self._docs.append(len(self._lengths))

    def add_encoded(self, data: bytes, lengths: np.ndarray, sequences_per_doc: np.ndarray) -> None:
        """Appends many documents already encoded as `self.dtype` bytes (the preprocessing fast path:
        workers produce bytes, so the writer never touches a Python int per token)."""
        self._bin.write(data)
        base = len(self._lengths)
        self._lengths.frombytes(np.ascontiguousarray(lengths, np.int32).tobytes())
        self._docs.frombytes((base + np.cumsum(sequences_per_doc, dtype=np.int64)).tobytes())

    def add_index(self, path_prefix: str) -> None:
        """Appends every document of an existing dataset (tools/merge_datasets.py)."""
        other = IndexedDataset(path_prefix)
        if np.dtype(other.dtype) != self.dtype:
            raise DataError(f"cannot merge {path_prefix} ({np.dtype(other.dtype).name} tokens) into "
                            f"{self.path_prefix} ({self.dtype.name}); preprocess both with the same tokenizer")
        base = len(self._lengths)
        self._lengths.frombytes(np.ascontiguousarray(other.sequence_lengths).tobytes())
        self._docs.frombytes((base + other.document_indices[1:]).tobytes())
        del other
        with open(bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    def finalize(self) -> None:
        """Closes P.bin and writes P.idx."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, np.int32) if len(self._lengths) else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(idx_path(self.path_prefix), "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, CODES[self.dtype], len(lengths), len(self._docs)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.frombuffer(self._docs, np.int64).tobytes())
