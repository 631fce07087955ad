"""Texts -> fixed-length features: [CLS] text [SEP] [PAD]..., token types 0, cut to
max_seq_length as BertTokenizer(truncation=True) cuts a single text (what the exported
sentence-transformers model does with its max_seq_length).

Training examples are T = 2 + K texts: query, positive and K hard-negative slots, K the
most negatives any pair has; `text_mask` marks the slots that hold a text (rows with fewer
negatives leave theirs empty: the loss never scores them)."""
from __future__ import annotations

from typing import Sequence

import torch

from megabert.tasks.embeddings.data import Pair


def texts_to_tensors(texts: Sequence[str], tokenizer, max_seq_length: int) -> dict[str, torch.Tensor]:
    """input_ids, token_type_ids, attention_mask [n, max_seq_length]."""
    n = len(texts)
    input_ids = torch.full((n, max_seq_length), tokenizer.pad, dtype=torch.long)
    attention_mask = torch.zeros((n, max_seq_length), dtype=torch.long)
    for i, ids in enumerate(tokenizer.tokenize_batch(list(texts))):
        ids = [tokenizer.cls, *ids[:max_seq_length - 2], tokenizer.sep]
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
    return {"input_ids": input_ids, "token_type_ids": torch.zeros_like(input_ids), "attention_mask": attention_mask}


def texts_per_pair(pairs: Sequence[Pair]) -> int:
    return 2 + max(len(p.negatives) for p in pairs)


def pairs_to_tensors(pairs: Sequence[Pair], tokenizer, max_seq_length: int) -> dict[str, torch.Tensor]:
    """input_ids, token_type_ids, attention_mask [n, T, max_seq_length], text_mask [n, T] bool."""
    t = texts_per_pair(pairs)
    texts, present = [], []
    for p in pairs:
        slots = [p.query, p.positive, *p.negatives]
        texts += slots + [""] * (t - len(slots))
        present += [True] * len(slots) + [False] * (t - len(slots))
    flat = texts_to_tensors(texts, tokenizer, max_seq_length)
    out = {k: v.view(len(pairs), t, max_seq_length) for k, v in flat.items()}
    out["text_mask"] = torch.tensor(present).view(len(pairs), t)
    return out


def group_texts(tensors: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    """[n, s] texts -> [ceil(n / t), t, s] rows of the model's T texts (the last row padded
    with copies of the first text; drop the extra embeddings after)."""
    n = tensors["input_ids"].size(0)
    pad = (-n) % t
    return {k: torch.cat([v, v[:1].expand(pad, *v.shape[1:])]).view(-1, t, v.size(-1)) for k, v in tensors.items()}
