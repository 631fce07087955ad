#!/usr/bin/env python
"""Padding share of LDDL binned data, with and without binning: the rows of one epoch in
megabert's order, cut into micro-batches, each padded as LDDL pads a batch (to its longest row,
rounded up to 8) and as a fixed-shape loader pads (to --seq-length). Without binning is the
same rows in megabert's unbinned order (all bins as one stream). Prints figures only.

    python bench/nvidia_padding.py [--data-path tests/fixtures/nvidia/lddl/phase2_static_binned]
        [--seq-length 512] [--global-batch 8] [--micro-batch 8]
"""
import argparse
import os

import numpy as np
import pyarrow.parquet as pq

from megabert.config import DataConfig
from megabert.data import build_tokenizer
from megabert.data.shard_sources import detect_nvidia_data
from megabert.tasks.pretraining.nvidia_samples import build_nvidia_datasets
from megabert.tasks.pretraining.shard_order import ShardOrder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "nvidia")


def padding_shares(lengths: np.ndarray, micro_batch: int, seq_length: int) -> tuple[float, float]:
    """(share padded to each batch's longest row rounded to 8, share padded to seq_length)."""
    batches = lengths[:len(lengths) // micro_batch * micro_batch].reshape(-1, micro_batch)
    longest = -(-batches.max(axis=1) // 8) * 8
    tokens = batches.sum()
    return 1 - tokens / (longest * micro_batch).sum(), 1 - tokens / (batches.size * seq_length)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-path", default=os.path.join(FIXTURES, "lddl", "phase2_static_binned"))
    p.add_argument("--vocab-file", default=os.path.join(FIXTURES, "text", "vocab.txt"))
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=20, help="epochs averaged (each has its own order)")
    args = p.parse_args()
    data = DataConfig(data_path=[args.data_path], vocab_file=args.vocab_file, seq_length=args.seq_length,
                      binary_head_task="nsp")
    tokenizer = build_tokenizer("BertWordPieceLowerCase", args.vocab_file)
    train, _ = build_nvidia_datasets(detect_nvidia_data(data.data_path), data, tokenizer, (1, 0, 0), 1234,
                                     args.global_batch, True)
    num_tokens = [pq.read_table(s.path, columns=["num_tokens"]).column(0).to_numpy().astype(np.int64)
                  for s in train.shards]
    binned = train.order
    unbinned = ShardOrder([[b for stream in binned.streams for b in stream]], binned.seed)

    def lengths(order: ShardOrder, epochs: int) -> np.ndarray:
        out = []
        for i in range(order.epoch_length * epochs):
            block, offset = order.locate(i)
            out.append(num_tokens[block.shard][block.start + offset])
        return np.array(out)

    rows = sum(len(t) for t in num_tokens)
    print(f"{args.data_path}: {len(train.shards)} shards, {len(binned.streams)} bins, {rows} rows; "
          f"micro-batch {args.micro_batch}, global batch {args.global_batch}, --seq-length {args.seq_length}, "
          f"{args.epochs} epochs")
    print(f"{'order':28} {'rows/epoch':>10} {'padding, batch to longest/8':>28} {'padding, to --seq-length':>25}")
    for name, order in (("binned (one bin per batch)", binned), ("unbinned (bins mixed)", unbinned)):
        to_longest, to_seq = padding_shares(lengths(order, args.epochs), args.micro_batch, args.seq_length)
        print(f"{name:28} {order.epoch_length:10d} {to_longest:27.1%} {to_seq:25.1%}")


if __name__ == "__main__":
    main()
