"""NVIDIA's BERT pre-training files as they are: DeepLearningExamples' HDF5 shards and LDDL's
parquet shards, found in --data-path, ordered by megabert's seeded global order, and the
public one-file reader `pretraining_samples`.

--data-path takes a directory (searched recursively, as LDDL does), a glob, a list of files,
or weight/path pairs as for Megatron prefixes (`0.3 dirA 0.7 dirB`); the format is detected
from the file names. Files whose name contains "test" are DLE's held-out shards: they are
not trained on and make the validation set.
"""
from __future__ import annotations

import math
import os
from bisect import bisect_right
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megabert.config import DataConfig
from megabert.data.sample_errors import cause
from megabert.data.shard_sources import HDF5, PARQUET, NvidiaSource, sentence_pair_task, shard_format
from megabert.data.tokenizers import read_wordpiece_vocab
from megabert.errors import ConfigError, DataError, MegabertError
from megabert.tasks.pretraining.blending import BlendedDataset
from megabert.tasks.pretraining.lddl_parquet import ParquetShard, WordPieceIds, non_special
from megabert.tasks.pretraining.masking import IGNORE_INDEX, TokenTable, mask_tokens
from megabert.tasks.pretraining.nvidia_hdf5 import Hdf5Shard
from megabert.tasks.pretraining.shard_order import Block, BlockCache, ShardOrder

def open_shard(path: str):
    return Hdf5Shard(path) if shard_format(path) == HDF5 else ParquetShard(path)


def unreadable(shard, block: int, row: int, error: Exception) -> DataError:
    """The line for an exception of h5py, pyarrow or numpy while a row of a shard was read or
    decoded (bit rot inside a gzip chunk or a snappy page, junk in a column): the libraries'
    own messages name no file."""
    lo, hi = shard.block_range(block)
    unit, kind = ("row band", f"a {HDF5}") if isinstance(shard, Hdf5Shard) else ("row group", f"an {PARQUET}")
    return DataError(f"{shard.path}: row {row} (in {unit} {block}, rows {lo}-{hi - 1}) cannot be read "
                     f"({cause(error)}): the file is damaged or not {kind} shard; make or copy it again")


@dataclass(frozen=True)
class RowSpec:
    """How a stored row becomes a training sample."""
    seq_length: int
    max_predictions: Optional[int]  # the --max-predictions-per-seq a user gave (None: not given)
    mask_prob: float
    seed: int
    split_id: int  # 0 train, 1 valid: a separate masking stream per split


def check_shard(shard, spec: RowSpec) -> None:
    """The flags against what a shard's metadata says, before any row is read."""
    if isinstance(shard, Hdf5Shard):
        if shard.seq_length != spec.seq_length:
            raise ConfigError(f"{shard.path} holds rows of {shard.seq_length} tokens but --seq-length is "
                              f"{spec.seq_length}: pass --seq-length {shard.seq_length}")
        if spec.max_predictions is not None and shard.max_predictions > spec.max_predictions:
            raise ConfigError(f"{shard.path} holds up to {shard.max_predictions} masked positions per row but "
                              f"--max-predictions-per-seq is {spec.max_predictions}: pass "
                              f"--max-predictions-per-seq {shard.max_predictions}")
    elif shard.max_tokens is not None and shard.max_tokens > spec.seq_length:
        raise ConfigError(f"{shard.path} holds rows of up to {shard.max_tokens} tokens but --seq-length is "
                          f"{spec.seq_length}: pass --seq-length {shard.max_tokens} (LDDL's --target-seq-length)")


