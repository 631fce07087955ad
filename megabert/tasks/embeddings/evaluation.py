"""Scoring the bi-encoder on a BEIR dir: queries and passages embedded as in training (the
run's TextFormat: prompts and lengths), the retrieval metrics of their similarities, and
with Matryoshka the same metrics for every embedding size (`ndcg_at_10@256`: the embeddings
cut to their first 256 components, re-normalised when the model normalises)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from megabert.tasks.embeddings.data import BeirSet
from megabert.tasks.embeddings.features import TextFormat, group_texts
from megabert.tasks.embeddings.metrics import per_query_metrics
from megabert.training.finetune import Predictor


def encode(features: dict, predictor: Predictor) -> np.ndarray:
    """[n, h] float32 embeddings of [n, s] text features, as the model (in eval mode) computes
    them, on every rank. Texts travel T to a row, the model's fixed texts per example."""
    n = features["input_ids"].size(0)
    if not n:
        return np.zeros((0, predictor.model.config.hidden_size), np.float32)
    t = predictor.model.options.texts_per_example
    out = predictor.outputs(group_texts(features, t), lambda o: (o.embeddings,))[0]  # [rows, T, h]
    return out.reshape(-1, out.shape[-1])[:n]


def score(queries: np.ndarray, passages: np.ndarray, beir: BeirSet, block: int = 256) -> dict[str, float]:
    """The retrieval metrics of the embeddings: similarities are the dot products of the
    (normalised, by default) embeddings, taken a block of queries at a time (a [block,
    passages] matrix in memory, not [queries, passages])."""
    per_query: dict[str, list[float]] = {}
    for i in range(0, len(queries), block):
        scores = queries[i:i + block].astype(np.float32) @ passages.astype(np.float32).T
        for k, v in per_query_metrics(scores, beir.query_ids[i:i + block], beir.corpus_ids, beir.qrels).items():
            per_query.setdefault(k, []).extend(v)
    return {k: float(np.mean(v)) for k, v in per_query.items()}


def cut(x: np.ndarray, dim: int, normalize: bool) -> np.ndarray:
    """The first `dim` components of each embedding, re-normalised when `normalize`."""
    x = x[:, :dim].astype(np.float32)
    if not normalize:
        return x
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


class BeirEvaluator:
    """eval_results.json's figures for the model as it stands (collective: every rank embeds
    its share of the texts)."""

    def __init__(self, beir: BeirSet, fmt: TextFormat, tokenizer, dims: Optional[tuple[int, ...]] = None):
        self.beir, self.dims = beir, dims
        # Tokenised once: every evaluation during training embeds the same features.
        self.queries = fmt.queries(beir.queries, tokenizer)
        self.passages = fmt.documents(beir.passages, tokenizer)

    def evaluate(self, predictor: Predictor) -> dict[str, float]:
        queries, passages = encode(self.queries, predictor), encode(self.passages, predictor)
        results = score(queries, passages, self.beir)
        normalize = predictor.model.options.normalize
        for d in self.dims or ():
            for k, v in score(cut(queries, d, normalize), cut(passages, d, normalize), self.beir).items():
                results[f"{k}@{d}"] = v
        return results
