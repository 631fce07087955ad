"""tools/train_tokenizer.py gives the same files for the same corpus on every run (issue 51:
the `tokenizers` trainer's ties went by hash order, two runs differed in 584 of 8,000 vocab
lines), WordPiece and byte-level BPE alike; the BPE's tokenizer.json reads in megabert and in
transformers; preprocess_data.py --split-sentences keeps the space between sentences for it."""
import json
import os
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from megabert.corpus.bpe_merges import alphabet_of, learn_merges
from megabert.data import build_tokenizer
from megabert.data.indexed_dataset import IndexedDataset

from tests.helpers.cli_utils import ROOT, run_main

WORDS = ("the quick brown fox jumps over lazy dog tokenizer merges pairs ties counts words alpha beta gamma delta "
         "epsilon zeta theta iota kappa lambda sigma omega 1999 2024 naïve café").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    rng = random.Random(0)
    with open(d / "corpus.jsonl", "w") as f:
        for _ in range(200):
            sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                     for _ in range(rng.randint(2, 5))]
            f.write(json.dumps({"text": " ".join(sents)}) + "\n")
    return d


TRAINING = (["--output", "vocab.txt", "--vocab-size", "120", "--min-frequency", "1"],
            ["--output", "bpe", "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-size", "400", "--min-frequency",
             "1"])


def _train(corpus, out, hash_seed=None):
    """Both trainers on `corpus` into `out`: in this process, or (`hash_seed`) in a fresh
    interpreter with other hash seeds (Python's and Rust's)."""
    argvs = [["--input", str(corpus / "corpus.jsonl")] + [str(out / a) if a in ("vocab.txt", "bpe") else a
                                                          for a in argv] for argv in TRAINING]
    if hash_seed is None:
        for argv in argvs:
            r = run_main("tools/train_tokenizer.py", *argv)
            assert r.returncode == 0, r.stderr
        return
    tool = os.path.join(ROOT, "tools", "train_tokenizer.py")
    script = ("import runpy, sys\n"
              f"for argv in {argvs!r}:\n"
              f"    sys.argv = [{tool!r}] + argv\n"
              "    try:\n"
              f"        runpy.run_path({tool!r}, run_name='__main__')\n"
              "    except SystemExit as e:\n"
              "        assert not e.code, e.code\n")
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_two_runs_write_the_same_bytes(corpus, tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    _train(corpus, tmp_path / "1")
    _train(corpus, tmp_path / "2", hash_seed=int(os.environ.get("PYTHONHASHSEED") or 0) + 1)
    for name in ("vocab.txt", "bpe/tokenizer.json", "bpe/tokenizer_config.json"):
        a, b = (open(tmp_path / s / name, "rb").read() for s in ("1", "2"))
        assert a == b, name
    vocab = open(tmp_path / "1" / "vocab.txt").read().splitlines()
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and len(vocab) == 120
    assert len(set(vocab)) == 120 and any(t.startswith("##") for t in vocab)

    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "1" / "bpe"))
    assert (tok.pad, tok.unk, tok.cls, tok.sep, tok.mask) == (0, 1, 2, 3, 4) and tok.vocab_size == 400
    assert tok.byte_level
    text = "The quick café fox, naïve 2024."
    assert tok.detokenize(tok.tokenize(text)) == text
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "1" / "bpe"))
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.tokenize(text)
    assert hf("a b", "c")["input_ids"][0] == tok.cls and hf.mask_token_id == tok.mask


def test_roberta_style_special_tokens(corpus, tmp_path):
    r = run_main("tools/train_tokenizer.py", "--input", str(corpus / "corpus.jsonl"), "--output", str(tmp_path / "t"),
                 "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-size", "300", "--special-tokens-style", "roberta")
    assert r.returncode == 0, r.stderr
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "t"))
    assert [tok.inv_vocab[i] for i in (tok.cls, tok.pad, tok.sep, tok.unk, tok.mask)] == \
        ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    config = json.load(open(tmp_path / "t" / "tokenizer_config.json"))
    assert (config["bos_token"], config["mask_token"]) == ("<s>", "<mask>")
    (tmp_path / "file").write_text("")
    r = run_main("tools/train_tokenizer.py", "--input", str(corpus / "corpus.jsonl"), "--output",
                 str(tmp_path / "file"), "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-size", "300")
    assert r.returncode != 0 and "is a file" in r.stderr.strip().splitlines()[-1]


def test_ties_go_to_the_smallest_pair():
    # ("a", "##b") and ("c", "##d") occur 3 times each: the lexicographically smaller merges first,
    # whatever order the words come in.
    for words in (Counter({"ab": 3, "cd": 3}), Counter({"cd": 3, "ab": 3})):
        vocab, merges = learn_merges(words, alphabet_of(words, None), 10, specials=["[UNK]"], prefix="##")
        assert merges == [("a", "##b"), ("c", "##d")]
        assert vocab == ["[UNK]", "a", "b", "c", "d", "##b", "##d", "ab", "cd"]
    words = Counter({"aaaa": 2, "ab": 1})
    vocab, merges = learn_merges(words, alphabet_of(words, 1), 10, specials=[])
    assert vocab == ["a", "aa", "aaaa"] and merges == [("a", "a"), ("aa", "aa")]  # "b" past --limit-alphabet 1


def test_split_sentences_keeps_the_space_for_byte_level(corpus, tmp_path):
    r = run_main("tools/train_tokenizer.py", "--input", str(corpus / "corpus.jsonl"), "--output", str(tmp_path / "t"),
                 "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-size", "400")
    assert r.returncode == 0, r.stderr
    (tmp_path / "doc.jsonl").write_text(json.dumps({"text": "The fox jumps. The dog sleeps.\nAlpha beta."}) + "\n")
    r = run_main("tools/preprocess_data.py", "--input", str(tmp_path / "doc.jsonl"), "--output-prefix",
                 str(tmp_path / "p"), "--json-keys", "text", "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", str(tmp_path / "t"), "--split-sentences", "--workers", "1")
    assert r.returncode == 0, r.stderr
    ds = IndexedDataset(str(tmp_path / "p_text_sentence"))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "t"))
    assert ds.num_documents == 1 and len(ds) == 3
    joined = np.concatenate([ds[i] for i in range(3)]).tolist()
    assert tok.detokenize(joined) == "The fox jumps. The dog sleeps. Alpha beta."  # before: "jumps.The"
