"""Wikipedia XML dump -> plain-text articles (the core of tools/wikipedia_to_jsonl.py).

The dump is streamed with `iterparse` (a 20 GB .xml.bz2 never sits in memory) and the
wikitext of each article is cleaned by mwparserfromhell, a maintained wikitext parser,
in worker processes. What BERT's authors kept from Wikipedia is running prose: we drop
templates (infoboxes, citations), references, tables, galleries, file/category/
interlanguage links, lists, headings, and the reference-like sections at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import bz2
import re
import xml.etree.ElementTree as ET
from typing import Iterator, Optional

from megabert.errors import DataError

# Sections whose content is not prose (lower-cased titles).
DROP_SECTIONS = {"references", "external links", "see also", "notes", "further reading", "bibliography",
                 "sources", "citations", "footnotes", "notes and references", "works cited", "publications"}
DROP_TAGS = {"ref", "references", "table", "gallery", "math", "chem", "timeline", "syntaxhighlight", "source",
             "pre", "score", "imagemap", "graph", "mapframe", "templatedata", "code", "hiero", "inputbox"}
# Lines that are list items, indentation, tables or headings once templates are gone.
_NON_PROSE_LINE = re.compile(r"^\s*(?:[*#:;|!]|\{\||\|\}|=)")
_SPACES = re.compile(r"[ \t\u00a0]+")


def _local(tag: str) -> str:
    """'{http://www.mediawiki.org/xml/export-0.11/}page' -> 'page' (dumps carry a versioned namespace)."""
    return tag.rsplit("}", 1)[-1]


def iter_pages(path: str) -> Iterator[tuple[str, str, str]]:
    """(id, title, wikitext) of every main-namespace, non-redirect page of a dump (.xml or .xml.bz2)."""
    opener = bz2.open if path.endswith(".bz2") else open
    try:
        with opener(path, "rb") as f:
            context = ET.iterparse(f, events=("start", "end"))
            _, root = next(context)
            page: dict = {}
            for event, elem in context:
                name = _local(elem.tag)
                if event == "start":
                    if name == "page":
                        page = {}
                    continue
                if name in ("title", "ns", "text") or (name == "id" and "id" not in page):
                    page.setdefault(name, elem.text or "")  # the first <id> is the page's, not the revision's
                elif name == "redirect":
                    page["redirect"] = True
                elif name == "page":
                    if page.get("ns", "0") == "0" and not page.get("redirect") and page.get("text"):
                        yield page.get("id", ""), page.get("title", ""), page["text"]
                    root.clear()  # drop finished pages: memory stays flat over the whole dump
    except (ET.ParseError, OSError, EOFError, StopIteration) as e:
        raise DataError(f"cannot read Wikipedia dump {path}: {e or 'empty file'}") from None


def clean_wikitext(text: str) -> str:
    """The prose of an article's wikitext: one paragraph per line."""
    import mwparserfromhell

    code = mwparserfromhell.parse(text)
    for section in code.get_sections(levels=[2]):
        headings = section.filter_headings(recursive=False)
        if headings and headings[0].title.strip_code().strip().lower() in DROP_SECTIONS:
            _remove(code, section)
    for node in code.filter(recursive=True):
        if isinstance(node, (mwparserfromhell.nodes.Template, mwparserfromhell.nodes.Comment)):
            _remove(code, node)
        elif isinstance(node, mwparserfromhell.nodes.Tag) and str(node.tag).strip().lower() in DROP_TAGS:
            _remove(code, node)
        elif isinstance(node, mwparserfromhell.nodes.Wikilink) and ":" in str(node.title).lstrip(":"):
            _remove(code, node)  # File:, Image:, Category: and interlanguage links
    lines = []
    for line in str(code).splitlines():
        if not line.strip() or _NON_PROSE_LINE.match(line):
            continue
        prose = _SPACES.sub(" ", mwparserfromhell.parse(line).strip_code(normalize=True, collapse=True)).strip()
        if prose:
            lines.append(prose)
    return "\n".join(lines)


def _remove(code, node) -> None:
    try:
        code.remove(node)
    except ValueError:  # already gone with an enclosing node
        pass


@dataclass(frozen=True)
class CleanedPage:
    """One page's outcome: `article` ({"id", "title", "text"}) when kept; else `error` (the
    parser's reason) for wikitext that cannot be parsed, or neither for text shorter than
    --min-chars."""

    title: str
    article: Optional[dict] = None
    error: Optional[str] = None


def clean_pages(pages: list[tuple[str, str, str]], min_chars: int) -> list[CleanedPage]:
    """Worker task: cleans a batch of pages. Wikitext the parser cannot read (its
    ParserError, or nesting deeper than Python's recursion limit) is counted and reported by
    the caller, so one broken article does not stop a dump of millions; any other exception
    is a bug and propagates."""
    from mwparserfromhell.parser import ParserError

    out = []
    for page_id, title, text in pages:
        try:
            prose = clean_wikitext(text)
        except (ParserError, RecursionError) as e:
            out.append(CleanedPage(title, error=f"{type(e).__name__}: {e}"[:200]))
            continue
        out.append(CleanedPage(title, {"id": page_id, "title": title, "text": prose} if len(prose) >= min_chars
                               else None))
    return out
