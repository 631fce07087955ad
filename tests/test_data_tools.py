"""tools/wikipedia_to_jsonl.py, tools/train_tokenizer.py, tools/make_demo_corpus.py, the sentence
splitter and the shipped SQuAD demo set."""
import bz2
import json
import os

import pytest

from megabert.data import build_tokenizer
from megabert.corpus.demo_corpus import stdlib_documents
from megabert.corpus.sentence_splitter import split_sentences

from tests.helpers.cli_utils import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARTICLE = """{{Infobox person|name=Ada
| born = 1815}}'''Ada Lovelace''' (1815 – 1852) was an [[England|English]] [[mathematician]].<ref>{{cite web|url=x}}</ref> She is known for the [[Analytical Engine]].
[[File:Ada.jpg|thumb|A portrait of [[Ada]]]]
== Life ==
* A list item that is not prose
{| class="wikitable"
|-
| cell || cell
|}
She died in [[London]].&nbsp;Her work was published in 1843. <!-- comment -->
== References ==
{{reflist}}
Reference prose that must not appear.
== External links ==
* [http://example.com Site]
[[Category:Mathematicians]]
[[de:Ada Lovelace]]"""


def page(pid, title, text, ns=0, redirect=False):
    red = '<redirect title="X" />' if redirect else ""
    return (f"<page><title>{title}</title><ns>{ns}</ns><id>{pid}</id>{red}<revision><id>99{pid}</id>"
            f"<text xml:space=\"preserve\">{text}</text></revision></page>")


def run_tool(name, *args):
    """tools/NAME's main() in process (cli_utils): the same parser and errors, no interpreter start-up."""
    return run_main(f"tools/{name}", *map(str, args))


def test_wikipedia_dump_to_jsonl(tmp_path):
    from xml.sax.saxutils import escape

    pages = [page(1, "Ada Lovelace", escape(ARTICLE)), page(2, "Talk:Ada", "talk " * 100, ns=1),
             page(3, "Lovelace", "#REDIRECT [[Ada Lovelace]]", redirect=True), page(4, "Stub", "Too short."),
             *[page(10 + i, f"Article {i}", escape(f"Article {i} is about [[topic]] {i}. " * 20)) for i in range(6)]]
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/"><siteinfo><sitename>W</sitename></siteinfo>'
           + "".join(pages) + "</mediawiki>")
    (tmp_path / "dump.xml.bz2").write_bytes(bz2.compress(xml.encode()))
    r = run_tool("wikipedia_to_jsonl.py", "--input", tmp_path / "dump.xml.bz2", "--output", tmp_path / "w.jsonl",
                 "--workers", "2", "--min-chars", "50")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()]
    assert [r["title"] for r in rows] == ["Ada Lovelace"] + [f"Article {i}" for i in range(6)]
    assert rows[0]["id"] == "1"
    assert rows[0]["text"] == ("Ada Lovelace (1815 – 1852) was an English mathematician. She is known for the "
                               "Analytical Engine.\nShe died in London. Her work was published in 1843.")
    assert "wrote 7 of 8 articles" in r.stdout and "(1 shorter than --min-chars, 0 unparsable)" in r.stdout
    r = run_tool("wikipedia_to_jsonl.py", "--input", tmp_path / "w.jsonl", "--output", tmp_path / "x.jsonl")
    assert r.returncode == 2 and "cannot read Wikipedia dump" in r.stderr and "Traceback" not in r.stderr


def test_unparsable_wikitext_is_counted_and_a_bug_is_not_swallowed(monkeypatch):
    from mwparserfromhell.parser import ParserError

    from megabert.corpus import wikipedia

    def clean(text):
        if text == "broken":
            raise ParserError("unbalanced markup")
        if text == "bug":
            raise TypeError("a bug in our cleaning code")
        return text

    monkeypatch.setattr(wikipedia, "clean_wikitext", clean)
    out = wikipedia.clean_pages([("1", "Good", "x" * 60), ("2", "Broken", "broken"), ("3", "Short", "x")], 50)
    assert [(p.title, p.article is not None, p.error is not None) for p in out] == [
        ("Good", True, False), ("Broken", False, True), ("Short", False, False)]
    assert out[1].error.startswith("ParserError") and "unbalanced markup" in out[1].error
    with pytest.raises(TypeError, match="a bug"):
        wikipedia.clean_pages([("4", "Bug", "bug")], 50)


