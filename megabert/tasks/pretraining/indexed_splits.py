"""--data-path (Megatron prefixes, weighted) and --split -> the train/valid/test BertDatasets of
Megatron's indexed data, each a blend when --data-path names several prefixes."""
from __future__ import annotations

import logging
import math
import warnings
from typing import Optional, Sequence

import numpy as np
import torch

from megabert.config import DataConfig
from megabert.tasks.pretraining.blending import BlendedDataset
from megabert.tasks.pretraining.indexed_samples import BertDataset, SampleSpec
from megabert.data.indexed_dataset import IndexedDataset
from megabert.tasks.pretraining.sample_mapping import DataWarning
from megabert.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """`P` -> ([P], [1.0]); `0.3 A 0.7 B` -> ([A, B], [0.3, 0.7]) (weights normalised)."""
    items = list(data_path)
    if not items:
        raise ConfigError("--data-path is required: the prefix P of P.bin/P.idx from tools/preprocess_data.py")
    if len(items) == 1:
        return [_prefix(items[0])], [1.0]
    try:
        if len(items) % 2:
            raise ValueError
        weights = [float(w) for w in items[0::2]]
    except ValueError:
        raise ConfigError(f"--data-path takes one prefix or weight/prefix pairs such as 0.3 A 0.7 B, "
                          f"got {' '.join(items)}") from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--data-path weights must be non-negative with a positive sum, got {weights}")
    return [_prefix(p) for p in items[1::2]], [w / sum(weights) for w in weights]


def _prefix(path: str) -> str:
    """A user may name P.bin or P.idx where the prefix P is meant."""
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def split_fractions(split: str) -> list[float]:
    parts = [float(x) for x in split.replace("/", ",").split(",")]
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_ranges(split: str, num_docs: int) -> list[tuple[int, int]]:
    """Document ranges of train, valid and test: consecutive, rounded, covering every document."""
    bounds = [0]
    for fraction in np.cumsum(split_fractions(split))[:-1]:
        bounds.append(min(int(round(fraction * num_docs)), num_docs))
    bounds.append(num_docs)
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def _no_sample_error(prefix: str, split: str, doc_range, num_docs: int, config_split: str, stats: dict,
                     binary_head: bool) -> DataError:
    where = (f"the {split} split of {prefix} (documents {doc_range[0]}..{doc_range[1]} of {num_docs}, "
             f"--split {config_split})")
    if doc_range[1] <= doc_range[0]:
        return DataError(f"{where} holds no document: use a larger corpus or give {split} a larger share of --split")
    if binary_head and stats.get("short_docs"):
        return DataError(f"{where} yields no sample: none of its documents has two sentences, which the "
                         f"sentence-pair head needs; preprocess with --split-sentences or train with "
                         f"--bert-no-binary-head")
    return DataError(f"{where} yields no sample: all its documents are empty")


def _no_documents(split: str, indexed: IndexedDataset, split_id: int) -> bool:
    lo, hi = split_ranges(split, indexed.num_documents)[split_id]
    return hi <= lo


def _build_one(indexed: IndexedDataset, prefix: str, split_id: int, num_samples: int, data: DataConfig,
               spec: SampleSpec, tokenizer) -> BertDataset:
    split = SPLITS[split_id]
    doc_range = split_ranges(data.split, indexed.num_documents)[split_id]
    stats = {}
    if doc_range[1] > doc_range[0]:
        ds = BertDataset(indexed, doc_range, split, num_samples, spec, tokenizer, data.data_cache_path)
        stats = ds.stats
        if spec.binary_head and stats["short_docs"]:
            warnings.warn(f"{stats['short_docs']} of {doc_range[1] - doc_range[0]} documents in the {split} split "
                          f"of {prefix} have a single sentence and cannot form a sentence pair: skipped "
                          f"(if most documents do, preprocess with --split-sentences or train with "
                          f"--bert-no-binary-head)",
                          DataWarning, stacklevel=3)
        if len(ds):
            return ds
    raise _no_sample_error(prefix, split, doc_range, indexed.num_documents, data.split, stats, spec.binary_head)


def build_train_valid_test_datasets(data: DataConfig, tokenizer, num_samples: tuple[int, int, int], seed: int,
                                    binary_head: bool) -> tuple[Optional[torch.utils.data.Dataset], ...]:
    """The train, valid and test datasets of --data-path, each with at least num_samples[i] samples.

    A split gets None when it is asked for no sample or --split gives it no share. A held-out
    split (valid, test) whose share of a small corpus rounds to no document is None too, with one
    warning, as Megatron builds it (--split 969,30,1 leaves a corpus of fewer than ~700 documents
    no test document, and pretrain_bert.py reads no test split); the train split, or a split that
    has documents but yields no sample, is a DataError that says why.
    """
    prefixes, weights = parse_data_path(data.data_path)
    indexed = [IndexedDataset(p) for p in prefixes]
    spec = SampleSpec(seq_length=data.seq_length, binary_head=binary_head, task=data.binary_head_task,
                      mask_prob=data.mask_prob, short_seq_prob=data.short_seq_prob,
                      whole_word_masking=data.whole_word_masking, max_predictions=data.max_predictions_per_seq,
                      seed=seed)
    fractions = split_fractions(data.split)
    out = []
    for split_id, n in enumerate(num_samples):
        if not n or fractions[split_id] == 0:
            out.append(None)
            continue
        if split_id > 0 and any(_no_documents(data.split, ds, split_id) for ds in indexed):
            logger.warning("the %s split of --data-path holds no document (--split %s of %s documents): no %s "
                           "split%s; give it a larger share of --split to have one", SPLITS[split_id], data.split,
                           "/".join(str(ds.num_documents) for ds in indexed), SPLITS[split_id],
                           ", no evaluation" if split_id == 1 else "")
            out.append(None)
            continue
        if len(prefixes) == 1:
            out.append(_build_one(indexed[0], prefixes[0], split_id, n, data, spec, tokenizer))
            continue
        # Each component gets its share plus one: the greedy blend never runs further ahead than that.
        parts = []
        for ds, prefix, weight in zip(indexed, prefixes, weights):
            parts.append(_build_one(ds, prefix, split_id, int(math.ceil(weight * n)) + 1, data, spec, tokenizer))
        out.append(BlendedDataset(parts, weights, n))
    return tuple(out)
