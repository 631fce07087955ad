"""GLUE examples from the distribution's TSV files as they are, or from CSV / JSON-lines
files with named columns (run_glue.py's --train_file / --validation_file).

TSVs are read as transformers' glue processors and Google's run_classifier.py read them:
tab-separated, no quoting (a quote character is text: SST-2 and CoLA sentences hold
them), the header row skipped where the task's files have one. A row too short for its
task's columns, or with a label outside the task's set, is an error naming file:line;
QQP's short rows, which the real train.tsv holds, are skipped with one warning instead,
as run_glue.py and the GLUE baselines do (see tasks.GlueTaskSpec.skip_short_rows).
"""
from __future__ import annotations

import csv
import json
import logging
import os
from dataclasses import dataclass
from typing import Optional, Union

from megabert.data.json_lines import json_objects
from megabert.data.text_files import utf8_lines
from megabert.errors import DataError
from megabert.tasks.glue.tasks import Columns, GlueTaskSpec

logger = logging.getLogger(__name__)

Label = Union[int, float, None]


@dataclass(frozen=True)
class GlueExample:
    text_a: str
    text_b: Optional[str]
    label: Label  # class id, STS-B's score, or None (test files)


def label_of(task: GlueTaskSpec, value, where: str, ids: bool = False) -> Label:
    """A label as the file writes it -> class id (or STS-B's float score). A class is
    written by name; with `ids` (CSV / JSON files, where run_glue.py reads class ids) by
    its id too."""
    if task.is_regression:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise DataError(f"{where}: label {value!r} is not a number; {task.name}'s labels are similarity scores")
    text = str(value).strip()
    if text in task.labels:
        return task.labels.index(text)
    if ids and not isinstance(value, bool) and text.isdigit() and int(text) < len(task.labels):
        return int(text)
    raise DataError(f"{where}: label {text!r} is not one of {task.name}'s labels ({', '.join(task.labels)}); "
                    f"is this the {task.name} data, or the right --task-name?")


def read_tsv(path: str, task: GlueTaskSpec, *, test: bool = False) -> list[GlueExample]:
    """The examples of one GLUE TSV (`test`: a test file, laid out as task.test, no labels)."""
    cols: Columns = task.test if test else task.train
    width = cols.width()
    examples, skipped = [], []
    for lineno, line in enumerate(_lines(path), start=1):
        if lineno == 1 and cols.header:
            continue
        line = line.rstrip("\r\n")
        if not line:
            continue
        row = line.split("\t")
        if len(row) < width:
            if task.skip_short_rows and not test:
                skipped.append(lineno)
                continue
            raise DataError(f"{path}:{lineno}: {len(row)} tab-separated columns, {task.name} needs {width}; "
                            f"is this {task.name}'s {'test' if test else 'train/dev'} file as GLUE ships it?")
        where = f"{path}:{lineno}"
        label = None if cols.label is None else label_of(task, row[cols.label], where)
        examples.append(GlueExample(row[cols.a], row[cols.b] if cols.b is not None else None, label))
    if skipped:
        logger.warning("%s: skipped %d rows with fewer than %d columns (first at line %d), as run_glue.py does",
                       path, len(skipped), width, skipped[0])
    if not examples:
        raise DataError(f"{path} holds no {task.name} examples")
    return examples


def warn_unseen_labels(task: GlueTaskSpec, train: list[GlueExample], path: str, examples: list[GlueExample]
                       ) -> None:
    """One warning when a dev file holds classes the training data never shows: legitimate (a
    small or filtered training set), but the model then scores those rows as it was never taught."""
    if task.is_regression:
        return
    unseen = sorted({e.label for e in examples} - {e.label for e in train} - {None})
    if unseen:
        logger.warning("%s has labels the training data never shows: %s (%d of %d rows)", path,
                       ", ".join(task.labels[i] for i in unseen), sum(e.label in unseen for e in examples),
                       len(examples))


def read_named_columns(path: str, task: GlueTaskSpec, *, test: bool = False) -> list[GlueExample]:
    """A CSV (with a header row) or JSON-lines file: the sentences are `sentence1` and
    `sentence2` when both exist, else the first one or two columns that are not `label`
    (run_glue.py's rule); labels in `label`, by name or id."""
    rows = list(_named_rows(path))
    if not rows:
        raise DataError(f"{path} holds no rows")
    columns = list(rows[0][1])
    others = [c for c in columns if c != "label"]
    if "sentence1" in columns and "sentence2" in columns:
        key_a, key_b = "sentence1", "sentence2"
    elif len(others) >= 2:
        key_a, key_b = others[0], others[1]
    elif others:
        key_a, key_b = others[0], None
    else:
        raise DataError(f"{path} has no sentence column (columns: {', '.join(columns)})")
    if not test and "label" not in columns:
        raise DataError(f"{path} has no 'label' column (columns: {', '.join(columns)}); run_glue.py's files name it so")
    examples = []
    for lineno, row in rows:
        where = f"{path}:{lineno}"
        missing = [k for k in (key_a, key_b) if k is not None and row.get(k) is None]
        if missing or (not test and row.get("label") is None):
            raise DataError(f"{where}: no value for {(missing or ['label'])[0]!r}")
        wrong = next((k for k in (key_a, key_b) if k is not None and not isinstance(row[k], str)), None)
        if wrong is not None:  # a JSON list or number would be trained on as its printed form
            raise DataError(f"{where}: {wrong!r} is {json.dumps(row[wrong])[:40]}, not a string; give each sentence "
                            f"as a JSON string")
        label = None if test else label_of(task, row["label"], where, ids=True)
        examples.append(GlueExample(str(row[key_a]), str(row[key_b]) if key_b else None, label))
    return examples


def read_examples(path: str, task: GlueTaskSpec, *, test: bool = False) -> list[GlueExample]:
    """By extension: .csv and .json/.jsonl have named columns, anything else is GLUE's TSV."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".csv", ".json", ".jsonl"):
        return read_named_columns(path, task, test=test)
    return read_tsv(path, task, test=test)


def _named_rows(path: str):
    """(line number, {column: value}) of a CSV or JSON-lines file."""
    if path.lower().endswith(".csv"):
        reader = csv.DictReader(_lines(path))
        for row in reader:
            if None in row:  # more fields than the header names
                raise DataError(f"{path}:{reader.line_num}: more fields than the header's {len(reader.fieldnames)}")
            yield reader.line_num, row
        return
    yield from json_objects(_lines(path), path, "an object with named columns")


def _lines(path: str):
    """The file's lines as written (line ends kept: csv reads quoted ones), UTF-8."""
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist")
    return utf8_lines(path)
