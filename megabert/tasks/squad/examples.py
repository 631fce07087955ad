"""SQuAD v1.1 / v2.0 json -> examples (one per question).

The file layout is the official one: {"version", "data": [{"title", "paragraphs":
[{"context", "qas": [{"id", "question", "answers": [{"text", "answer_start"}],
"is_impossible"}]}]}]}. v2.0 adds `is_impossible`; its unanswerable questions have
no answers (gold [""] for the evaluation). Features (token windows) are made in
squad_features.py, predictions in squad_postprocess.py, scores in squad_eval.py.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from megabert.data.text_files import read_utf8
from megabert.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class SquadExample:
    """One question about one context. `answers` are (text, answer_start) pairs;
    training uses the first (the train sets hold exactly one per answerable question)."""

    qas_id: str
    question: str
    context: str
    answers: list[tuple[str, int]] = field(default_factory=list)
    is_impossible: bool = False

    @property
    def answer_span(self) -> tuple[int, int] | None:
        """Character span [start, end) of the training answer, None when unanswerable."""
        if self.is_impossible or not self.answers:
            return None
        text, start = self.answers[0]
        return start, start + len(text)


def read_json(path: str, what: str):
    """A JSON file, with errors that name it and say what it should have been."""
    if not os.path.isfile(path):
        raise DataError(f"{what} {path} does not exist")
    try:
        return json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                        f"expected a {what}") from None


def load_squad_json(path: str) -> dict:
    """The parsed file, with errors that name it (missing, not JSON, not SQuAD-shaped)."""
    data = read_json(path, "SQuAD v1.1/v2.0 file")
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise DataError(f"{path} is not a SQuAD file: expected an object with a \"data\" list of articles")
    return data


def read_squad_examples(path: str, *, is_training: bool, version_2_with_negative: bool = False
                        ) -> list[SquadExample]:
    """Examples in file order. For training, answerable questions must carry an answer
    whose text is at answer_start in the context; ones that do not are skipped with a
    count (as Google's run_squad does) rather than trained on the wrong span."""
    data = load_squad_json(path)
    examples, skipped, seen = [], 0, set()
    for a, article in enumerate(data["data"]):
        for p, para in enumerate(_items(article, "paragraphs", path, f"article {a}")):
            where = f"article {a}, paragraph {p}"
            context = _field(para, "context", str, path, where)
            for q, qa in enumerate(_items(para, "qas", path, where)):
                qwhere = f"{where}, question {q}"
                qas_id = str(_field(qa, "id", (str, int), path, qwhere))
                if qas_id in seen:  # predictions.json is keyed by id: the second would overwrite the first
                    raise DataError(f"{path}: {qwhere} repeats the id {qas_id!r}; each question needs its own id")
                seen.add(qas_id)
                question = _field(qa, "question", str, path, qwhere)
                impossible = qa.get("is_impossible", False)
                if not isinstance(impossible, bool):  # bool("false") is True
                    raise DataError(f"{path}: {qwhere} (id {qas_id}) has \"is_impossible\": "
                                    f"{json.dumps(impossible)}; write true or false")
                if not isinstance(qa.get("answers", []), list):
                    raise DataError(f"{path}: {qwhere} (id {qas_id}) has no valid \"answers\" list; not a SQuAD "
                                    f"v1.1/v2.0 file")
                answers = []
                for ans in qa.get("answers") or []:
                    text = _field(ans, "text", str, path, f"{qwhere} (id {qas_id}) answer")
                    start = _field(ans, "answer_start", int, path, f"{qwhere} (id {qas_id}) answer")
                    answers.append((text, start))
                if impossible and not version_2_with_negative:
                    raise DataError(f"{path}: question {qas_id} is marked is_impossible (SQuAD v2.0); "
                                    f"pass --version-2-with-negative")
                if is_training and not impossible:
                    if not answers:
                        raise DataError(f"{path}: training question {qas_id} has no answer"
                                        + ("" if version_2_with_negative else
                                           "; for SQuAD v2.0 data pass --version-2-with-negative"))
                    text, start = answers[0]
                    if context[start:start + len(text)] != text:
                        skipped += 1
                        continue
                examples.append(SquadExample(qas_id, question, context, answers, impossible))
    if skipped:
        logger.warning("%s: skipped %d training questions whose answer text is not at answer_start", path, skipped)
    if not examples:
        raise DataError(f"{path} holds no questions")
    return examples


def _items(obj, key: str, path: str, where: str) -> list:
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, list):
        raise DataError(f"{path}: {where} has no \"{key}\" list; not a SQuAD v1.1/v2.0 file")
    return value


def _field(obj, key: str, kind, path: str, where: str):
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DataError(f"{path}: {where} has no valid \"{key}\"; not a SQuAD v1.1/v2.0 file")
    return value
