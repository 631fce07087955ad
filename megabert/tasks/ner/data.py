"""Tagged sentences from the two layouts NER data comes in:

- CoNLL (CoNLL-2003's files as they are): one token per line, its tag in the last column
  (other columns, such as part-of-speech and chunk tags, are ignored); a blank line between
  sentences; `-DOCSTART-` lines mark documents and are skipped. A test file may give the
  tokens alone.
- JSON lines (a `.json` / `.jsonl` file, as run_ner.py's --train_file): one object per
  sentence, `{"tokens": [...], "ner_tags": ["B-PER", ...]}`, the tags as strings.

Tags are kept as the file writes them: IOB1, IOB2 and IOBES alike (the label set is the
training file's tags; seqeval's default mode reads entities from each of them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megabert.data.json_lines import json_objects
from megabert.errors import DataError

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

    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
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
            words.append(fields[0])
            tags.append(fields[-1] if len(fields) >= 2 else None)
    close()
    return sentences


def _read_json_lines(path: str, labelled: bool) -> list[Sentence]:
    sentences = []
    with open(path, encoding="utf-8") as f:
        for lineno, row in json_objects(f, path, 'an object {"tokens": [...], "ner_tags": [...]}'):
            where = f"{path}:{lineno}"
            if not isinstance(row.get("tokens"), list):
                raise DataError(f"{where}: no \"tokens\" list; each line is {{\"tokens\": [...], \"ner_tags\": [...]}}")
            words = tuple(str(w) for w in row["tokens"])
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
