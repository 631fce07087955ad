"""The BERT sample mapping (built by helpers.cpp), cached as .npy under a hash of its inputs.

A mapping row (first sentence, end sentence, target length) says which sentences form a
sample. Building it is a pass over every sentence, so it is saved once and memory-mapped
afterwards; the file name carries a hash of everything the mapping depends on, so a
changed corpus, split or seed never reads a stale mapping.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Optional

import numpy as np

from megabert.data.indexed_dataset import IndexedDataset, idx_path

from megabert.tasks.pretraining.cpp_helpers import build_sample_mapping

MAPPING_VERSION = 1  # bump when helpers.cpp changes what it builds


class DataWarning(UserWarning):
    """Something in the data is skipped or suspicious; training goes on."""


def _cache_key(indexed: IndexedDataset, params: dict) -> tuple[str, dict]:
    ipath = os.path.realpath(idx_path(indexed.path_prefix))
    st = os.stat(ipath)
    # The index file's size and mtime stand for its content: a re-preprocessed corpus gets a new key.
    description = {"version": MAPPING_VERSION, "index": ipath, "index_bytes": st.st_size,
                   "index_mtime_ns": st.st_mtime_ns, **params}
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    return digest, description


def build_mapping(indexed: IndexedDataset, doc_range: tuple[int, int], num_samples: Optional[int],
                  max_seq_length: int, short_seq_prob: float, seed: int, min_num_sent: int) -> tuple[np.ndarray, dict]:
    """(mapping [samples, 3], stats) for documents [doc_range[0], doc_range[1]) without caching.
    num_samples None: one pass over the documents; else as many passes as it takes to reach it."""
    first, last = doc_range
    docs = np.ascontiguousarray(indexed.document_indices[first:last + 1])
    num_epochs = 1 if num_samples is None else np.iinfo(np.int32).max
    return build_sample_mapping(docs, indexed.sequence_lengths, num_epochs,
                                         -1 if num_samples is None else int(num_samples), int(max_seq_length),
                                         float(short_seq_prob), int(seed) & 0xFFFFFFFFFFFFFFFF, int(min_num_sent))


def get_mapping(indexed: IndexedDataset, doc_range: tuple[int, int], num_samples: Optional[int],
                max_seq_length: int, short_seq_prob: float, seed: int, min_num_sent: int, name: str,
                cache_dir: Optional[str] = None) -> tuple[np.ndarray, dict]:
    """The mapping from the cache when there, else built and saved; returns (mapping, stats).

    Every process that misses the cache builds it and renames its file into place, so
    concurrent ranks never read a half-written file and no rank waits on another.
    """
    params = {"doc_range": list(map(int, doc_range)), "num_samples": num_samples, "max_seq_length": max_seq_length,
              "short_seq_prob": short_seq_prob, "seed": seed, "min_num_sent": min_num_sent}
    digest, description = _cache_key(indexed, params)
    cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(indexed.path_prefix)), "cache")
    base = os.path.join(cache_dir, f"{os.path.basename(indexed.path_prefix)}_{name}_{digest}")
    path, stats_path = base + "_mapping.npy", base + "_mapping.json"
    if os.path.isfile(path) and os.path.isfile(stats_path):
        try:
            with open(stats_path) as f:
                stats = json.load(f)["stats"]
            return np.load(path, mmap_mode="r"), stats
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is rebuilt below
    mapping, stats = build_mapping(indexed, doc_range, num_samples, max_seq_length, short_seq_prob, seed,
                                   min_num_sent)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.npy.tmp"
        with open(tmp, "wb") as f:
            np.save(f, mapping)
        with open(stats_path + f".{os.getpid()}.tmp", "w") as f:
            json.dump({"description": description, "stats": stats}, f, indent=1)
        os.replace(tmp, path)
        os.replace(stats_path + f".{os.getpid()}.tmp", stats_path)
    except OSError as e:
        warnings.warn(f"cannot cache the sample mapping in {cache_dir} ({e}); it is rebuilt on every start. "
                      f"Set --data-cache-path to a writable directory", DataWarning, stacklevel=2)
    return mapping, stats
