"""SQuAD examples -> fixed-length features, as Hugging Face's run_qa.py (and Google's run_squad):

    [CLS] question [SEP] context window [SEP] [PAD] ...
    token_type_ids  0 ... 0 for [CLS] q [SEP], 1 for the window and its [SEP], 0 on padding

The question is cut to `max_query_length` tokens. A context longer than what is left
is split into windows that overlap by `doc_stride` tokens (transformers' `stride` with
`return_overflowing_tokens`; Google's run_squad counts its doc_stride from window start
to window start instead). Answer character spans map to tokens through the tokenizer's
offsets; a window that does not hold the whole answer, and an unanswerable question,
point both positions at [CLS] (index 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megabert.tasks.squad.examples import SquadExample
from megabert.errors import ConfigError


@dataclass
class SquadFeature:
    example_index: int
    input_ids: list[int]
    token_type_ids: list[int]
    attention_mask: list[int]
    # Per position: the (start, end) characters in the example's context, None outside the
    # context window (question, special tokens, padding): only context spans can be answers.
    offsets: list[Optional[tuple[int, int]]]
    start_position: int = 0
    end_position: int = 0


def window_starts(num_tokens: int, window: int, doc_stride: int) -> list[int]:
    """Starts of the context windows: steps of `window - doc_stride`, stopping at the first
    window that reaches the end (the `tokenizers` library's overflow rule)."""
    if doc_stride >= window:
        raise ConfigError(f"--doc-stride {doc_stride} must be smaller than the {window} context tokens a "
                          f"window holds; lower --doc-stride or --max-query-length, or raise --max-seq-length")
    starts = [0]
    while starts[-1] + window < num_tokens:
        starts.append(starts[-1] + window - doc_stride)
    return starts


def convert_example(example: SquadExample, example_index: int, tokenizer, *, max_seq_length: int, doc_stride: int,
                    max_query_length: int, is_training: bool) -> list[SquadFeature]:
    """One example -> one feature per context window."""
    query_ids = tokenizer.encode_with_offsets(example.question)[0][:max_query_length]
    context_ids, context_offsets = tokenizer.encode_with_offsets(example.context)
    window = max_seq_length - len(query_ids) - 3  # [CLS], [SEP], [SEP]
    cls, sep, pad = tokenizer.cls, tokenizer.sep, tokenizer.pad
    span = example.answer_span if is_training else None
    features = []
    for start in window_starts(len(context_ids), window, doc_stride):
        stop = min(start + window, len(context_ids))
        first = len(query_ids) + 2  # position of the window's first token
        ids = [cls, *query_ids, sep, *context_ids[start:stop], sep]
        types = [0] * first + [1] * (stop - start + 1)
        offsets = [None] * first + list(map(tuple, context_offsets[start:stop])) + [None]
        n_pad = max_seq_length - len(ids)
        feature = SquadFeature(example_index, ids + [pad] * n_pad, types + [0] * n_pad,
                               [1] * len(ids) + [0] * n_pad, offsets + [None] * n_pad)
        if span is not None and stop > start:
            tok_start, tok_end = answer_tokens(context_offsets, start, stop, *span)
            if tok_start is not None:
                feature.start_position, feature.end_position = first + tok_start - start, first + tok_end - start
        features.append(feature)
    return features


def answer_tokens(offsets: Sequence[tuple[int, int]], start: int, stop: int, char_start: int, char_end: int
                  ) -> tuple[Optional[int], Optional[int]]:
    """Context token indices [tok_start, tok_end] covering characters [char_start, char_end)
    when tokens start..stop-1 hold all of them, else (None, None)."""
    if not (offsets[start][0] <= char_start and offsets[stop - 1][1] >= char_end):
        return None, None
    tok_start = start
    while tok_start + 1 < stop and offsets[tok_start + 1][0] <= char_start:
        tok_start += 1
    tok_end = stop - 1
    while tok_end - 1 >= tok_start and offsets[tok_end - 1][1] >= char_end:
        tok_end -= 1
    return tok_start, tok_end


def convert_examples_to_features(examples: Sequence[SquadExample], tokenizer, *, max_seq_length: int,
                                 doc_stride: int, max_query_length: int, is_training: bool) -> list[SquadFeature]:
    if not hasattr(tokenizer, "encode_with_offsets"):
        raise ConfigError(f"SQuAD needs a tokenizer with character offsets (BertWordPieceLowerCase, "
                          f"BertWordPieceCase or HuggingFaceTokenizer), not {tokenizer.name}")
    features = []
    for i, example in enumerate(examples):
        features += convert_example(example, i, tokenizer, max_seq_length=max_seq_length, doc_stride=doc_stride,
                                    max_query_length=max_query_length, is_training=is_training)
    return features


def features_to_tensors(features: Sequence[SquadFeature]) -> dict[str, torch.Tensor]:
    """The model's inputs (and the training targets) stacked: each [n_features, max_seq_length] or [n]."""
    return {
        "input_ids": torch.tensor([f.input_ids for f in features], dtype=torch.long),
        "token_type_ids": torch.tensor([f.token_type_ids for f in features], dtype=torch.long),
        "attention_mask": torch.tensor([f.attention_mask for f in features], dtype=torch.long),
        "start_positions": torch.tensor([f.start_position for f in features], dtype=torch.long),
        "end_positions": torch.tensor([f.end_position for f in features], dtype=torch.long),
    }
