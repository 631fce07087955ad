"""The global sample order over a set of shards read by block (HDF5 row bands, parquet row
groups): seeded, a pure function of (seed, epoch, position), so it does not depend on the
number of ranks or loader workers, and a run resumed at any consumed_samples sees exactly
the samples the uninterrupted run would have.

Why not one uniform permutation of all rows: a random row of a random file costs a whole
block's decompression (HDF5's gzip chunks, parquet's row groups), and a permutation of all
rows of a multi-terabyte corpus does not fit in memory. So each epoch permutes the blocks,
cuts them into windows of blocks (from different files: about WINDOW_ROWS rows, 2 to
MAX_WINDOW_BLOCKS blocks), and permutes the rows inside each window: a loader keeps one
window's blocks decoded, and memory holds one window's permutation. (NVIDIA's loaders shuffle less: DLE within one file at a time, LDDL
within a 16,384-sample buffer per worker.)

Binned data (LDDL's `shard-N.parquet_B`): each bin is ordered as above, cut into chunks of
one global batch, and the chunks of all bins are interleaved in a seeded order, so a global
batch never mixes bins. A bin's last chunk of an epoch, short of a global batch, is left
out of that epoch (the rows left out differ from epoch to epoch).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

WINDOW_ROWS = 1 << 16
MAX_WINDOW_BLOCKS = 8
# Distinct first words of the RNG seeds, so no two uses of the run's seed share a stream.
_BLOCKS, _ROWS, _BINS = 11, 12, 13


@dataclass(frozen=True)
class Block:
    shard: int  # index into the shard list
    block: int  # block of that shard
    start: int  # its first row in the shard
    rows: int


def window_blocks(blocks: list[Block]) -> int:
    """Blocks per window: about WINDOW_ROWS rows, at least 2 blocks (rows of two files mix) and at
    most MAX_WINDOW_BLOCKS (parquet row groups can be whole shards of tens of thousands of rows)."""
    mean_rows = sum(b.rows for b in blocks) / max(len(blocks), 1)
    return int(min(MAX_WINDOW_BLOCKS, max(2, -(-WINDOW_ROWS // max(mean_rows, 1)))))


class _StreamEpoch:
    """One epoch of one stream (a bin, or all blocks): position -> (block, row in block)."""

    def __init__(self, blocks: list[Block], seed: int, epoch: int, stream: int, shuffle: bool):
        self.seed, self.epoch, self.stream, self.shuffle = seed, epoch, stream, shuffle
        order = (np.random.default_rng([_BLOCKS, seed, epoch, stream]).permutation(len(blocks)) if shuffle
                 else np.arange(len(blocks)))
        self.blocks = [blocks[k] for k in order]
        sizes = np.array([b.rows for b in self.blocks], dtype=np.int64)
        self.block_starts = np.concatenate([[0], np.cumsum(sizes)])
        self.window_blocks = window_blocks(blocks)
        self.window_starts = self.block_starts[::self.window_blocks]
        if self.window_starts[-1] != self.block_starts[-1]:
            self.window_starts = np.append(self.window_starts, self.block_starts[-1])
        self.rows = int(self.block_starts[-1])
        self._window, self._perm = -1, None

    def locate(self, position: int) -> tuple[Block, int]:
        w = int(np.searchsorted(self.window_starts, position, side="right")) - 1
        if self.shuffle:
            if w != self._window:
                size = int(self.window_starts[w + 1] - self.window_starts[w])
                rng = np.random.default_rng([_ROWS, self.seed, self.epoch, self.stream, w])
                self._window, self._perm = w, rng.permutation(size)
            position = int(self.window_starts[w] + self._perm[position - self.window_starts[w]])
        k = int(np.searchsorted(self.block_starts, position, side="right")) - 1
        return self.blocks[k], position - int(self.block_starts[k])


class _Epoch:
    """One epoch over all streams: a position -> (block, row in block)."""

    def __init__(self, streams: list[list[Block]], seed: int, epoch: int, shuffle: bool, chunk: int):
        self.streams = [_StreamEpoch(s, seed, epoch, k, shuffle) for k, s in enumerate(streams)]
        self.chunk = chunk
        if len(streams) == 1:
            self.length = self.streams[0].rows
            return
        counts = [s.rows // chunk for s in self.streams]
        self.chunk_stream = np.repeat(np.arange(len(streams)), counts)
        np.random.default_rng([_BINS, seed, epoch]).shuffle(self.chunk_stream)
        # rank of each chunk among the chunks of its stream, in the interleaved order
        self.chunk_rank = np.zeros(len(self.chunk_stream), dtype=np.int64)
        for k in range(len(streams)):
            where = np.flatnonzero(self.chunk_stream == k)
            self.chunk_rank[where] = np.arange(len(where))
        self.length = len(self.chunk_stream) * chunk

    def locate(self, position: int) -> tuple[Block, int]:
        if len(self.streams) == 1:
            return self.streams[0].locate(position)
        c, offset = divmod(position, self.chunk)
        return self.streams[int(self.chunk_stream[c])].locate(int(self.chunk_rank[c]) * self.chunk + offset)


class ShardOrder:
    """Sample index -> (Block, row within the block), over as many epochs as asked.

    `streams`: the blocks of each bin (one stream when not binned); `chunk`: the global batch
    size, the unit in which binned streams are interleaved; `shuffle=False` reads the files in
    order (validation)."""

    def __init__(self, streams: list[list[Block]], seed: int, shuffle: bool = True, chunk: int = 1):
        self.streams, self.seed, self.shuffle, self.chunk = streams, seed, shuffle, chunk
        self._epochs: OrderedDict[int, _Epoch] = OrderedDict()
        self.epoch_length = self._epoch(0).length

    def _epoch(self, epoch: int) -> _Epoch:
        if epoch not in self._epochs:
            self._epochs[epoch] = _Epoch(self.streams, self.seed, epoch, self.shuffle, self.chunk)
            if len(self._epochs) > 2:  # a global batch can straddle two epochs
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def locate(self, index: int) -> tuple[Block, int]:
        epoch, position = divmod(index, self.epoch_length)
        return self._epoch(epoch).locate(position)


class BlockCache:
    """Decoded blocks of this process, least recently used dropped first: one window's worth
    and a little more, so a window is decoded once per process."""

    def __init__(self, read, capacity: int = MAX_WINDOW_BLOCKS + 2):
        self.read, self.capacity = read, capacity
        self._blocks: OrderedDict[tuple[int, int], object] = OrderedDict()

    def __getstate__(self):
        return {**self.__dict__, "_blocks": OrderedDict()}  # a worker decodes its own

    def get(self, block: Block):
        key = (block.shard, block.block)
        if key in self._blocks:
            self._blocks.move_to_end(key)
        else:
            self._blocks[key] = self.read(block)
            if len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
        return self._blocks[key]
