"""The official SQuAD evaluation, written from its published definitions.

v1.1 (evaluate-v1.1.py): answers are normalised (lower case, punctuation removed, the
articles a/an/the removed, whitespace collapsed); exact match and token-level F1 of a
prediction are the maxima over the question's gold answers; both are averaged over all
questions as percentages -> {"exact_match", "f1"}.

v2.0 (evaluate-v2.0.py): the same normalisation; gold answers that normalise to ""
are dropped, and a question without gold answers (unanswerable) has gold [""], which
only the empty prediction matches (F1 is 1 when both token lists are empty, else 0
when either is). Reports exact, f1, total, and HasAns_* / NoAns_* over the answerable
and unanswerable questions (each block only when such questions exist).

A question with no prediction scores 0 and counts in the total (v1.1's rule; the v2.0
script would stop with a KeyError on it).
"""
from __future__ import annotations

import re
import string
import sys
from collections import Counter
from typing import Iterable, Optional

from megabert.errors import DataError

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (in the official order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token-level F1 of the normalised texts. v2.0's rule for empty answers: 1.0 when
    both are empty, 0.0 when only one is (v1.1 gives 0.0 for both empty; its golds never are)."""
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_tokens), num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _questions(dataset: list) -> Iterable[dict]:
    for article in dataset:
        for paragraph in article["paragraphs"]:
            yield from paragraph["qas"]


def is_v2(data: dict) -> bool:
    """A SQuAD 2.0 file: its version says so, or a question carries is_impossible."""
    return (str(data.get("version", "")).lstrip("v").startswith("2") or
            any("is_impossible" in qa for qa in _questions(data["data"])))


def evaluate_v1(dataset: list, predictions: dict, warn=sys.stderr) -> dict:
    exact = f1 = total = 0.0
    for qa in _questions(dataset):
        total += 1
        if qa["id"] not in predictions:
            if warn is not None:
                print(f"Unanswered question {qa['id']} will receive score 0.", file=warn)
            continue
        golds = [a["text"] for a in qa["answers"]]
        if not golds:
            raise DataError(f"question {qa['id']} has no gold answer, which SQuAD v1.1 scoring needs; "
                            f"for SQuAD 2.0 data use the v2.0 evaluation (--version-2-with-negative)")
        pred = predictions[qa["id"]]
        exact += max(exact_match_score(pred, g) for g in golds)
        # v1.1's F1 of an empty prediction is 0 (its common-token count is 0).
        f1 += max(f1_score(pred, g) if normalize_answer(pred) else 0.0 for g in golds)
    return {"exact_match": 100.0 * exact / max(total, 1), "f1": 100.0 * f1 / max(total, 1)}


def evaluate_v2(dataset: list, predictions: dict, warn=sys.stderr) -> dict:
    exact, f1, has_answer = {}, {}, {}
    for qa in _questions(dataset):
        qid = qa["id"]
        golds = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])] or [""]
        has_answer[qid] = bool(qa["answers"])
        if qid not in predictions:
            if warn is not None:
                print(f"Missing prediction for {qid}", file=warn)
            exact[qid] = f1[qid] = 0.0
            continue
        pred = predictions[qid]
        exact[qid] = max(exact_match_score(pred, g) for g in golds)
        f1[qid] = max(f1_score(pred, g) for g in golds)

    def block(qids: list, prefix: str = "") -> dict:
        n = max(len(qids), 1)
        return {f"{prefix}exact": 100.0 * sum(exact[q] for q in qids) / n,
                f"{prefix}f1": 100.0 * sum(f1[q] for q in qids) / n, f"{prefix}total": len(qids)}

    out = block(list(exact))
    has = [q for q, h in has_answer.items() if h]
    no = [q for q, h in has_answer.items() if not h]
    if has:
        out.update(block(has, "HasAns_"))
    if no:
        out.update(block(no, "NoAns_"))
    return out


def evaluate(data: dict, predictions: dict, version: Optional[str] = None, warn=sys.stderr) -> dict:
    """Scores `predictions` ({id: text}) against a parsed SQuAD file. `version` "1.1" or
    "2.0"; None reads it from the file."""
    v2 = is_v2(data) if version is None else version.lstrip("v").startswith("2")
    return (evaluate_v2 if v2 else evaluate_v1)(data["data"], predictions, warn)
