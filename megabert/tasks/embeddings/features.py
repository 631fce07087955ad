"""Texts -> fixed-length features: [CLS] text [SEP] [PAD]..., token types 0, cut as
BertTokenizer(truncation=True) cuts a single text (what the exported sentence-transformers
model does with its max_seq_length).

Queries and documents (positives, hard negatives, corpus passages) are formatted by one
TextFormat in training, evaluation and mining alike: each kind gets its prompt put before
the text (E5's "query: " / "passage: "; sentence-transformers' `encode(prompt_name=...)`
prepends the same string, and its pooling includes the prompt's tokens) and is cut at its
own length; every feature is padded to the run's --max-seq-length, so pipeline stages keep
one activation shape.

Training examples are T = 2 + K texts: query, positive and K hard-negative slots, K the
most negatives any pair has; `text_mask` marks the slots that hold a text (rows with fewer
negatives leave theirs empty: the loss never scores them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megabert.tasks.embeddings.data import Pair


@dataclass(frozen=True)
class TextFormat:
    """How a query and a document become tokens: prompt + text, cut at the kind's length,
    padded to `width` (the run's --max-seq-length)."""

    width: int
    query_length: Optional[int] = None  # default: width
    document_length: Optional[int] = None
    query_prompt: str = ""
    document_prompt: str = ""

    @classmethod
    def of(cls, config) -> "TextFormat":
        """From an EmbeddingsConfig's flags."""
        return cls(config.max_seq_length, config.query_length, config.document_length, config.query_prompt,
                   config.document_prompt)

    def queries(self, texts: Sequence[str], tokenizer) -> dict[str, torch.Tensor]:
        return texts_to_tensors([self.query_prompt + t for t in texts], tokenizer, self.query_length or self.width,
                                self.width)

    def documents(self, texts: Sequence[str], tokenizer) -> dict[str, torch.Tensor]:
        return texts_to_tensors([self.document_prompt + t for t in texts], tokenizer,
                                self.document_length or self.width, self.width)


def texts_to_tensors(texts: Sequence[str], tokenizer, max_seq_length: int, width: Optional[int] = None
                     ) -> dict[str, torch.Tensor]:
    """input_ids, token_type_ids, attention_mask [n, width (default max_seq_length)], each text
    cut at max_seq_length tokens."""
    n, width = len(texts), width or max_seq_length
    input_ids = torch.full((n, width), tokenizer.pad, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    for i, ids in enumerate(tokenizer.tokenize_batch(list(texts))):
        ids = [tokenizer.cls, *ids[:max_seq_length - 2], tokenizer.sep]
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
    return {"input_ids": input_ids, "token_type_ids": torch.zeros_like(input_ids), "attention_mask": attention_mask}


def texts_per_pair(pairs: Sequence[Pair]) -> int:
    return 2 + max(len(p.negatives) for p in pairs)


def pairs_to_tensors(pairs: Sequence[Pair], tokenizer, fmt: TextFormat) -> dict[str, torch.Tensor]:
    """input_ids, token_type_ids, attention_mask [n, T, width], text_mask [n, T] bool."""
    t = texts_per_pair(pairs)
    documents, present = [], []
    for p in pairs:
        slots = [p.positive, *p.negatives]
        documents += slots + [""] * (t - 1 - len(slots))
        present += [True] * (1 + len(slots)) + [False] * (t - 1 - len(slots))
    queries = fmt.queries([p.query for p in pairs], tokenizer)
    docs = fmt.documents(documents, tokenizer)
    n, s = len(pairs), fmt.width
    out = {k: torch.cat([queries[k].view(n, 1, s), docs[k].view(n, t - 1, s)], dim=1) for k in queries}
    out["text_mask"] = torch.tensor(present).view(n, t)
    return out


def group_texts(tensors: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    """[n, s] texts -> [ceil(n / t), t, s] rows of the model's T texts (the last row padded
    with copies of the first text; drop the extra embeddings after)."""
    n = tensors["input_ids"].size(0)
    pad = (-n) % t
    return {k: torch.cat([v, v[:1].expand(pad, *v.shape[1:])]).view(-1, t, v.size(-1)) for k, v in tensors.items()}
