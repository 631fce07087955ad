"""Tagged sentences -> fixed-length features, as run_ner.py builds them, plus windows:

    [CLS] w1 w2a ##w2b w3 ... [SEP] [PAD] ...
    labels  -100 at [CLS], [SEP], padding and (unless --label-all-tokens) every sub-word but
            a word's first

Each word is tokenized on its own (run_ner.py's is_split_into_words), after a space so that
byte-level and SentencePiece tokenizers see a word start as in running text (WordPiece
ignores it). A word that tokenizes to nothing (a lone control character) becomes [UNK]:
no word is dropped.

A sentence longer than max_seq_length - 2 sub-words is cut into windows of that length, each
sharing `overlap` sub-words with the one before (transformers' stride), the last one ending
at the sentence's end. Every sub-word lies in some window, so every word's first sub-word
does, most in several.

A model's tag for a word moves with where the word sits in its window (a model fine-tuned
mostly on short sentences keys on the absolute position: issue 52 measured short sentences
moved on by 2 positions falling from F1 96 to 63), so one window's reading is a noisy one.
Prediction therefore averages a word's tag probabilities over every window that holds it
(`predict_windows="mean"`); "max-context" reads it in the window where it sits most central
alone (the most context on its shorter side; ties to the longer, then the earlier window:
the rule of Google's run_squad.py _check_is_max_context). Training labels a word in every
window that holds it, each label weighted by one over the number of those windows
(`train_windows="weighted"`): the model learns each word at every place prediction reads
it, and the word still counts once in the loss, as a word of a short sentence does. The
other ways: "owned" labels each word in its most-central window alone; "all" in every
window at full weight (the overlaps count several times, which pulled the loss towards long
sentences); "first" keeps a sentence's first window alone, as run_ner.py's truncation
trains (the words past it are still predicted).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megabert.tasks.ner.data import Sentence
from megabert.tasks.ner.model import IGNORE_INDEX


TRAIN_WINDOWS = ("weighted", "owned", "all", "first")
"""Where training labels a word of a sentence longer than one window (--train-windows)."""

PREDICT_WINDOWS = ("mean", "max-context")
"""Which windows a word of a sentence longer than one window is predicted from (--predict-windows)."""


@dataclass(frozen=True)
class Window:
    """One feature: sentence `sentence`'s sub-words [start, start + length); `held`, the
    (position in the feature, word index) of the words whose first sub-word it holds, and
    `owned`, those of them that sit most central here."""

    sentence: int
    start: int
    length: int
    owned: tuple[tuple[int, int], ...]
    held: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Features:
    tensors: dict[str, torch.Tensor]  # input_ids, token_type_ids, attention_mask, labels [n, max_seq_length]
    windows: list[Window]


def default_overlap(length: int) -> int:
    """Sub-words a window shares with the one before by default: three quarters of it, so that
    a word of a long sentence is read in about four windows (their mean predicts it)."""
    return 3 * length // 4


def window_starts(num_tokens: int, length: int, overlap: int) -> list[int]:
    """Where the windows of a sentence of `num_tokens` sub-words start: 0, length - overlap,
    ... and a last one ending at the sentence's end."""
    if num_tokens <= length:
        return [0]
    starts = list(range(0, num_tokens - length + 1, length - overlap))
    if starts[-1] + length < num_tokens:
        starts.append(num_tokens - length)
    return starts


def best_window(position: int, starts: Sequence[int], lengths: Sequence[int]) -> int:
    """The window (index into starts) where sub-word `position` has the most context."""
    best, best_score = -1, None
    for k, (s, n) in enumerate(zip(starts, lengths)):
        if not s <= position < s + n:
            continue
        score = min(position - s, s + n - 1 - position) + 0.01 * n
        if best_score is None or score > best_score:
            best, best_score = k, score
    return best


def word_pieces(sentences: Sequence[Sentence], tokenizer) -> list[list[list[int]]]:
    """Each sentence's words as lists of sub-word ids (never empty)."""
    flat = tokenizer.tokenize_batch([" " + w for s in sentences for w in s.words])
    out, k = [], 0
    for s in sentences:
        out.append([ids or [tokenizer.unk] for ids in flat[k:k + len(s.words)]])
        k += len(s.words)
    return out


def continuation_labels(labels: Sequence[str]) -> list[int]:
    """run_ner.py's b_to_i_label for --label-all-tokens: a word's later sub-words take its
    tag, B-X as I-X where the label set has I-X."""
    index = {t: i for i, t in enumerate(labels)}
    return [index.get("I-" + t[2:], i) if t.startswith("B-") else i for i, t in enumerate(labels)]


