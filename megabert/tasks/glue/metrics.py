"""GLUE's official metrics, as the `evaluate` library's "glue" metric (scikit-learn and
scipy underneath) computes them, in numpy alone: accuracy (a fraction, 0-1), binary F1 of
class 1 (MRPC, QQP), Matthews correlation (CoLA), Pearson and Spearman correlation
(STS-B; Spearman with tied values given their average rank, as scipy.stats.spearmanr)."""
from __future__ import annotations

import numpy as np


def accuracy(preds: np.ndarray, labels: np.ndarray) -> float:
    return float((np.asarray(preds) == np.asarray(labels)).mean())


def f1(preds: np.ndarray, labels: np.ndarray) -> float:
    """F1 of the positive class (1); 0 when there is no true positive (sklearn's value with
    its zero_division warning)."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    tp = float(((preds == 1) & (labels == 1)).sum())
    fp = float(((preds == 1) & (labels != 1)).sum())
    fn = float(((preds != 1) & (labels == 1)).sum())
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews_corrcoef(preds: np.ndarray, labels: np.ndarray) -> float:
    """Binary or multi-class MCC (Gorodkin's R_K, sklearn's formula); 0 when either side is
    constant (the denominator vanishes)."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    classes = np.union1d(preds, labels)
    c = np.zeros((len(classes), len(classes)), dtype=np.float64)  # confusion [true, pred]
    np.add.at(c, (np.searchsorted(classes, labels), np.searchsorted(classes, preds)), 1)
    t, p, n = c.sum(axis=1), c.sum(axis=0), c.sum()
    correct = np.trace(c)
    cov_ytyp = correct * n - t @ p
    cov_ypyp = n * n - p @ p
    cov_ytyt = n * n - t @ t
    denom = np.sqrt(cov_ytyt * cov_ypyp)
    return 0.0 if denom == 0 else float(cov_ytyp / denom)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    xm, ym = x - x.mean(), y - y.mean()
    denom = np.sqrt((xm * xm).sum() * (ym * ym).sum())
    return float("nan") if denom == 0 else float((xm * ym).sum() / denom)


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing the mean of the ranks they span (scipy's rankdata 'average')."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    starts = np.r_[0, np.flatnonzero(sorted_x[1:] != sorted_x[:-1]) + 1]
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x), np.float64)
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + 1 + e) / 2.0  # mean of ranks s+1 .. e
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(average_ranks(x), average_ranks(y))


def glue_metrics(metric_names: tuple[str, ...], preds: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """{name: value} for the task's metrics (GlueTaskSpec.metrics), run_glue.py's names."""
    fns = {"accuracy": accuracy, "f1": f1, "matthews_correlation": matthews_corrcoef, "pearson": pearson,
           "spearmanr": spearman}
    return {name: fns[name](preds, labels) for name in metric_names}
