"""Which NVIDIA pre-training shards --data-path names, found from the file names alone.

Below the tasks so that the run's resolver can let the data decide the binary head (NVIDIA's
shards hold next-sentence pairs) without importing a task; the readers live in
megabert/tasks/pretraining (nvidia_samples.py, nvidia_hdf5.py, lddl_parquet.py).
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from megabert.errors import ConfigError, DataError

HDF5_SUFFIXES = (".hdf5", ".h5")


def is_parquet_shard(path: str) -> bool:
    return ".parquet" in os.path.splitext(path)[1]


HDF5, PARQUET = "DeepLearningExamples HDF5", "LDDL parquet"
_GLOB_CHARS = set("*?[")


def shard_format(path: str) -> Optional[str]:
    """HDF5 or PARQUET for a file name NVIDIA's tools write, None for anything else."""
    if path.endswith(HDF5_SUFFIXES):
        return HDF5
    if is_parquet_shard(path):
        return PARQUET
    return None


def _expand(item: str) -> Optional[list[str]]:
    """The shard files one --data-path item names; None for a Megatron prefix."""
    if os.path.isdir(item):
        files = sorted(os.path.join(root, name) for root, _, names in os.walk(item) for name in names
                       if shard_format(name))
        if not files:
            raise DataError(f"--data-path {item} is a directory with no .hdf5 or LDDL .parquet shard in it: "
                            f"name its shards, or the prefix P of Megatron's P.bin/P.idx")
        return files
    if _GLOB_CHARS & set(item):
        files = sorted(p for p in glob.glob(item) if shard_format(p))
        if not files:
            raise DataError(f"--data-path {item} matches no .hdf5 or LDDL .parquet file")
        return files
    if shard_format(item):
        if not os.path.isfile(item):
            raise DataError(f"--data-path names {item}, which does not exist")
        return [item]
    return None


@dataclass(frozen=True)
class NvidiaSource:
    """--data-path resolved to NVIDIA shards: the format and, per blend component, its weight,
    training files and held-out ("test") files."""
    format: str
    weights: list[float]
    train_files: list[list[str]]
    test_files: list[list[str]]


def detect_nvidia_data(data_path: Sequence[str]) -> Optional[NvidiaSource]:
    """NvidiaSource when --data-path names NVIDIA shards, None when it names Megatron prefixes."""
    items = list(data_path)
    try:
        weights = [float(w) for w in items[0::2]] if len(items) > 1 and len(items) % 2 == 0 else None
    except ValueError:
        weights = None
    paths = items[1::2] if weights else items
    expanded = [_expand(p) for p in paths]
    if all(e is None for e in expanded):
        return None
    if any(e is None for e in expanded):
        raise ConfigError(f"--data-path mixes NVIDIA shards with Megatron prefixes ({' '.join(items)}): "
                          f"train on one kind at a time")
    if weights is None:  # a list of paths is one component
        weights, expanded = [1.0], [[f for e in expanded for f in e]]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--data-path weights must be non-negative with a positive sum, got {weights}")
    formats = {shard_format(f) for e in expanded for f in e}
    if len(formats) > 1:
        raise ConfigError(f"--data-path mixes {' and '.join(sorted(formats))} files: train on one format at a time")
    train, test = [], []
    for files, path in zip(expanded, paths):
        test.append([f for f in files if "test" in os.path.basename(f)])
        train.append([f for f in files if "test" not in os.path.basename(f)])
        if not train[-1]:
            raise DataError(f"--data-path {path} holds only held-out files (named *test*), no training file")
    return NvidiaSource(formats.pop(), [w / sum(weights) for w in weights], train, test)


def sentence_pair_task(data_format: Optional[str], task: str, *, given: bool) -> str:
    """The binary head's objective on this data. NVIDIA's shards (`data_format`, None for
    Megatron's indexed data) hold next-sentence pairs, B random or the next segment and labelled
    so, not sentence order: on them the objective is NSP, and SOP asked for by name (`given`) is
    an error. Megatron's data makes either from its sentences: the flag's value."""
    if data_format is None:
        return task
    if given and task != "nsp":
        raise ConfigError(f"--binary-head-task {task} cannot train on --data-path's {data_format} shards: they hold "
                          f"next-sentence pairs (B is random or the next segment), not sentence order; drop the "
                          f"flag (they train NSP) or pass --bert-no-binary-head")
    return "nsp"
