"""BERT pre-training samples from a sentence-level indexed dataset (Megatron's recipe).

A sample is a run of whole sentences of one document (chosen by the sample mapping),
split into segments A and B for the binary head: SOP (ALBERT, the default) swaps A
and B with probability 0.5; NSP (the original BERT) replaces B with sentences of a
random other document with probability 0.5. The pair is trimmed to its token budget,
framed as [CLS] A [SEP] B [SEP], masked, and padded to seq_length.

Every random choice of sample i comes from a generator seeded with (seed, split, i),
so a sample depends on nothing but its index: not on worker count, data-parallel size
or how many samples a resumed run skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megabert.data.indexed_dataset import IndexedDataset
from megabert.data.sample_errors import cause
from megabert.tasks.pretraining.masking import TokenTable, mask_tokens
from megabert.tasks.pretraining.sample_mapping import get_mapping
from megabert.errors import ConfigError, DataError

SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}


@dataclass(frozen=True)
class SampleSpec:
    """How samples are made: everything but the data and the tokenizer."""
    seq_length: int
    binary_head: bool = True
    task: str = "sop"  # "sop" or "nsp"
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    whole_word_masking: bool = False
    max_predictions: Optional[int] = None  # default: round(mask_prob * seq_length)
    seed: int = 1234

    @property
    def max_tokens(self) -> int:
        """Token budget of A + B: seq_length less [CLS] and one [SEP] per segment."""
        return self.seq_length - (3 if self.binary_head else 2)


def truncate_pair(a: np.ndarray, b: np.ndarray, max_tokens: int, rng: np.random.Generator):
    """Trims A and B to max_tokens together: tokens come off the longer segment (B on a tie),
    each from the front or the back at random, as Megatron's token-by-token loop does."""
    excess = len(a) + len(b) - max_tokens
    if excess <= 0:
        return a, b
    gap = len(a) - len(b)
    if gap >= excess:
        cut_a, cut_b = excess, 0
    elif -gap >= excess:
        cut_a, cut_b = 0, excess
    else:  # equalise, then alternate starting with B
        rest = excess - abs(gap)
        cut_a, cut_b = max(gap, 0) + rest // 2, max(-gap, 0) + rest - rest // 2
    front_a, front_b = rng.binomial(cut_a, 0.5), rng.binomial(cut_b, 0.5)
    return a[front_a:len(a) - (cut_a - front_a)], b[front_b:len(b) - (cut_b - front_b)]


