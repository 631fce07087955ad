#!/usr/bin/env python
"""Concatenate Megatron .bin/.idx datasets into one (Megatron-LM's tools/merge_datasets.py).

    python tools/merge_datasets.py --input shards/ --output-prefix data/all_text_sentence
    python tools/merge_datasets.py --input a_text_sentence b_text_sentence --output-prefix ab_text_sentence

--input takes a directory (every prefix in it with both .bin and .idx, in sorted order)
or explicit prefixes, merged in the order given. All inputs must share one token dtype.
"""
import argparse
import os
import sys

from megabert.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, dataset_exists
from megabert.errors import ConfigError, DataError, cli_main


def input_prefixes(inputs: list) -> list:
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, f[:-4]) for f in os.listdir(item) if f.endswith(".idx"))
            found = [p for p in found if dataset_exists(p)]
            if not found:
                raise DataError(f"--input directory {item} holds no .bin/.idx pair")
            prefixes += found
        else:
            if item.endswith((".bin", ".idx")):
                item = item[:-4]
            if not dataset_exists(item):
                raise DataError(f"--input {item}: {item}.bin and {item}.idx must both exist")
            prefixes.append(item)
    return prefixes


@cli_main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="A directory of datasets, or dataset prefixes.")
    p.add_argument("--output-prefix", required=True, help="Prefix of the merged .bin/.idx.")
    args = p.parse_args(argv)
    prefixes = input_prefixes(args.input)
    if os.path.abspath(args.output_prefix) in map(os.path.abspath, prefixes):
        raise ConfigError(f"--output-prefix {args.output_prefix} is also an input; choose another name")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetWriter(args.output_prefix, dtype) as writer:
        for prefix in prefixes:
            writer.add_index(prefix)
        n = writer.num_sequences
    print(f"merged {len(prefixes)} datasets ({n} sequences) into {args.output_prefix}.bin/.idx")


if __name__ == "__main__":
    sys.exit(main())
