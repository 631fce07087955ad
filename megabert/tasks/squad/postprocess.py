"""Start/end logits of every feature -> one answer text per question (Google's run_squad /
Hugging Face's postprocess_qa_predictions).

Per example, over all of its windows: the `n_best_size` highest start and end logits
are paired; a pair is a candidate when both ends lie in the context, end >= start and
the span is at most `max_answer_length` tokens. Its score is start + end logit and its
text is cut from the original context by the tokenizer's character offsets (so case,
accents and spacing are the context's own). For SQuAD v2.0 the null answer scores
start + end logit at [CLS], the lowest over the windows; the best span wins only when
null score - span score <= `null_score_diff_threshold`.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import numpy as np

from megabert.tasks.squad.examples import SquadExample
from megabert.tasks.squad.features import SquadFeature


def _softmax(scores: list[float]) -> list[float]:
    if not scores:
        return []
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def example_candidates(example: SquadExample, features: Sequence[SquadFeature], start_logits: Sequence[np.ndarray],
                       end_logits: Sequence[np.ndarray], *, n_best_size: int, max_answer_length: int
                       ) -> tuple[list[dict], dict | None]:
    """Span candidates of one example, best first and unique by text, and the null answer
    ([CLS] of the window where it scores lowest, as transformers; None without windows)."""
    candidates, null = [], None
    for feature, start, end in zip(features, start_logits, end_logits):
        if null is None or float(start[0] + end[0]) < null["score"]:
            null = {"text": "", "start_logit": float(start[0]), "end_logit": float(end[0]),
                    "score": float(start[0] + end[0])}
        # argsort is ascending: the n_best highest logits, highest first.
        for s in np.argsort(start)[::-1][:n_best_size]:
            for e in np.argsort(end)[::-1][:n_best_size]:
                if feature.offsets[s] is None or feature.offsets[e] is None:
                    continue  # question, special token or padding
                if e < s or e - s + 1 > max_answer_length:
                    continue
                candidates.append({"text": example.context[feature.offsets[s][0]:feature.offsets[e][1]],
                                   "start_logit": float(start[s]), "end_logit": float(end[e]),
                                   "score": float(start[s] + end[e])})
    candidates.sort(key=lambda c: c["score"], reverse=True)
    unique, seen = [], set()
    for c in candidates:  # as Google's run_squad: the same text from another window is no new answer
        if c["text"] not in seen:
            seen.add(c["text"])
            unique.append(c)
        if len(unique) == n_best_size:
            break
    return unique, null


def postprocess_predictions(examples: Sequence[SquadExample], features: Sequence[SquadFeature],
                            start_logits: Sequence[np.ndarray], end_logits: Sequence[np.ndarray], *,
                            n_best_size: int = 20, max_answer_length: int = 30, version_2_with_negative: bool = False,
                            null_score_diff_threshold: float = 0.0) -> tuple[dict, dict, dict]:
    """-> (predictions {id: text}, nbest {id: [{text, probability, start_logit, end_logit}]},
    null_odds {id: null score - best span score}, the last only for v2.0).
    `start_logits[i]`, `end_logits[i]` are feature i's logits, [max_seq_length] each."""
    by_example = defaultdict(list)
    for i, f in enumerate(features):
        by_example[f.example_index].append(i)
    predictions, nbest_json, null_odds = {}, {}, {}
    for ex_index, example in enumerate(examples):
        idx = by_example.get(ex_index, [])
        spans, null = example_candidates(example, [features[i] for i in idx], [start_logits[i] for i in idx],
                                         [end_logits[i] for i in idx], n_best_size=n_best_size,
                                         max_answer_length=max_answer_length)
        nbest = list(spans)
        if version_2_with_negative and null is not None:
            nbest = sorted(nbest + [null], key=lambda c: c["score"], reverse=True)[:n_best_size]
            if null not in nbest:  # as transformers: the null answer stays in the list
                nbest.append(null)
        if not nbest:  # no window offered a valid span: predict the empty answer
            nbest = [{"text": "", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0}]
        for c, p in zip(nbest, _softmax([c["score"] for c in nbest])):
            c["probability"] = p
        nbest_json[example.qas_id] = [{k: c[k] for k in ("text", "probability", "start_logit", "end_logit")}
                                      for c in nbest]
        if not version_2_with_negative:
            predictions[example.qas_id] = spans[0]["text"] if spans else ""
            continue
        if not spans:
            predictions[example.qas_id] = ""
            continue
        diff = null["score"] - spans[0]["score"]
        null_odds[example.qas_id] = diff
        predictions[example.qas_id] = "" if diff > null_score_diff_threshold else spans[0]["text"]
    return predictions, nbest_json, null_odds