def sentences_to_features(sentences: Sequence[Sentence], tokenizer, max_seq_length: int, *,
                          label2id: Optional[dict[str, int]] = None, overlap: Optional[int] = None,
                          label_all_tokens: bool = False, drop_unlabelled: bool = False,
                          train_windows: Optional[str] = None) -> Features:
    """Features of every window of every sentence. `label2id`: label the words (sentences
    with tags; a tag outside it is left unlabelled); `overlap`: sub-words each window shares
    with the one before (default: default_overlap); `drop_unlabelled`: leave out windows with
    no label (training: a window inside one very long word teaches nothing); `train_windows`:
    where a word is labelled, None or "all" in every window it starts in, "weighted" there too with
    the `label_windows` tensor (how many windows hold each labelled sub-word, 0 elsewhere),
    "owned" in its most central window, "first" in the first window only (see the module's
    docstring)."""
    if train_windows not in (None, *TRAIN_WINDOWS):
        raise ValueError(f"train_windows must be one of {', '.join(TRAIN_WINDOWS)}, got {train_windows!r}")
    length = max_seq_length - 2
    overlap = default_overlap(length) if overlap is None else overlap
    to_inner = continuation_labels(sorted(label2id, key=label2id.get)) if label2id else None
    rows, windows, covers = [], [], []
    for i, (sentence, pieces) in enumerate(zip(sentences, word_pieces(sentences, tokenizer))):
        ids = [t for p in pieces for t in p]
        firsts, offset = [], 0  # each word's first sub-word
        for p in pieces:
            firsts.append(offset)
            offset += len(p)
        token_labels = [IGNORE_INDEX] * len(ids)
        if label2id is not None and sentence.tags is not None:
            for w, (p, tag) in enumerate(zip(pieces, sentence.tags)):
                label = label2id.get(tag, IGNORE_INDEX)
                token_labels[firsts[w]] = label
                if label_all_tokens and label != IGNORE_INDEX:
                    for k in range(1, len(p)):
                        token_labels[firsts[w] + k] = to_inner[label]
        starts = window_starts(len(ids), length, overlap)
        lengths = [min(length, len(ids) - s) for s in starts]
        owner = [best_window(f, starts, lengths) for f in firsts]
        edges = [0] * (len(ids) + 1)  # how many windows hold each sub-word: +1 where one starts, -1 past its end
        for s, n in zip(starts, lengths):
            edges[s] += 1
            edges[s + n] -= 1
        cover = list(itertools.accumulate(edges[:-1]))
        for k, (s, n) in enumerate(zip(starts, lengths)):
            if train_windows == "first" and k > 0:
                break
            owned = tuple((firsts[w] - s + 1, w) for w in range(len(firsts)) if owner[w] == k)  # +1: [CLS]
            labels = [IGNORE_INDEX, *token_labels[s:s + n], IGNORE_INDEX]
            if train_windows == "owned":
                # The sub-words of the words this window owns (a word's later sub-words follow
                # its first, up to the next word's first).
                mine = [False] * (n + 2)
                for position, word in owned:
                    stop = firsts[word + 1] - s + 1 if word + 1 < len(firsts) else n + 1
                    mine[position:min(stop, n + 1)] = [True] * (min(stop, n + 1) - position)
                labels = [x if keep else IGNORE_INDEX for x, keep in zip(labels, mine)]
            if drop_unlabelled and all(x == IGNORE_INDEX for x in labels):
                continue
            rows.append(([tokenizer.cls, *ids[s:s + n], tokenizer.sep], labels))
            held = tuple((firsts[w] - s + 1, w) for w in range(len(firsts)) if s <= firsts[w] < s + n)
            covers.append([0, *cover[s:s + n], 0])
            windows.append(Window(i, s, n, owned, held))
    n = len(rows)
    tensors = {"input_ids": torch.full((n, max_seq_length), tokenizer.pad, dtype=torch.long),
               "token_type_ids": torch.zeros((n, max_seq_length), dtype=torch.long),
               "attention_mask": torch.zeros((n, max_seq_length), dtype=torch.long),
               "labels": torch.full((n, max_seq_length), IGNORE_INDEX, dtype=torch.long)}
    for r, (ids, labels) in enumerate(rows):
        tensors["input_ids"][r, :len(ids)] = torch.tensor(ids)
        tensors["attention_mask"][r, :len(ids)] = 1
        tensors["labels"][r, :len(labels)] = torch.tensor(labels)
    if train_windows == "weighted":
        tensors["label_windows"] = torch.zeros((n, max_seq_length), dtype=torch.long)
        for r, cover in enumerate(covers):
            tensors["label_windows"][r, :len(cover)] = torch.tensor(cover)
        tensors["label_windows"][tensors["labels"] == IGNORE_INDEX] = 0
    return Features(tensors, windows)


def word_logits(features: Features, logits: np.ndarray, num_words: Sequence[int],
                predict_windows: str = "mean") -> list[np.ndarray]:
    """Each sentence's [words, num_labels] scores from the features' logits ([features,
    max_seq_length, num_labels]), every word's read at its first sub-word: "mean", the log of
    its tag probabilities averaged over every window that holds it (a word of one window:
    its log-softmax); "max-context", its logits in the window that owns it."""
    if predict_windows not in PREDICT_WINDOWS:
        raise ValueError(f"predict_windows must be one of {', '.join(PREDICT_WINDOWS)}, got {predict_windows!r}")
    if predict_windows == "max-context":
        out = [np.full((n, logits.shape[-1]), np.nan, dtype=logits.dtype) for n in num_words]
        for f, window in enumerate(features.windows):
            for position, word in window.owned:
                out[window.sentence][word] = logits[f, position]
        return out
    probs = [np.zeros((n, logits.shape[-1])) for n in num_words]
    held = [np.zeros((n, 1)) for n in num_words]
    for f, window in enumerate(features.windows):
        if window.held:
            positions, words = (list(x) for x in zip(*window.held))
            x = logits[f, positions].astype(np.float64)
            e = np.exp(x - x.max(axis=-1, keepdims=True))
            probs[window.sentence][words] += e / e.sum(axis=-1, keepdims=True)
            held[window.sentence][words] += 1
    tiny = np.finfo(np.float64).tiny  # a probability that underflowed: a finite loss
    return [np.log(np.maximum(p / np.maximum(k, 1), tiny)).astype(logits.dtype) for p, k in zip(probs, held)]
