"""The embedding task's files: training pairs as JSON lines, and a BEIR-layout dev dir.

Training pairs are sentence-transformers' (anchor, positive, negative...) columns named
`query`, `positive` and, optionally, `negative`: one string, or a list of strings (hard
negatives; rows may hold different numbers of them, none included).

A BEIR dir (Thakur et al. 2021; the layout MTEB's retrieval tasks read) holds
`corpus.jsonl` ({"_id", "title", "text"}), `queries.jsonl` ({"_id", "text"}) and
`qrels/dev.tsv` (query-id, corpus-id, score; tab-separated, a header line). A passage is
encoded as title + " " + text, as BEIR's and MTEB's dense retrievers do.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from megabert.data.json_lines import json_objects
from megabert.errors import DataError


@dataclass(frozen=True)
class Pair:
    query: str
    positive: str
    negatives: tuple[str, ...] = ()


def _json_lines(path: str):
    """(line number, object) of a JSON-lines file; blank lines skipped."""
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist")
    with open(path, "rb") as f:
        yield from json_objects(utf8_lines(f, path), path)


def utf8_lines(lines, path: str):
    """A binary file's lines decoded, a byte that is not UTF-8 a one-line error naming the line."""
    for lineno, raw in enumerate(lines, start=1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: byte {raw[e.start]:#04x} at column {e.start + 1} is not UTF-8; "
                            f"re-encode the file as UTF-8") from None


def _text(row: dict, key: str, where: str, required: bool = True) -> str:
    value = row.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(value).__name__ if value is not None else 'nothing'}")
    return value


def read_pairs(path: str) -> list[Pair]:
    """The training pairs of a JSON-lines file (what tools/mine_hard_negatives.py writes, too)."""
    pairs = []
    for lineno, row in _json_lines(path):
        where = f"{path}:{lineno}"
        query, positive = _text(row, "query", where), _text(row, "positive", where)
        negative = row.get("negative")
        if negative is None:
            negatives = ()
        elif isinstance(negative, str):
            negatives = (negative,)
        elif isinstance(negative, list) and all(isinstance(n, str) for n in negative):
            negatives = tuple(negative)
        else:
            raise DataError(f"{where}: 'negative' must be a string or a list of strings")
        pairs.append(Pair(query, positive, negatives))
    if not pairs:
        raise DataError(f"{path} holds no training pairs ({{\"query\": .., \"positive\": ..}} per line)")
    return pairs


@dataclass(frozen=True)
class BeirSet:
    corpus_ids: list[str]
    passages: list[str]  # title + " " + text
    query_ids: list[str]
    queries: list[str]
    qrels: dict[str, dict[str, int]]  # query id -> {corpus id: relevance}


def passage_text(title: str, text: str) -> str:
    """BEIR's and MTEB's passage string: title and text joined by a space (a missing title adds none)."""
    return f"{title} {text}" if title else text


def read_beir(path: str, split: str = "dev") -> BeirSet:
    """A BEIR dir's corpus, the queries that have qrels in `split`, and those qrels."""
    qrels_file = os.path.join(path, "qrels", f"{split}.tsv")
    if not os.path.isdir(path):
        raise DataError(f"--eval-dir {path} is not a directory (BEIR layout: corpus.jsonl, queries.jsonl, "
                        f"qrels/{split}.tsv)")
    qrels: dict[str, dict[str, int]] = {}
    lines: dict[str, int] = {}  # corpus id -> the first qrels line naming it
    if not os.path.isfile(qrels_file):
        raise DataError(f"{qrels_file} does not exist; a BEIR dir has qrels/{split}.tsv")
    with open(qrels_file, "rb") as f:
        for lineno, line in enumerate(utf8_lines(f, qrels_file), start=1):
            fields = line.rstrip("\r\n").split("\t")
            if not line.strip() or (lineno == 1 and len(fields) == 3 and not _is_int(fields[2])):
                continue  # the header (query-id, corpus-id, score); a file without one starts with a judgement
            if len(fields) != 3:
                raise DataError(f"{qrels_file}:{lineno}: {len(fields)} tab-separated columns, BEIR's qrels have 3 "
                                f"(query-id, corpus-id, score)")
            try:
                score = int(fields[2])
            except ValueError:
                raise DataError(f"{qrels_file}:{lineno}: score {fields[2]!r} is not an integer")
            qrels.setdefault(fields[0], {})[fields[1]] = score
            lines.setdefault(fields[1], lineno)
    if not qrels:
        raise DataError(f"{qrels_file} holds no judgements")
    corpus_file = os.path.join(path, "corpus.jsonl")
    corpus_ids, passages = read_corpus(corpus_file)
    # A judged document the corpus lacks can never be retrieved (its query would score 0, silently).
    known = set(corpus_ids)
    missing_docs = [d for d in lines if d not in known]
    if missing_docs:
        d = min(missing_docs, key=lines.get)
        raise DataError(f"{qrels_file}:{lines[d]}: corpus-id {d!r} is not in {corpus_file}; drop the judgement or "
                        f"add the document")
    query_ids, queries = [], []
    for lineno, row in _json_lines(os.path.join(path, "queries.jsonl")):
        where = f"{os.path.join(path, 'queries.jsonl')}:{lineno}"
        qid = str(row.get("_id") if row.get("_id") is not None else _text(row, "_id", where))
        if qid in qrels:  # BEIR scores the queries that the split judges
            query_ids.append(qid)
            queries.append(_text(row, "text", where))
    missing = sorted(set(qrels) - set(query_ids))
    if missing:
        raise DataError(f"{qrels_file} judges query {missing[0]!r}, which {path}/queries.jsonl does not hold")
    return BeirSet(corpus_ids, passages, query_ids, queries, qrels)


def read_corpus(corpus_file: str) -> tuple[list[str], list[str]]:
    """A BEIR corpus.jsonl's ids and passages (title + " " + text). An id twice is an error:
    both copies would be retrieved, and one of them counted as relevant twice over."""
    corpus_ids, passages, seen = [], [], {}
    for lineno, row in _json_lines(corpus_file):
        where = f"{corpus_file}:{lineno}"
        doc_id = str(row.get("_id") if row.get("_id") is not None else _text(row, "_id", where))
        if doc_id in seen:
            raise DataError(f"{where}: _id {doc_id!r} is already line {seen[doc_id]}'s; corpus ids must be unique")
        seen[doc_id] = lineno
        corpus_ids.append(doc_id)
        passages.append(passage_text(_text(row, "title", where, required=False), _text(row, "text", where)))
    if not corpus_ids:
        raise DataError(f"{corpus_file} holds no documents")
    return corpus_ids, passages


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True
