"""A rule-based sentence splitter that needs no downloaded model.

Megatron splits with nltk's punkt, whose trained parameters must be downloaded; these
machines cannot. BERT's sentence-pair objectives only need boundaries that are right
most of the time, so a few well-known rules do: a sentence ends at . ! ? or an
ellipsis (with any closing quotes or brackets) followed by whitespace and a capital,
digit or opening quote, unless the word before the period is a known abbreviation or
a single letter (an initial); CJK full stops end a sentence without a space; a line
break always ends one.
"""
from __future__ import annotations

import re

# Lower-cased, without the final period. Titles, Latin, months, units and corporate suffixes:
# the abbreviations that most often stand before a capitalised word in encyclopedic text.
ABBREVIATIONS = frozenset("""
mr mrs ms dr prof sr jr st mt ft rev gen col lt sgt capt cmdr adm gov pres sen rep hon messrs mme mlle
e.g i.e etc vs viz cf al approx ca c esp incl dept univ assn bros inc ltd co corp plc llc
jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun ed eds
u.s u.k u.n a.m p.m b.c a.d ph.d b.a m.a b.sc m.sc d.c
""".split())
# Abbreviations only before a number ("No. 5", "Fig. 2"): "No. See ..." is a sentence that ends.
NUMBER_ABBREVIATIONS = frozenset("no nos vol vols fig figs pp p ch sec op art arts".split())

# A candidate end: . ! ? or an ellipsis with any closing quotes/brackets, before whitespace and the next
# sentence's first character (group 1, checked in Python: str.isupper/isdigit know every script);
# or CJK 。！？, which need no space after them.
_BOUNDARY = re.compile(
    r"""(?:[.!?]+|\u2026)["'\u201d\u2019)\]]*(?=\s+["'\u201c\u2018(\[]*(\S))"""
    r"""|[\u3002\uff01\uff1f]+["'\u201d\u2019\u300d\u300f)\]]*""",
)
_WORD_BEFORE = re.compile(r"(\S+)$")


def _is_abbreviation(text: str, end: int, following: str) -> bool:
    """Whether the period at text[end] closes an abbreviation or an initial."""
    m = _WORD_BEFORE.search(text, max(0, end - 24), end)  # no abbreviation is longer
    if m is None:
        return False
    word = m.group(1).lstrip("\"'(\u201c\u2018[").lower()
    if word in NUMBER_ABBREVIATIONS and following.isdigit():
        return True
    return (len(word) == 1 and word.isalpha()) or word in ABBREVIATIONS


def split_sentences(text: str) -> list[str]:
    """The sentences of `text`, stripped, none empty, in order."""
    out = []
    for line in text.splitlines():
        start = 0
        for m in _BOUNDARY.finditer(line):
            following = m.group(1)
            if following is None:  # a CJK full stop
                pass
            elif not (following.isupper() or following.isdigit()):
                continue
            elif (m.group(0)[0] == "." and len(m.group(0).rstrip("\"'\u201d\u2019)]")) == 1
                    and _is_abbreviation(line, m.start(), following)):
                continue
            sentence = line[start:m.end()].strip()
            if sentence:
                out.append(sentence)
            start = m.end()
        rest = line[start:].strip()
        if rest:
            out.append(rest)
    return out
