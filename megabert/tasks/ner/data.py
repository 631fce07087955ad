"""Tagged sentences from the two layouts NER data comes in:

- CoNLL (CoNLL-2003's files as they are): one token per line, its tag in the last column
  (other columns, such as part-of-speech and chunk tags, are ignored); a blank line between
  sentences; `-DOCSTART-` lines mark documents and are skipped. Every line of a file has the
  same columns: a line with more or fewer is an error, not a guess at which column is the tag.
  A test file may give the tokens alone.
- JSON lines (a `.json` / `.jsonl` file, as run_ner.py's --train_file): one object per
  sentence, `{"tokens": [...], "ner_tags": ["B-PER", ...]}`, the tags as strings.

Tags are kept as the file writes them: IOB1, IOB2 and IOBES alike (the label set is the
training file's tags; seqeval's default mode reads entities from each of them).
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

from megabert.data.json_lines import json_objects
from megabert.data.text_files import utf8_lines
from megabert.errors import DataError

logger = logging.getLogger(__name__)

DOCSTART = "-DOCSTART-"


@dataclass(frozen=True)
class Sentence:
    words: tuple[str, ...]
    tags: Optional[tuple[str, ...]]  # None: an unlabelled test sentence


def read_sentences(path: str, *, labelled: bool = True) -> list[Sentence]:
    """The sentences of a CoNLL or JSON-lines file (by extension: .json / .jsonl are JSON
    lines). `labelled`: every word must have a tag (training and dev files); otherwise a
    file's tags are kept where every word has one, and dropped where not."""
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist")
    ext = os.path.splitext(path)[1].lower()
    sentences = _read_json_lines(path, labelled) if ext in (".json", ".jsonl") else _read_conll(path, labelled)
    if not sentences:
        raise DataError(f"{path} holds no sentences; give CoNLL lines (token ... tag) or JSON lines "
                        f"({{\"tokens\": [...], \"ner_tags\": [...]}})")
    return sentences


def label_set(sentences: list[Sentence]) -> tuple[str, ...]:
    """The tags of a training file, sorted (run_ner.py's order for string tags)."""
    return tuple(sorted({t for s in sentences for t in s.tags}))


# An entity tag of any scheme seqeval reads: O, or a prefix (IOB1/IOB2 B- I-, IOBES E- S-, BILOU L- U-).
_ENTITY_TAG = re.compile(r"^(O|[BIESLU][-_].+)$")


def warn_unless_entity_tags(path: str, labels: tuple[str, ...]) -> None:
    """One warning when no tag of a training file reads as an entity tag: a file whose last
    column holds part-of-speech tags (NNP, VBZ) trains and scores, but seqeval finds no
    entities in them, so the F1 means nothing."""
    if labels and not any(_ENTITY_TAG.match(t) for t in labels):
        shown = ", ".join(labels[:5]) + (", ..." if len(labels) > 5 else "")
        logger.warning("%s: no tag in the last column is an entity tag (O, B-X, I-X; found %s): is the last column "
                       "the NER tag? CoNLL-2003's lines are `token POS chunk NER`", path, shown)


def _read_conll(path: str, labelled: bool) -> list[Sentence]:
    sentences: list[Sentence] = []
    words: list[str] = []
    tags: list[Optional[str]] = []

    def close():
        if words:
            known = None if any(t is None for t in tags) else tuple(tags)
            sentences.append(Sentence(tuple(words), known))
        words.clear()
        tags.clear()

    first: Optional[tuple[int, int]] = None  # (line, columns) of the first token line: every line's columns
    for lineno, line in enumerate(utf8_lines(path), start=1):
        fields = line.split()
        if not fields:
            close()
            continue
        if fields[0] == DOCSTART:
            close()
            continue
        if len(fields) < 2 and labelled:
            raise DataError(f"{path}:{lineno}: the token {fields[0]!r} has no tag; CoNLL lines hold the token "
                            f"first and its tag last (a blank line between sentences)")
        if first is None:
            first = (lineno, len(fields))
        elif len(fields) != first[1]:
            raise DataError(f"{path}:{lineno}: {len(fields)} columns where line {first[0]} has {first[1]}; every "
                            f"line holds the same columns, the token first and its tag last (a token with a space "
                            f"in it splits into two columns)")
        words.append(fields[0])
        tags.append(fields[-1] if len(fields) >= 2 else None)
    close()
    return sentences


def _read_json_lines(path: str, labelled: bool) -> list[Sentence]:
    sentences = []
    for lineno, row in json_objects(utf8_lines(path), path, 'an object {"tokens": [...], "ner_tags": [...]}'):
        where = f"{path}:{lineno}"
        if not isinstance(row.get("tokens"), list):
            raise DataError(f"{where}: no \"tokens\" list; each line is {{\"tokens\": [...], \"ner_tags\": [...]}}")
        bad = next((i for i, w in enumerate(row["tokens"]) if not isinstance(w, str) or not w.strip()), None)
        if bad is not None:
            raise DataError(f"{where}: \"tokens\" item {bad} is {json.dumps(row['tokens'][bad])}, not a word; "
                            f"give each token as a non-empty string")
        words = tuple(row["tokens"])
        tags = row.get("ner_tags")
        if tags is None:
            if labelled:
                raise DataError(f"{where}: no \"ner_tags\"; training and validation sentences need their tags")
        else:
            if not isinstance(tags, list) or len(tags) != len(words):
                raise DataError(f"{where}: \"ner_tags\" must be a list with one tag per token "
                                f"({len(words)} tokens)")
            if any(not isinstance(t, str) for t in tags):
                raise DataError(f"{where}: \"ner_tags\" holds class ids; give the tags as strings "
                                f"(\"B-PER\", \"O\", ...): the file does not name the ids")
            tags = tuple(tags)
        if words:  # an empty sentence has nothing to tag
            sentences.append(Sentence(words, tags))
    return sentences
