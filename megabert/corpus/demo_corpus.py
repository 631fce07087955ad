"""A quickstart corpus that needs no download: the docstrings of Python's own standard library.

Every Python install ships its stdlib as source, and its docstrings are edited English
prose (a few MB of it), so `make demo` can build a corpus on any machine. Files are
parsed with `ast`, never imported (importing `antigravity` opens a web browser), and
read in sorted order so the corpus is the same on every run of the same Python.
"""
from __future__ import annotations

import ast
import json
import os
import sysconfig
import warnings
from typing import Iterator, Optional

# Test suites and vendored code repeat boilerplate; the demo does not need them.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "_vendor",
              "encodings", "lib2to3", "turtledemo"}


def _source_files(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _docstrings(path: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old modules
                tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def _prose(doc: str, min_words: int) -> Optional[str]:
    """The docstring's paragraphs of prose (code examples and option tables dropped), one per line."""
    paragraphs = []
    for para in doc.split("\n\n"):
        lines = [ln.strip() for ln in para.splitlines()]
        if not lines or any(ln.startswith((">>>", "...", "$", "-", "*", "+", ":", "|")) for ln in lines):
            continue
        text = " ".join(lines)
        if sum(c.isalpha() or c.isspace() for c in text) < 0.85 * len(text):
            continue  # mostly symbols: a signature, a table or code
        paragraphs.append(text)
    text = "\n".join(paragraphs)
    return text if len(text.split()) >= min_words else None


def stdlib_documents(root: Optional[str] = None, min_words: int = 20, max_documents: Optional[int] = None
                     ) -> Iterator[str]:
    """Prose docstrings of the standard library at `root` (default: this Python's), deduplicated."""
    root = root or sysconfig.get_paths()["stdlib"]
    seen, count = set(), 0
    for path in _source_files(root):
        for doc in _docstrings(path):
            text = _prose(doc, min_words)
            if text is None or text in seen:
                continue
            seen.add(text)
            yield text
            count += 1
            if max_documents is not None and count >= max_documents:
                return


def write_demo_corpus(path: str, max_documents: Optional[int] = None, root: Optional[str] = None) -> int:
    """Writes the corpus as jsonl ({"text": ...} per line); returns the number of documents."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for text in stdlib_documents(root, max_documents=max_documents):
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            n += 1
    return n