class NvidiaShardDataset(torch.utils.data.Dataset):
    """`size` samples of a set of shards in megabert's order (see shard_order): items are dicts
    of int64 arrays padded to --seq-length, as BertDataset's. Dynamic-masking LDDL rows are
    masked here from a generator seeded by (seed, split, sample index), so a sample depends on
    its index alone, across epochs, workers and resumes."""

    def __init__(self, files: list[str], spec: RowSpec, size: Optional[int], tokens: Optional[TokenTable] = None,
                 words: Optional[WordPieceIds] = None, shuffle: bool = True, global_batch: int = 1):
        self.shards = [open_shard(f) for f in files]
        self.spec, self.tokens, self.words = spec, tokens, words
        for shard in self.shards:
            check_shard(shard, spec)
        bins = {s.bin for s in self.shards}
        if len(bins) > 1 and None in bins:
            raise DataError(f"{os.path.dirname(files[0]) or '.'} mixes binned (*.parquet_B) and unbinned "
                            f"(*.parquet) shards: give --data-path one LDDL output at a time")
        blocks = {}
        for k, shard in enumerate(self.shards):
            for b in range(shard.num_blocks):
                lo, hi = shard.block_range(b)
                if hi > lo:
                    blocks.setdefault(shard.bin, []).append(Block(k, b, lo, hi - lo))
        streams = [blocks[b] for b in sorted(blocks, key=lambda b: -1 if b is None else b)]
        if not streams:
            raise DataError(f"{files[0]} and the other shards of --data-path hold no row")
        binned = len(streams) > 1
        self.order = ShardOrder(streams, spec.seed, shuffle=shuffle, chunk=global_batch if binned else 1)
        if self.order.epoch_length == 0:
            raise DataError(f"no bin of {os.path.dirname(files[0])} holds a global batch of {global_batch} samples")
        self.size = self.order.epoch_length if size is None else size
        self.cache = BlockCache(self._read_block)  # a method, not a lambda: workers may be spawned (pickled)

    def _read_block(self, block: Block):
        return self.shards[block.shard].read_block(block.block)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        return self.masked_sample(idx, self.spec.mask_prob)

    def masked_sample(self, idx: int, mask_prob: float) -> dict:
        """Sample idx; a dynamic-masking row masked at `mask_prob` (stored masks stay as stored)."""
        block, offset = self.order.locate(int(idx))
        shard = self.shards[block.shard]
        data = self.cache.get(block)
        if isinstance(shard, Hdf5Shard):
            return shard.block_row(data, offset)
        return self._fit(shard, shard.block_row(data, offset, self.words), int(idx), block.start + offset, mask_prob)

    def sample_error(self, idx: int, error: Exception) -> DataError:
        """What failed when sample idx could not be read (megabert.data.sample_errors)."""
        block, offset = self.order.locate(int(idx))
        return unreadable(self.shards[block.shard], block.block, block.start + offset, error)

    def _fit(self, shard: ParquetShard, row: dict, idx: int, row_in_shard: int, mask_prob: float) -> dict:
        """An LDDL row padded to --seq-length (0, as LDDL pads), masked when the shard is dynamic."""
        spec, n = self.spec, len(row["input_ids"])
        if n > spec.seq_length:
            raise ConfigError(f"{shard.path} row {row_in_shard} has {n} tokens but --seq-length is "
                              f"{spec.seq_length}: pass --seq-length {n} or more")
        if not shard.static_masking:
            tok = self.tokens
            maskable = non_special(row["token_type_ids"])
            rng = np.random.default_rng([spec.seed, spec.split_id, idx])
            budget = spec.max_predictions or max(1, int(round(mask_prob * spec.seq_length)))
            row["input_ids"], row["labels"] = mask_tokens(row["input_ids"], maskable, rng, mask_prob=mask_prob,
                                                          max_predictions=budget, mask_id=tok.mask,
                                                          random_ids=tok.random_ids, word_start=tok.word_start)
        elif spec.max_predictions is not None and (row["labels"] != IGNORE_INDEX).sum() > spec.max_predictions:
            raise ConfigError(f"{shard.path} row {row_in_shard} has {(row['labels'] != IGNORE_INDEX).sum()} masked "
                              f"positions but --max-predictions-per-seq is {spec.max_predictions}: raise it")
        pad = spec.seq_length - n
        fill = {"labels": IGNORE_INDEX}
        return {k: (np.pad(v, (0, pad), constant_values=fill.get(k, 0)) if v.ndim else v) for k, v in row.items()}


