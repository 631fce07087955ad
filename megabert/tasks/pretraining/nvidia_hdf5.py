"""NVIDIA DeepLearningExamples' BERT HDF5 shards (also DeepSpeed bing_bert's "NVIDIA data"),
read lazily, one block of rows at a time.

A shard is what DLE's `create_pretraining_data.py` writes: gzip datasets `input_ids` int32
[N, L], `input_mask` int8 [N, L], `segment_ids` int8 [N, L], `masked_lm_positions` int32
[N, P], `masked_lm_ids` int32 [N, P] and `next_sentence_labels` int8 [N] (1 = B is random).
Rows are `[CLS] A [SEP] B [SEP]`, already masked (static masking), 0-padded.

Labels are built as DLE's `pretraining_dataset` builds them: every position is ignored but
`masked_lm_positions[:k]`, where k is the index of the first 0 in `masked_lm_positions` (P
when there is none), which take `masked_lm_ids[:k]`. DLE ignores -1; megabert ignores -100.

NOTE: h5py picks chunks that cut rows into a few columns each ((3125, 4) for a [N, 128] int32
dataset), so reading one row decompresses every chunk of its row band: 32 chunks of 3125
rows. Reading a whole row band at once (a "block") and keeping it decoded costs that once.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from megabert.errors import DataError
from megabert.tasks.pretraining.masking import IGNORE_INDEX

HDF5_KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
             "next_sentence_labels")
# A block is at least this many rows (a whole number of chunk row bands); an unchunked file
# reads blocks of this size.
MIN_BLOCK_ROWS = 1024


def dle_labels(positions: np.ndarray, ids: np.ndarray, seq_length: int) -> np.ndarray:
    """DLE's masked-LM labels of one row: [seq_length] int64, IGNORE_INDEX but at the masked positions."""
    labels = np.full(seq_length, IGNORE_INDEX, dtype=np.int64)
    padded = np.flatnonzero(positions == 0)
    k = int(padded[0]) if len(padded) else len(positions)
    if k and not 0 <= positions[:k].min() <= positions[:k].max() < seq_length:  # numpy would wrap a negative one
        raise ValueError(f"masked_lm_positions {positions[:k].tolist()} lie outside the row's {seq_length} tokens")
    labels[positions[:k]] = ids[:k]
    return labels


class Hdf5Shard:
    """One HDF5 shard: its shape read at construction (metadata only), rows read by block.

    The h5py file opens on first read in each process (never shared across a fork), so a
    shard is safe to hand to DataLoader worker processes.
    """

    def __init__(self, path: str):
        self.path = path
        self.bin: Optional[int] = None  # LDDL's length bin (ParquetShard's): NVIDIA's HDF5 shards have none
        try:
            import h5py  # imported on use: every megabert process imports this module

            with h5py.File(path, "r") as f:
                missing = [k for k in HDF5_KEYS if k not in f]
                if missing:
                    raise DataError(f"{path} is not a DeepLearningExamples BERT shard: it has no dataset "
                                    f"{', '.join(missing)} (expected {', '.join(HDF5_KEYS)})")
                self._check_layout(path, f)
                self.num_rows, self.seq_length = f["input_ids"].shape
                self.max_predictions = f["masked_lm_positions"].shape[1]
                band = max(f[k].chunks[0] if f[k].chunks else 1 for k in HDF5_KEYS)
        except OSError as e:
            raise DataError(f"{path} cannot be read as HDF5 ({e}): the file is damaged or not a DeepLearningExamples "
                            f"HDF5 shard; check --data-path") from None
        self.block_rows = band * -(-MIN_BLOCK_ROWS // band)
        self._file, self._pid = None, None

    @staticmethod
    def _check_layout(path: str, f) -> None:
        """Shapes and dtypes from the file's metadata (no data read): a float or string dataset,
        or one of another width, would otherwise fail inside a worker, or train on garbage."""
        for key in HDF5_KEYS:
            ndim, kinds = (1, "iub") if key == "next_sentence_labels" else (2, "iu")
            if not hasattr(f[key], "dtype"):
                raise DataError(f"{path} is not a DeepLearningExamples BERT shard: {key} is a group, not a dataset")
            if f[key].ndim != ndim or f[key].dtype.kind not in kinds:
                raise DataError(f"{path} is not a DeepLearningExamples BERT shard: dataset {key} holds "
                                f"{f[key].dtype} {list(f[key].shape)}, where DLE writes {ndim}-D integers")
        rows = f["input_ids"].shape[0]
        for key in HDF5_KEYS:
            if f[key].shape[0] != rows:
                raise DataError(f"{path}: dataset {key} has {f[key].shape[0]} rows but input_ids has "
                                f"{rows}: the file is damaged; make it again")
        for key, like in (("input_mask", "input_ids"), ("segment_ids", "input_ids"),
                          ("masked_lm_ids", "masked_lm_positions")):
            if f[key].shape != f[like].shape:
                raise DataError(f"{path}: dataset {key} is {list(f[key].shape)} but {like} is "
                                f"{list(f[like].shape)}: the file is damaged; make it again")

    def __getstate__(self):
        return {**self.__dict__, "_file": None, "_pid": None}  # a worker opens its own handle

    @property
    def num_blocks(self) -> int:
        return -(-self.num_rows // self.block_rows)

    def block_range(self, block: int) -> tuple[int, int]:
        start = block * self.block_rows
        return start, min(start + self.block_rows, self.num_rows)

    def _handle(self):  # -> h5py.File
        if self._file is None or self._pid != os.getpid():
            import h5py

            self._file, self._pid = h5py.File(self.path, "r"), os.getpid()
        return self._file

    def read_block(self, block: int) -> dict:
        """The rows of one block, as stored: {key: ndarray [rows, ...]}."""
        lo, hi = self.block_range(block)
        f = self._handle()
        return {k: f[k][lo:hi] for k in HDF5_KEYS}

    @staticmethod
    def block_row(data: dict, i: int) -> dict:
        """Row i of a block as megabert trains on it: int64 arrays (0-d next_sentence_label)."""
        input_ids = data["input_ids"][i].astype(np.int64)
        return {"input_ids": input_ids,
                "token_type_ids": data["segment_ids"][i].astype(np.int64),
                "attention_mask": data["input_mask"][i].astype(np.int64),
                "labels": dle_labels(data["masked_lm_positions"][i], data["masked_lm_ids"][i].astype(np.int64),
                                     len(input_ids)),
                "next_sentence_label": np.array(data["next_sentence_labels"][i], dtype=np.int64)}
