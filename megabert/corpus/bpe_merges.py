"""Byte-pair merges learnt from word counts, the same on every run (issue 51).

The `tokenizers` trainers (BpeTrainer, WordPieceTrainer) pick the most frequent pair and
break ties by token id, and some ids (the "##" continuation pieces) are handed out in the
order of a Rust hash map, which changes from process to process: two runs on one corpus
gave vocabs differing in 584 of 8,000 lines. Here every order is fixed: the alphabet by
(count desc, character), continuation pieces by character, and a tie between pairs of equal
count goes to the lexicographically smallest (left, right) pair. The counting itself is a
sum, which no order changes.

The algorithm is the usual incremental one (Sennrich et al. 2016; the `tokenizers` trainer's):
pair counts weighted by word counts, an index from each pair to the words holding it, and a
heap of candidate merges whose stale entries are skipped when popped.
"""
from __future__ import annotations

import heapq
from collections import Counter
from typing import Iterable, Optional


def alphabet_of(word_counts: Counter, limit: Optional[int], forced: Iterable[str] = ()) -> list[str]:
    """The characters words are spelled in: `forced` ones always, then the most frequent up to
    `limit` in all (ties by character), sorted by character."""
    chars: Counter = Counter()
    for word, n in word_counts.items():
        for c in word:
            chars[c] += n
    forced = set(forced)
    ranked = sorted((c for c in chars if c not in forced), key=lambda c: (-chars[c], c))
    if limit is not None:
        ranked = ranked[:max(limit - len(forced), 0)]
    return sorted(forced | set(ranked))


def learn_merges(word_counts: Counter, alphabet: list[str], vocab_size: int, *, specials: list[str],
                 min_frequency: int = 0, prefix: str = "") -> tuple[list[str], list[tuple[str, str]]]:
    """(vocab, merges): `specials`, the alphabet, its continuation pieces (`prefix` + a
    character, for the characters that occur after a word's first, as WordPiece's "##") and
    one token per merge, in that order, until `vocab_size` tokens or no pair occurs
    `min_frequency` times. Characters outside the alphabet are dropped from the words (they
    become the unknown token when tokenizing), as the `tokenizers` trainer does."""
    known = set(alphabet)
    words, counts = [], []
    for word in sorted(word_counts):  # sorted: the word index order, and so every update, fixed
        symbols = [c for c in word if c in known]
        if symbols:
            words.append([symbols[0]] + [prefix + c for c in symbols[1:]])
            counts.append(word_counts[word])
    continuing = sorted({s for w in words for s in w[1:]}) if prefix else []
    vocab = list(specials) + [c for c in alphabet if c not in specials]
    vocab += [s for s in continuing if s not in set(vocab)]
    seen = set(vocab)

    pair_counts: Counter = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for i, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pair_counts[pair] += counts[i]
            where.setdefault(pair, set()).add(i)
    heap = [(-n, pair) for pair, n in pair_counts.items()]
    heapq.heapify(heap)

    merges = []
    while len(vocab) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        n = pair_counts.get(pair, 0)
        if n != -neg:  # stale: the pair's count changed since this entry was pushed
            if n > 0:
                heapq.heappush(heap, (-n, pair))
            continue
        if n < max(min_frequency, 1):
            break
        left, right = pair
        merged = left + right[len(prefix):]
        merges.append(pair)
        if merged not in seen:
            vocab.append(merged)
            seen.add(merged)
        touched = set()
        for i in sorted(where.pop(pair)):
            w, c = words[i], counts[i]
            for p in zip(w, w[1:]):
                pair_counts[p] -= c
                touched.add(p)
            out, k = [], 0
            while k < len(w):
                if k + 1 < len(w) and w[k] == left and w[k + 1] == right:
                    out.append(merged)
                    k += 2
                else:
                    out.append(w[k])
                    k += 1
            words[i] = out
            for p in zip(out, out[1:]):
                pair_counts[p] += c
                touched.add(p)
                where.setdefault(p, set()).add(i)
        for p in sorted(touched):
            if pair_counts[p] > 0 and p != pair:
                heapq.heappush(heap, (-pair_counts[p], p))
            elif pair_counts[p] <= 0:
                pair_counts.pop(p, None)
                where.pop(p, None)
    return vocab, merges
