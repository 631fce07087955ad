"""GLUE examples -> fixed-length features, as transformers' run_glue.py (and Google's
run_classifier.py) build them:

    [CLS] sentence A [SEP] (sentence B [SEP]) [PAD] ...
    token_type_ids  0 for [CLS] A [SEP], 1 for B and its [SEP], 0 on padding

A pair longer than max_seq_length - 3 loses tokens from the end of the longer sentence,
one at a time (the "longest first" truncation; Google's _truncate_seq_pair). Every feature
is padded to max_seq_length (run_glue.py's default --pad_to_max_length): pipeline stages
exchange fixed shapes, and the unpadded encoder spends no GEMM on the padding anyway.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megabert.tasks.glue.data import GlueExample


def truncate_pair(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Drops tokens from the end of the longer of a and b (b on ties) until both fit."""
    a, b = list(a), list(b)
    while len(a) + len(b) > budget:
        if len(a) > len(b):
            a.pop()
        else:
            b.pop()
    return a, b


def examples_to_tensors(examples: Sequence[GlueExample], tokenizer, max_seq_length: int,
                        regression: bool) -> dict[str, torch.Tensor]:
    """input_ids, token_type_ids, attention_mask [n, max_seq_length] and, when the examples
    have labels, labels [n] (class ids, or float scores with `regression`)."""
    texts_a = tokenizer.tokenize_batch([e.text_a for e in examples])
    pairs = [e.text_b is not None for e in examples]
    texts_b = iter(tokenizer.tokenize_batch([e.text_b for e in examples if e.text_b is not None]))
    cls, sep, pad = tokenizer.cls, tokenizer.sep, tokenizer.pad
    n = len(examples)
    input_ids = torch.full((n, max_seq_length), pad, dtype=torch.long)
    token_type_ids = torch.zeros((n, max_seq_length), dtype=torch.long)
    attention_mask = torch.zeros((n, max_seq_length), dtype=torch.long)
    for i, (a, is_pair) in enumerate(zip(texts_a, pairs)):
        if is_pair:
            a, b = truncate_pair(a, next(texts_b), max_seq_length - 3)
            ids, types = [cls, *a, sep, *b, sep], [0] * (len(a) + 2) + [1] * (len(b) + 1)
        else:
            ids = [cls, *a[:max_seq_length - 2], sep]
            types = [0] * len(ids)
        input_ids[i, :len(ids)] = torch.tensor(ids)
        token_type_ids[i, :len(ids)] = torch.tensor(types)
        attention_mask[i, :len(ids)] = 1
    out = {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}
    if examples and examples[0].label is not None:
        out["labels"] = torch.tensor([e.label for e in examples], dtype=torch.float32 if regression else torch.long)
    return out
