"""BERT's masked-LM corruption (Devlin et al. 2018, section 3.1 and appendix A.1).

Of the maskable tokens, `mask_prob` (15%) are chosen, at most `max_predictions` per
sequence; a chosen token becomes [MASK] 80% of the time, a random token 10% and stays
itself 10%, and the model must predict the original at every chosen position. With
whole-word masking the choice is made per word (a word-start WordPiece with the "##"
pieces after it; for byte-level BPE, a piece that starts a word by the rule of
megabert.data.tokenizers.WordStarts and the pieces after it), so a word is either masked
whole or not at all.

The rate may change over training (--mask-prob-schedule, as mmBERT anneals 30% -> 15% -> 5%):
MaskRates gives each training sample the rate in force at its index, and ScheduledMasking
hands it to the dataset. A sample still depends on nothing but its index.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from megabert.config import DataConfig, mask_prob_points
from megabert.data.tokenizers import WordStarts

IGNORE_INDEX = -100  # transformers' and torch's cross-entropy ignore index


WordStartRule = Union[WordStarts, np.ndarray]
"""A tokenizer's WordStarts (`Tokenizer.word_starts()`: a piece's context counts), or a bool
[vocab] array of the pieces that start a word wherever they stand (`word_start_mask()`)."""


def _words(positions: np.ndarray, tokens: np.ndarray, word_start: Optional[WordStartRule]) -> list[np.ndarray]:
    """Groups maskable positions into units: single tokens, or whole words."""
    if word_start is None:
        return [positions[i:i + 1] for i in range(len(positions))]
    # A new word starts at a word-start piece, or where the maskable run is broken by [SEP]
    # (each run's first piece: after [CLS] or [SEP], a word starts whatever the piece is).
    pieces = tokens[positions]
    starts = word_start(pieces) if isinstance(word_start, WordStarts) else word_start[pieces]
    starts[1:] |= np.diff(positions) != 1
    starts[0] = True
    return np.split(positions, np.flatnonzero(starts)[1:])


def mask_tokens(tokens: np.ndarray, maskable: np.ndarray, rng: np.random.Generator, *, mask_prob: float,
                max_predictions: int, mask_id: int, random_ids: np.ndarray,
                word_start: Optional[WordStartRule] = None) -> tuple[np.ndarray, np.ndarray]:
    """Returns (corrupted tokens, labels); labels hold the original id at chosen positions and
    IGNORE_INDEX elsewhere. `maskable` is False at [CLS], [SEP] and padding."""
    positions = np.flatnonzero(maskable)
    labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
    out = tokens.copy()
    if len(positions) == 0:
        return out, labels
    budget = min(max_predictions, max(1, int(round(len(positions) * mask_prob))))
    if word_start is None:
        chosen = np.sort(rng.permutation(positions)[:budget])
    else:
        units = _words(positions, tokens, word_start)
        picked, count = [], 0
        # Visit words in random order; a word that would overshoot the budget is passed over so
        # a shorter one later can still fill it (as Google's create_pretraining_data.py does).
        order = rng.permutation(len(units))
        for u in order:
            if count + len(units[u]) <= budget:
                picked.append(units[u])
                count += len(units[u])
                if count == budget:
                    break
        if not picked:  # every word is longer than a short sample's budget: still predict something
            picked = [units[order[0]][:budget]]
        chosen = np.sort(np.concatenate(picked))
    labels[chosen] = tokens[chosen]
    draw = rng.random(len(chosen))
    out[chosen[draw < 0.8]] = mask_id
    randomized = chosen[(draw >= 0.8) & (draw < 0.9)]
    out[randomized] = random_ids[rng.integers(0, len(random_ids), len(randomized))]
    return out, labels


class TokenTable:
    """What samples need from a tokenizer, as plain arrays (cheap to send to DataLoader workers):
    the framing ids ([CLS], [SEP], [PAD]) and what mask_tokens takes (the [MASK] id, the ids a
    random replacement draws from, the word starts of whole-word masking)."""

    def __init__(self, tokenizer, whole_word_masking: bool):
        self.cls, self.sep, self.pad, self.mask = tokenizer.cls, tokenizer.sep, tokenizer.pad, tokenizer.mask
        vocab_size = tokenizer.vocab_size
        special = np.zeros(vocab_size, dtype=bool)
        special[[i for i in tokenizer.special_ids if i < vocab_size]] = True
        # Random replacements are real tokens: never [PAD], [CLS], [SEP], [MASK] or [UNK].
        present = np.zeros(vocab_size, dtype=bool)
        present[list(tokenizer.inv_vocab)] = True
        self.random_ids = np.flatnonzero(present & ~special)
        self.word_start = tokenizer.word_starts() if whole_word_masking else None


@dataclass(frozen=True)
class MaskRates:
    """The masking rate of each training sample: `base` (--mask-prob) until the first of
    `points` ((iteration, rate) pairs, --mask-prob-schedule), then each rate from sample
    iteration x `samples_per_iteration` (--global-batch-size) on. Unpacked, that is exactly
    the step: the samples of iteration ITER + 1 are ITER x global batch onwards."""
    base: float
    points: tuple[tuple[int, float], ...] = ()
    samples_per_iteration: int = 1

    @classmethod
    def of(cls, data: DataConfig, global_batch: int) -> "MaskRates":
        return cls(data.mask_prob, mask_prob_points(data.mask_prob_schedule), global_batch)

    def for_sample(self, index: int) -> float:
        rate = self.base
        for iteration, p in self.points:
            if index < iteration * self.samples_per_iteration:
                break
            rate = p
        return rate


class ScheduledMasking:
    """A training dataset whose sample i is masked at `rates.for_sample(i)`: the dataset's
    `masked_sample(i, rate)` (BertDataset, BlendedDataset, NvidiaShardDataset) does the rest."""

    def __init__(self, dataset, rates: MaskRates):
        self.dataset, self.rates = dataset, rates

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        return self.dataset.masked_sample(int(idx), self.rates.for_sample(int(idx)))

    def sample_error(self, idx: int, error: Exception):
        return self.dataset.sample_error(idx, error)
