"""A BERT bi-encoder: one encoder for queries and passages, its token vectors pooled into
one embedding per text (mean over the text's tokens, or the [CLS] vector) and, by default,
L2-normalised: what sentence-transformers' Transformer -> Pooling (-> Normalize) modules
compute from the same weights.

Batches hold T texts per example, input_ids [b, T, s] (the embedding task's T = the query,
its positive and its hard-negative slots); the encoder runs on the [b*T, s] texts at once
and the output keeps the [b, T, h] grouping. A [b, s] batch is T = 1. Pipeline stages
exchange [s, b*T, h]: `texts_per_example` sets T for the stages' fixed shapes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megabert.config import ModelConfig
from megabert.model.bert import BertPreTrainedModel
from megabert.model.outputs import ModelOutput
from megabert.parallel import ParallelState

TEXT_FIELDS = ("input_ids", "token_type_ids", "attention_mask")


class EmbeddingOutput(ModelOutput):
    """embeddings [b, T, h] (float32, or the model's float64); text_mask [b, T] (bool: the slot holds a text) or None."""

    def __init__(self, *, embeddings, text_mask=None):
        super().__init__(embeddings=embeddings, text_mask=text_mask)


@dataclass(frozen=True)
class EmbeddingOptions:
    pooling: str = "mean"  # "mean" or "cls"
    normalize: bool = True
    texts_per_example: int = 1


class BertForSentenceEmbedding(BertPreTrainedModel):
    """BERT -> pooled, optionally normalised text embeddings. No parameters beyond the
    encoder's, so any BERT checkpoint loads into it as it stands."""

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        super().__init__(config, parallel_state, add_pooler=False, output_embeddings=False, **kwargs)
        # Options without parameters, set after loading (from_pretrained builds the class
        # from the checkpoint's config alone): see megabert.tasks.embeddings.finetuning.
        self.options = EmbeddingOptions()
        # The gradient cache's dropout replay (megabert.tasks.embeddings.grad_cache), while a step runs one.
        self.dropout_replay = None

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                text_mask: Optional[torch.Tensor] = None) -> EmbeddingOutput:
        return self._whole_model_forward(dict(input_ids=input_ids, token_type_ids=token_type_ids,
                                              attention_mask=attention_mask, text_mask=text_mask))

    def activation_shape(self, seq_length: int, micro_batch_size: int) -> tuple[int, int, int]:
        return super().activation_shape(seq_length, micro_batch_size * self.options.texts_per_example)

    def forward_chunk(self, v: int, hidden: Optional[torch.Tensor], batch: dict):
        if self.dropout_replay is not None:
            self.dropout_replay.before_forward(v)
        return super().forward_chunk(v, hidden, flatten_texts(batch))

    def head_positions(self, batch: dict) -> Optional[torch.Tensor]:
        if self.options.pooling != "cls":
            return None
        ids = batch["input_ids"]
        positions = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        positions[:, 0] = True  # [CLS] alone: the unpadded encoder's last layer computes only it
        return positions

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> EmbeddingOutput:
        # [s, b*T, h] -> [b*T, s, h], in fp32 at least (bf16 / fp16 runs), fp64 kept.
        x = sequence.transpose(0, 1).to(torch.promote_types(sequence.dtype, torch.float32))
        if self.options.pooling == "cls":
            e = x[:, 0]
        else:
            am = batch.get("attention_mask")
            m = (am if am is not None else torch.ones(x.shape[:2], device=x.device)).unsqueeze(-1).to(x.dtype)
            # sentence-transformers' Pooling: sum over tokens / number of tokens (clamped at 1e-9).
            e = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        if self.options.normalize:
            e = F.normalize(e, p=2, dim=-1)  # sentence-transformers' Normalize
        b, t = batch["texts"]
        return EmbeddingOutput(embeddings=e.view(b, t, -1), text_mask=batch.get("text_mask"))


class ModernBertForSentenceEmbedding(BertForSentenceEmbedding):
    """BertForSentenceEmbedding under the class name ModernBERT bi-encoder checkpoints record
    (every family's encoder is one class; the spec says what it is)."""


def flatten_texts(batch: dict) -> dict:
    """[b, T, s] text fields -> [b*T, s]; `texts` = (b, T) for the head. A batch already
    flattened (a stage's second chunk) or of [b, s] texts passes with T = 1."""
    if "texts" in batch:
        return batch
    ids = batch["input_ids"]
    if ids is None or ids.dim() == 2:
        b = ids.size(0) if ids is not None else batch["text_mask"].size(0)
        return {**batch, "texts": (b, 1)}
    b, t, s = ids.shape
    flat = {k: batch[k].reshape(b * t, s) for k in TEXT_FIELDS if batch.get(k) is not None}
    return {**batch, **flat, "texts": (b, t)}
