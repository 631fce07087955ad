"""The nine GLUE tasks as the distribution ships them (Wang et al. 2019; the files of
`download_glue_data.py`): where each TSV keeps its sentences and label, which files have a
header, the label set, the official metrics and the submission file name.

Column numbers and label orders are those of transformers' glue processors
(`transformers.data.processors.glue`), so a label id means the same class in a model
fine-tuned here and one fine-tuned by run_glue.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Columns:
    """Where a row keeps its fields (negative: counted from the end, as MNLI's label, whose
    dev rows carry five annotator labels before the gold one). `b` is None for
    single-sentence tasks, `label` None in test files; `index` is the test file's id column."""

    a: int
    b: Optional[int]
    label: Optional[int]
    header: bool = True
    index: Optional[int] = None

    def width(self) -> int:
        """The fewest columns a row needs to hold every field: a label counted from the end
        must lie past the sentences, not on them."""
        last = max(c for c in (self.a, self.b, self.index, self.label) if c is not None and c >= 0)
        return last + 1 + (1 if self.label is not None and self.label < 0 else 0)


@dataclass(frozen=True)
class GlueTaskSpec:
    name: str
    labels: Optional[tuple[str, ...]]  # None: regression (STS-B)
    metrics: tuple[str, ...]
    train: Columns
    test: Columns
    dev_files: tuple[tuple[str, str], ...] = (("dev.tsv", ""),)
    """(file, metric key suffix): MNLI scores matched and mismatched dev sets."""
    test_files: tuple[tuple[str, str], ...] = (("test.tsv", ""),)
    """(file, submission name); the submission name of "" is the task's own."""
    submission: str = ""
    skip_short_rows: bool = False
    """QQP: the distribution's train.tsv holds rows cut short by stray newlines; run_glue.py
    (an IndexError caught) and the GLUE baselines skip them. Elsewhere a short row is an error."""

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)


BINARY = ("0", "1")
ENTAILMENT = ("entailment", "not_entailment")

TASKS: dict[str, GlueTaskSpec] = {t.name: t for t in (
    # CoLA's train/dev have no header: source, label, original label, sentence.
    GlueTaskSpec("cola", BINARY, ("matthews_correlation",), Columns(3, None, 1, header=False),
                 Columns(1, None, None, index=0), submission="CoLA"),
    GlueTaskSpec("sst-2", BINARY, ("accuracy",), Columns(0, None, 1), Columns(1, None, None, index=0),
                 submission="SST-2"),
    # MRPC: Quality, #1 ID, #2 ID, #1 String, #2 String (test: index in place of Quality).
    GlueTaskSpec("mrpc", BINARY, ("accuracy", "f1"), Columns(3, 4, 0), Columns(3, 4, None, index=0), submission="MRPC"),
    # STS-B: index, genre, filename, year, old_index, source1, source2, sentence1, sentence2, score.
    GlueTaskSpec("sts-b", None, ("pearson", "spearmanr"), Columns(7, 8, -1), Columns(7, 8, None, index=0),
                 submission="STS-B"),
    # QQP: id, qid1, qid2, question1, question2, is_duplicate (test: id, question1, question2).
    GlueTaskSpec("qqp", BINARY, ("accuracy", "f1"), Columns(3, 4, 5), Columns(1, 2, None, index=0), submission="QQP",
                 skip_short_rows=True),
    # MNLI: index, promptID, pairID, genre, 4 parses, sentence1, sentence2, label1[..label5], gold_label.
    GlueTaskSpec("mnli", ("contradiction", "entailment", "neutral"), ("accuracy",), Columns(8, 9, -1),
                 Columns(8, 9, None, index=0), dev_files=(("dev_matched.tsv", ""), ("dev_mismatched.tsv", "_mm")),
                 test_files=(("test_matched.tsv", "MNLI-m"), ("test_mismatched.tsv", "MNLI-mm")), submission="MNLI"),
    GlueTaskSpec("qnli", ENTAILMENT, ("accuracy",), Columns(1, 2, -1), Columns(1, 2, None, index=0), submission="QNLI"),
    GlueTaskSpec("rte", ENTAILMENT, ("accuracy",), Columns(1, 2, -1), Columns(1, 2, None, index=0), submission="RTE"),
    GlueTaskSpec("wnli", BINARY, ("accuracy",), Columns(1, 2, -1), Columns(1, 2, None, index=0), submission="WNLI"),
)}

# run_glue.py's names for the same tasks (its --task_name), accepted too.
ALIASES = {"sst2": "sst-2", "stsb": "sts-b"}
