"""tools/preprocess_data.py and tools/merge_datasets.py: Megatron-identical output, compressed
inputs, workers, and malformed records reported by line, never as a traceback."""
import gzip
import json
import os

import numpy as np
import pytest

from megabert.data import IndexedDataset, build_tokenizer
from megabert.corpus.preprocess import EncodeOptions, preprocess
from megabert.corpus.sentence_splitter import split_sentences
from megabert.corpus.tokenizer_training import train_wordpiece

from tests.helpers.cli_utils import run_main


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [
    "The first document has two sentences. This is the second one!",
    "Dr. Smith arrived at 3 p.m. on Monday. He left at noon? Nobody knows.\nA new paragraph starts here.",
    "A single sentence without an ending",
    "Unicode: café, naïve, 東京は日本の首都です。北京是中国的首都。 Emoji 😀 too.",
    "\x07\x00",  # only control characters: one empty document, as Megatron writes it
] * 30


def run_tool(name, *args):
    """tools/NAME's main() in process (cli_utils): the same parser and errors, no interpreter start-up."""
    return run_main(f"tools/{name}", *map(str, args))


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    return train_wordpiece(TEXTS, str(path), vocab_size=400, min_frequency=1)


def write_jsonl(path, texts, bad_lines=()):
    """Good records, with malformed lines inserted at the given positions (1-based line numbers)."""
    bad = dict(bad_lines)
    lines, it = [], iter(texts)
    for n in range(1, len(texts) + len(bad) + 1):
        lines.append(bad[n] if n in bad else json.dumps({"text": next(it), "id": n}).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def reference_dataset(prefix, texts, vocab, split, eod=False):
    """What Megatron's pipeline writes: transformers' BertTokenizer + megatron-core's builder."""
    import transformers
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    hf = transformers.BertTokenizer(vocab, do_lower_case=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for text in texts:
        ids, lens = [], []
        for sentence in (split_sentences(text) if split else [text]):
            s = hf(sentence, add_special_tokens=False)["input_ids"]
            if s:
                ids += s
                lens.append(len(s))
        if ids and eod:
            ids.append(hf.sep_token_id)
            lens[-1] += 1
        builder.add_document(np.array(ids, dtype=np.int64), lens)
    builder.finalize(prefix + ".idx")


def _same_files(a, b):
    return all(open(a + ext, "rb").read() == open(b + ext, "rb").read() for ext in (".bin", ".idx"))


@pytest.mark.parametrize("split,eod", [(True, False), (False, True)])
def test_byte_identical_to_megatron_pipeline(tmp_path, vocab, split, eod):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    opts = EncodeOptions("BertWordPieceLowerCase", vocab, ("text",), split, eod)
    stats = preprocess(str(src), str(tmp_path / "ours"), opts, workers=2, block_bytes=700)
    reference_dataset(str(tmp_path / "ref"), TEXTS, vocab, split, eod)
    assert stats.documents == len(TEXTS) and stats.skipped == 0
    assert _same_files(stats.outputs[0], str(tmp_path / "ref"))
    assert stats.outputs[0].endswith("ours_text_sentence" if split else "ours_text_document")


def test_compressed_text_and_worker_counts_agree(tmp_path, vocab):
    import zstandard

    raw = write_jsonl(tmp_path / "in.jsonl", TEXTS).read_bytes()
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "in.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    # Plain text: one document per paragraph; a document's own line breaks become single newlines.
    paragraphs = [t.replace("\n", " ") for t in TEXTS if t.strip("\x07\x00")]
    (tmp_path / "in.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    jsonl_par = write_jsonl(tmp_path / "par.jsonl", paragraphs)
    opts = EncodeOptions("BertWordPieceLowerCase", vocab, ("text",), True)
    out = {}
    for name, workers in [("in.jsonl", 1), ("in.jsonl", 2), ("in.jsonl.gz", 2), ("in.jsonl.zst", 1),
                          ("in.txt", 2), ("par.jsonl", 1)]:
        prefix = str(tmp_path / f"{name}-{workers}")
        out[name, workers] = preprocess(str(tmp_path / name), prefix, opts, workers=workers,
                                        block_bytes=512).outputs[0]
    base = out["in.jsonl", 1]
    for key in [("in.jsonl", 2), ("in.jsonl.gz", 2), ("in.jsonl.zst", 1)]:
        assert _same_files(base, out[key]), key
    assert _same_files(out["in.txt", 2], out["par.jsonl", 1])
    assert jsonl_par.exists()


def test_cli_skips_malformed_lines_with_line_numbers(tmp_path, vocab):
    bad = {2: b"{not json", 4: json.dumps({"body": "no text key"}).encode(), 5: b'{"text": "bad \xff\xfe utf8"}',
           7: json.dumps({"text": "   "}).encode(), 9: b"[1, 2]", 10: b""}
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS[:10], bad)
    r = run_tool("preprocess_data.py", "--input", src, "--output-prefix", tmp_path / "out", "--vocab-file", vocab,
                 "--split-sentences", "--workers", "2", "--log-interval", "5")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "skipped 6 of 16 records" in r.stderr
    for n, words in [(2, "bad JSON"), (4, "missing key 'text'"), (5, "invalid UTF-8 at byte"), (7, "empty 'text'"),
                     (9, "not a JSON object"), (10, "empty line")]:
        assert f"line {n}: {words}" in r.stderr, r.stderr
    assert "docs/s" in r.stderr and "MB/s" in r.stderr
    ds = IndexedDataset(str(tmp_path / "out_text_sentence"))
    tok = build_tokenizer("BertWordPieceLowerCase", vocab)
    assert ds.num_documents == 10
    assert ds.document(0)[1].tolist() == tok.tokenize("This is the second one!")


def test_cli_strict_stops_at_the_line(tmp_path, vocab):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS[:5], {3: b"{oops"})
    r = run_tool("preprocess_data.py", "--input", src, "--output-prefix", tmp_path / "out", "--vocab-file", vocab,
                 "--strict")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "in.jsonl line 3: bad JSON" in r.stderr
    assert not list(tmp_path.glob("out*"))  # no half-written dataset left behind


@pytest.mark.parametrize("case,words", [
    ("all-bad", "holds no usable document"),
    ("no-input", "does not exist"),
    ("no-vocab", "--vocab-file"),
])
def test_cli_errors_are_one_line(tmp_path, vocab, case, words):
    src = write_jsonl(tmp_path / "in.jsonl", [], {1: b"{", 2: b"{}"})
    args = {"all-bad": [src, vocab], "no-input": [tmp_path / "missing.jsonl", vocab],
            "no-vocab": [src, tmp_path / "missing.txt"]}[case]
    argv = ["--input", args[0], "--output-prefix", tmp_path / "o", "--vocab-file", args[1]]
    # The missing files fail before any worker starts: in process (cli_utils); the rest, the command line.
    r = run_tool("preprocess_data.py", *argv) if case == "all-bad" else \
        run_main("tools/preprocess_data.py", *map(str, argv))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert words in r.stderr.strip().splitlines()[-1]


def test_merge_datasets(tmp_path, vocab):
    opts = EncodeOptions("BertWordPieceLowerCase", vocab, ("text",), True)
    parts = []
    for i, texts in enumerate([TEXTS[:7], TEXTS[7:20]]):
        src = write_jsonl(tmp_path / f"p{i}.jsonl", texts)
        parts.append(preprocess(str(src), str(tmp_path / "shards" / f"p{i}"), opts).outputs[0])
    whole = preprocess(str(write_jsonl(tmp_path / "all.jsonl", TEXTS[:20])), str(tmp_path / "all"), opts).outputs[0]
    r = run_tool("merge_datasets.py", "--input", tmp_path / "shards", "--output-prefix", tmp_path / "merged")
    assert r.returncode == 0, r.stderr
    assert _same_files(str(tmp_path / "merged"), whole)
    r = run_tool("merge_datasets.py", "--input", tmp_path / "nothing", "--output-prefix", tmp_path / "m2")
    assert r.returncode == 2 and "must both exist" in r.stderr
