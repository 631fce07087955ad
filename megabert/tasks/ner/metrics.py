"""Entity-level precision, recall and F1 and word accuracy, as run_ner.py reports them:
the `evaluate` library's "seqeval" metric with its defaults, which calls seqeval with no
scheme and no strict mode, and keeps the micro averages over entity types.

seqeval's default mode is conlleval's chunking: an entity starts at B-, at S-, at I- or E-
after O or another type, and ends before O, B-, S-, a change of type, or after E- / S-.
So IOB1 (I- opens an entity, B- only between two of one type), IOB2 and IOBES are scored
as they come, and an ill-formed prediction (I-PER after O) still counts as an entity, as
conlleval counts it. (seqeval's strict mode with a scheme would instead require the gold
and predicted tags to follow that one scheme.)
"""
from __future__ import annotations

import warnings
from typing import Sequence


def ner_metrics(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]) -> dict[str, float]:
    """{"precision", "recall", "f1", "accuracy"} over sentences of tags (fractions 0-1);
    0 where nothing is predicted or there is nothing to find (seqeval's value, without
    its warning)."""
    from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score

    gold, predicted = [list(s) for s in gold], [list(s) for s in predicted]
    with warnings.catch_warnings():
        # A tag without a B-/I-/E-/S- prefix (a bare "PER") is scored as seqeval scores it; its
        # per-word warning says nothing the user can act on here.
        warnings.filterwarnings("ignore", message=".*seems not to be NE tag")
        return {"precision": float(precision_score(gold, predicted, zero_division=0)),
                "recall": float(recall_score(gold, predicted, zero_division=0)),
                "f1": float(f1_score(gold, predicted, zero_division=0)),
                "accuracy": float(accuracy_score(gold, predicted))}