def test_demo_corpus_and_tokenizer_training_tools(tmp_path):
    docs = list(stdlib_documents(max_documents=50))
    assert len(docs) == 50 and all(len(d.split()) >= 20 for d in docs)
    r = run_tool("make_demo_corpus.py", "--output", tmp_path / "c.jsonl", "--max-documents", "300")
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    assert len(lines) == 300 and json.loads(lines[0])["text"] == docs[0]
    r = run_tool("train_tokenizer.py", "--input", tmp_path / "c.jsonl", "--output", tmp_path / "vocab.txt",
                 "--vocab-size", "2000")
    assert r.returncode == 0, r.stderr
    tok = build_tokenizer("BertWordPieceLowerCase", str(tmp_path / "vocab.txt"))
    assert 1000 < tok.vocab_size <= 2000 and (tok.pad, tok.cls, tok.mask) == (0, 2, 4)
    assert tok.unk not in tok.tokenize("Return the value of the function.")
    r = run_tool("train_tokenizer.py", "--input", tmp_path / "c.jsonl", "--output", tmp_path / "spm",
                 "--vocab-size", "500", "--tokenizer-type", "SentencePieceTokenizer")
    assert r.returncode == 0, r.stderr
    assert build_tokenizer("SentencePieceTokenizer", str(tmp_path / "spm.model")).tokenize("the value")
    r = run_tool("train_tokenizer.py", "--input", tmp_path / "none.jsonl", "--output", tmp_path / "v2.txt")
    assert r.returncode == 2 and "does not exist" in r.stderr


@pytest.mark.parametrize("text,expected", [
    ("Mr. Smith arrived. He left at 3 p.m. on Monday!", ["Mr. Smith arrived.", "He left at 3 p.m. on Monday!"]),
    ("J. P. Morgan wrote it. \"Yes,\" she said.", ["J. P. Morgan wrote it.", "\"Yes,\" she said."]),
    ("Pi is 3.14 exactly? No. See e.g. Fig. 2 here.", ["Pi is 3.14 exactly?", "No.", "See e.g. Fig. 2 here."]),
    ("这是第一句。这是第二句！", ["这是第一句。", "这是第二句！"]),
    ("no ending\nsecond line. (Third one.)", ["no ending", "second line.", "(Third one.)"]),
    ("  \n ", []),
])
def test_sentence_splitter(text, expected):
    assert split_sentences(text) == expected


@pytest.mark.parametrize("name", ["train.json", "dev.json"])
def test_squad_demo_is_valid_v1_1(name):
    path = os.path.join(ROOT, "data", "squad_demo", name)
    data = json.load(open(path, encoding="utf-8"))
    assert data["version"] == "1.1"
    ids, questions = set(), 0
    for article in data["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                assert qa["id"] not in ids and qa["question"].endswith("?")
                ids.add(qa["id"])
                questions += 1
                for ans in qa["answers"]:
                    start = ans["answer_start"]
                    assert para["context"][start:start + len(ans["text"])] == ans["text"], qa["id"]
    assert questions >= 30
    assert os.path.getsize(path) < 200_000


def test_squad_demo_files_are_what_make_demo_squad_writes(tmp_path):
    """data/squad_demo/ is tools/make_demo_squad.py's output, byte for byte: an edit to one
    without re-running the other shows here."""
    r = run_tool("make_demo_squad.py", "--output", tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ("train.json", "dev.json"):
        with open(os.path.join(ROOT, "data", "squad_demo", name), "rb") as shipped:
            assert (tmp_path / name).read_bytes() == shipped.read(), name
