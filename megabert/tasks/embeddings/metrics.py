"""Retrieval scores as MTEB reports them (names `ndcg_at_10`, `mrr_at_10`, `recall_at_10`,
`recall_at_100`; fractions 0-1, means over the judged queries), in numpy alone.

nDCG@k and recall@k are trec_eval's (what MTEB and BEIR take from pytrec_eval):
- the ranking is by score, ties broken by document id, the larger first (trec_eval's order);
- nDCG@k: gains are the qrels scores as they are (linear), discounted by log2(rank + 1); the
  ideal ranking sorts every judged score of the query; 0 when the query has no relevant doc;
- recall@k: relevant docs (score >= 1) in the top k over all the query's relevant docs.
MRR@k is MTEB's: 1 / rank of the first relevant doc (score > 0) within the top k, else 0.
A document whose id equals the query's id is never retrieved for it (BEIR's and MTEB's
ignore_identical_ids, for sets such as ArguAna and Quora whose queries are also documents).
"""
from __future__ import annotations

import numpy as np

K_VALUES = (10, 100)


def ranking(scores: np.ndarray, doc_ids: list[str], k: int) -> list[int]:
    """Indices of the top k of `scores` in trec_eval's order: score descending, then doc id
    descending (its tie-break)."""
    order = sorted(range(len(doc_ids)), key=lambda i: (-float(scores[i]), _Desc(doc_ids[i])))
    return order[:k]


class _Desc:
    """Reverses string order inside a sort key."""

    def __init__(self, s: str):
        self.s = s

    def __lt__(self, other: "_Desc") -> bool:
        return self.s > other.s

    def __eq__(self, other) -> bool:
        return self.s == other.s


def ndcg_at(ranked: list[str], judged: dict[str, int], k: int) -> float:
    dcg = sum(judged.get(d, 0) / np.log2(i + 2) for i, d in enumerate(ranked[:k]) if judged.get(d, 0) > 0)
    ideal_gains = sorted((g for g in judged.values() if g > 0), reverse=True)[:k]
    ideal = sum(g / np.log2(i + 2) for i, g in enumerate(ideal_gains))
    return float(dcg / ideal) if ideal > 0 else 0.0


def recall_at(ranked: list[str], judged: dict[str, int], k: int) -> float:
    relevant = {d for d, g in judged.items() if g >= 1}
    return len(relevant.intersection(ranked[:k])) / len(relevant) if relevant else 0.0


def mrr_at(ranked: list[str], judged: dict[str, int], k: int) -> float:
    for i, d in enumerate(ranked[:k]):
        if judged.get(d, 0) > 0:
            return 1.0 / (i + 1)
    return 0.0


def retrieval_metrics(scores: np.ndarray, query_ids: list[str], doc_ids: list[str],
                      qrels: dict[str, dict[str, int]]) -> dict[str, float]:
    """scores [queries, docs] (similarities, larger = closer) -> {ndcg_at_10, mrr_at_10,
    recall_at_10, recall_at_100}, each the mean over `query_ids`."""
    per_query = per_query_metrics(scores, query_ids, doc_ids, qrels)
    return {k: float(np.mean(v)) if v else 0.0 for k, v in per_query.items()}


def per_query_metrics(scores: np.ndarray, query_ids: list[str], doc_ids: list[str],
                      qrels: dict[str, dict[str, int]]) -> dict[str, list[float]]:
    """As retrieval_metrics, each metric's value per query (in order), so a large dev set can
    be scored one block of queries at a time."""
    depth = max(K_VALUES)
    per_query: dict[str, list[float]] = {"ndcg_at_10": [], "mrr_at_10": [], "recall_at_10": [], "recall_at_100": []}
    doc_index = {d: i for i, d in enumerate(doc_ids)}
    for q, qid in enumerate(query_ids):
        row = np.asarray(scores[q], dtype=np.float64).copy()
        if qid in doc_index:
            row[doc_index[qid]] = -np.inf  # ignore_identical_ids
        # The top `depth` by score first (cheap), then trec_eval's order among them and any tie at the cut.
        if len(row) > depth:
            cut = np.partition(row, len(row) - depth)[len(row) - depth]
            candidates = np.flatnonzero(row >= cut)
        else:
            candidates = np.arange(len(row))
        candidates = [i for i in candidates if np.isfinite(row[i])]
        top = ranking(row[candidates], [doc_ids[i] for i in candidates], depth)
        ranked = [doc_ids[candidates[i]] for i in top]
        judged = qrels.get(qid, {})
        per_query["ndcg_at_10"].append(ndcg_at(ranked, judged, 10))
        per_query["mrr_at_10"].append(mrr_at(ranked, judged, 10))
        per_query["recall_at_10"].append(recall_at(ranked, judged, 10))
        per_query["recall_at_100"].append(recall_at(ranked, judged, 100))
    return per_query