def build_nvidia_datasets(source: NvidiaSource, data: DataConfig, tokenizer, num_samples: tuple[int, int, int],
                          seed: int, global_batch: int, binary_head: bool):
    """(train, valid) datasets of NVIDIA shards; valid is None without held-out (*test*) files or
    when no evaluation is asked for."""
    if binary_head:  # resolve_run chose NSP for a run; a caller of this function chose data.binary_head_task
        sentence_pair_task(source.format, data.binary_head_task, given=True)
    words = WordPieceIds(tokenizer.vocab, data.vocab_file) if source.format == PARQUET else None
    tokens = TokenTable(tokenizer, data.whole_word_masking) if source.format == PARQUET else None

    def build(split_id: int, files_per_component, n):
        spec = RowSpec(seq_length=data.seq_length, max_predictions=data.max_predictions_per_seq,
                       mask_prob=data.mask_prob, seed=seed, split_id=split_id)
        present = [(w, files) for w, files in zip(source.weights, files_per_component) if files]
        weights = [w / sum(w for w, _ in present) for w, _ in present]
        # Each blend component gets its share plus one: the greedy blend never runs further ahead than that.
        sizes = [n] if len(present) == 1 else [int(math.ceil(w * n)) + 1 for w in weights]
        parts = [NvidiaShardDataset(files, spec, size, tokens, words, shuffle=split_id == 0,
                                    global_batch=global_batch) for (_, files), size in zip(present, sizes)]
        if len(parts) == 1:
            return parts[0]
        if any(len(p.order.streams) > 1 for p in parts):
            raise ConfigError("binned LDDL data cannot be blended with weights (a global batch comes from one bin): "
                              "give --data-path one binned directory")
        return BlendedDataset(parts, weights, n)

    train = build(0, source.train_files, num_samples[0])
    valid = build(1, source.test_files, num_samples[1]) if num_samples[1] and any(source.test_files) else None
    return train, valid


class ShardSamples(SequenceABC):
    """The rows of one shard file as megabert trains on them (see pretraining_samples)."""

    def __init__(self, path: str, vocab_file: Optional[str] = None):
        fmt = shard_format(path)
        if fmt is None or not os.path.isfile(path):
            raise DataError(f"{path} is not a DeepLearningExamples .hdf5 shard or an LDDL .parquet shard")
        self.shard = open_shard(path)
        self.words = None
        if fmt == PARQUET:
            if vocab_file is None:
                raise ConfigError(f"{path} holds WordPiece strings: pass vocab_file= (the vocab it was made with)")
            self.words = WordPieceIds(read_wordpiece_vocab(vocab_file), vocab_file)
        self._starts = [self.shard.block_range(b)[0] for b in range(self.shard.num_blocks)]
        self._cached = (None, None)

    def __len__(self) -> int:
        return self.shard.num_rows

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {self.shard.path}, which has {len(self)}")
        block = bisect_right(self._starts, i) - 1
        try:
            if self._cached[0] != block:
                self._cached = (block, self.shard.read_block(block))
            offset = i - self._starts[block]
            if self.words is None:
                row = self.shard.block_row(self._cached[1], offset)
            else:
                row = self.shard.block_row(self._cached[1], offset, self.words)
        except MegabertError:
            raise
        except Exception as e:  # as the training loader reports it (megabert.data.sample_errors)
            raise unreadable(self.shard, block, i, e) from None
        return {k: torch.from_numpy(v) for k, v in row.items()}


def pretraining_samples(path: str, vocab_file: Optional[str] = None) -> ShardSamples:
    """Row i of one DLE HDF5 shard or one LDDL parquet shard as megabert trains on it: a dict of
    1-D LongTensors `input_ids`, `token_type_ids`, `attention_mask`, `labels` (-100 where nothing
    is predicted) and a 0-d `next_sentence_label` (1 = B is random). HDF5 rows keep their stored
    length; parquet rows have their own length (|A| + |B| + 3) and need `vocab_file`. Rows of
    dynamic-masking LDDL shards have all labels -100: training masks them per sample."""
    return ShardSamples(path, vocab_file)