class BertDataset(torch.utils.data.Dataset):
    """Samples of one split of one indexed dataset. Items are dicts of int64 numpy arrays:
    input_ids, token_type_ids, attention_mask, labels [seq_length] and next_sentence_label []."""

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], split: str, num_samples: Optional[int],
                 spec: SampleSpec, tokenizer, cache_dir: Optional[str] = None):
        self.indexed, self.doc_range, self.split, self.spec = indexed, doc_range, split, spec
        if spec.task not in ("sop", "nsp"):
            raise ConfigError(f"--binary-head-task must be sop or nsp, got {spec.task!r}")
        self.tokens = TokenTable(tokenizer, spec.whole_word_masking)
        self.mapping, self.stats = get_mapping(
            indexed, doc_range, num_samples, spec.max_tokens, spec.short_seq_prob, spec.seed,
            min_num_sent=2 if spec.binary_head else 1, name=split, cache_dir=cache_dir)
        # NSP draws B from another document of the same split: its sentence boundaries.
        self._doc_bounds = np.asarray(indexed.document_indices[doc_range[0]:doc_range[1] + 1])
        self._nonempty_docs = np.flatnonzero(np.diff(self._doc_bounds) > 0)

    def __len__(self) -> int:
        return len(self.mapping)

    def _random_segment(self, rng: np.random.Generator, first_sentence: int, budget: int) -> np.ndarray:
        """Sentences from a random point of a random other document, up to `budget` tokens (NSP)."""
        own = np.searchsorted(self._doc_bounds, first_sentence, side="right") - 1
        for _ in range(10):  # a split with one document has no other: fall back to it, never loop
            doc = self._nonempty_docs[rng.integers(len(self._nonempty_docs))]
            if doc != own:
                break
        lo, hi = int(self._doc_bounds[doc]), int(self._doc_bounds[doc + 1])
        start = int(rng.integers(lo, hi))
        lengths = np.cumsum(self.indexed.sequence_lengths[start:hi], dtype=np.int64)
        end = start + 1 + int(np.searchsorted(lengths, budget))  # first run of sentences reaching the budget
        return self.indexed.tokens(start, min(end, hi)).astype(np.int64)

    def __getitem__(self, idx: int) -> dict:
        return self.masked_sample(idx, self.spec.mask_prob)

    def masked_sample(self, idx: int, mask_prob: float) -> dict:
        """Sample idx, `mask_prob` of its tokens chosen for prediction (megabert.tasks.pretraining
        .masking.ScheduledMasking gives each training sample the rate of its iteration)."""
        spec = self.spec
        first, end, target = (int(x) for x in self.mapping[idx])
        rng = np.random.default_rng([spec.seed, SPLIT_IDS.get(self.split, 3), int(idx)])
        label = 0
        if spec.binary_head:
            lengths = self.indexed.sequence_lengths[first:end]
            n = end - first  # >= 2: the mapping only makes pairs from documents that have them
            pivot = 1 if n == 2 else int(rng.integers(1, n))
            split_at = int(lengths[:pivot].sum())
            tokens = self.indexed.tokens(first, end).astype(np.int64)
            a, b = tokens[:split_at], tokens[split_at:]
            if rng.random() < 0.5:
                label = 1
                if spec.task == "sop":
                    a, b = b, a
                else:
                    b = self._random_segment(rng, first, max(target - len(a), 1))
            a, b = truncate_pair(a, b, target, rng)
        else:
            a = self.indexed.tokens(first, end).astype(np.int64)
            a, b = truncate_pair(a, a[:0], target, rng)
        return self._frame(a, b, label, rng, mask_prob)

    def sample_error(self, idx: int, error: Exception) -> DataError:
        """What failed when sample idx could not be read (megabert.data.sample_errors): the index
        checks at open cover its header, sizes and ends, not every sequence pointer."""
        first, end, _ = (int(x) for x in self.mapping[idx])
        prefix = self.indexed.path_prefix
        return DataError(f"{prefix}.bin/.idx: sample {idx} of the {self.split} split (sentences {first}-{end - 1}) "
                         f"cannot be read ({cause(error)}): the files are damaged or not a Megatron .bin/.idx pair; "
                         f"make them again with tools/preprocess_data.py")

    def _frame(self, a: np.ndarray, b: np.ndarray, label: int, rng: np.random.Generator, mask_prob: float) -> dict:
        """[CLS] A [SEP] (B [SEP]), masked and padded."""
        spec, tok = self.spec, self.tokens
        seq = spec.seq_length
        n_a, n_b = len(a), len(b)
        used = n_a + 2 + (n_b + 1 if spec.binary_head else 0)
        input_ids = np.full(seq, tok.pad, dtype=np.int64)
        input_ids[0] = tok.cls
        input_ids[1:1 + n_a] = a
        input_ids[1 + n_a] = tok.sep
        token_type_ids = np.zeros(seq, dtype=np.int64)
        maskable = np.zeros(seq, dtype=bool)
        maskable[1:1 + n_a] = True
        if spec.binary_head:
            input_ids[2 + n_a:2 + n_a + n_b] = b
            input_ids[2 + n_a + n_b] = tok.sep
            token_type_ids[2 + n_a:used] = 1
            maskable[2 + n_a:2 + n_a + n_b] = True
        attention_mask = np.zeros(seq, dtype=np.int64)
        attention_mask[:used] = 1
        input_ids, labels = mask_tokens(input_ids, maskable, rng, mask_prob=mask_prob,
                                        max_predictions=spec.max_predictions or max(1, round(mask_prob * seq)),
                                        mask_id=tok.mask,
                                        random_ids=tok.random_ids, word_start=tok.word_start)
        return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask,
                "labels": labels, "next_sentence_label": np.array(label, dtype=np.int64)}
