"""SQuAD's data path: features (windows, answer tokens, equal to transformers' tokenizer),
post-processing, the official evaluation on hand-computed cases, and the reader's one-line
errors. finetune_squad.py end to end: tests/test_squad.py."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megabert.corpus.tokenizer_training import BERT_SPECIALS
from megabert.data import build_tokenizer
from megabert.errors import ConfigError, DataError
from megabert.tasks.squad.evaluate import evaluate, normalize_answer
from megabert.tasks.squad.examples import SquadExample, read_squad_examples
from megabert.tasks.squad.features import convert_examples_to_features, window_starts
from megabert.tasks.squad.postprocess import postprocess_predictions

from tests.helpers.squad_demo import DEMO, train_demo_vocab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = [f"w{i}" for i in range(100)]


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """One token per word w0..w99: positions are easy to check by hand."""
    path = tmp_path_factory.mktemp("words") / "vocab.txt"
    path.write_text("\n".join(BERT_SPECIALS + ["where", "is", "?"] + WORDS) + "\n")
    return build_tokenizer("BertWordPieceLowerCase", str(path))


@pytest.fixture(scope="module")
def demo_vocab(tmp_path_factory):
    return train_demo_vocab(str(tmp_path_factory.mktemp("demo_vocab") / "vocab.txt"))


def long_example(answer_first=35, answer_len=3, impossible=False):
    context = " ".join(WORDS[:80])
    start = context.index(f"w{answer_first} ")
    text = " ".join(WORDS[answer_first:answer_first + answer_len])
    return SquadExample("q1", "where is w41 ?", context, [] if impossible else [(text, start)], impossible)


def test_windows_and_answer_tokens_with_doc_stride(word_tokenizer):
    # 32 tokens - 4 question tokens - 3 specials = 25 context tokens per window, 10 overlapping.
    ex = long_example()
    feats = convert_examples_to_features([ex], word_tokenizer, max_seq_length=32, doc_stride=10, max_query_length=8,
                                         is_training=True)
    vocab = word_tokenizer.vocab
    assert window_starts(80, 25, 10) == [0, 15, 30, 45, 60]
    assert len(feats) == 5
    holding = []
    for k, f in enumerate(feats):
        first_word = 15 * k
        n = min(25, 80 - first_word)
        assert f.input_ids[:6] == [vocab["[CLS]"], vocab["where"], vocab["is"], vocab["w41"], vocab["?"], vocab["[SEP]"]]
        assert f.input_ids[6:6 + n + 1] == [vocab[f"w{i}"] for i in range(first_word, first_word + n)] + [vocab["[SEP]"]]
        assert f.token_type_ids[:6] == [0] * 6 and f.token_type_ids[6] == 1
        if first_word <= 35 and 37 < first_word + 25:  # the answer w35 w36 w37 sits at 6 + (35 - first_word)
            holding.append(k)
            assert (f.start_position, f.end_position) == (6 + 35 - first_word, 8 + 35 - first_word)
            assert f.input_ids[f.start_position] == vocab["w35"] and f.input_ids[f.end_position] == vocab["w37"]
        else:
            assert (f.start_position, f.end_position) == (0, 0)  # [CLS]
    assert holding == [1, 2]
    last = feats[-1]  # w60..w79, [SEP], padding
    assert sum(last.attention_mask) == 6 + 20 + 1 and last.input_ids[-1] == vocab["[PAD]"]
    assert last.token_type_ids[26] == 1 and last.token_type_ids[27] == 0
    # An answer cut by a window boundary (w28..w32 with windows [15, 40) and [30, 55)) is in one window only.
    cut = convert_examples_to_features([long_example(28, 5)], word_tokenizer, max_seq_length=32, doc_stride=10,
                                       max_query_length=8, is_training=True)
    assert [(f.start_position, f.end_position) for f in cut] == [(0, 0), (6 + 13, 6 + 17), (0, 0), (0, 0), (0, 0)]
    impossible = convert_examples_to_features([long_example(impossible=True)], word_tokenizer, max_seq_length=32,
                                              doc_stride=10, max_query_length=8, is_training=True)
    assert all((f.start_position, f.end_position) == (0, 0) for f in impossible)
    # The question is cut to --max-query-length tokens.
    short_q = convert_examples_to_features([ex], word_tokenizer, max_seq_length=32, doc_stride=10, max_query_length=2,
                                           is_training=False)
    assert short_q[0].input_ids[:4] == [vocab["[CLS]"], vocab["where"], vocab["is"], vocab["[SEP]"]]
    with pytest.raises(ConfigError, match="--doc-stride"):
        window_starts(80, 25, 25)


def test_features_equal_transformers_tokenizer(demo_vocab):
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertTokenizerFast(demo_vocab, do_lower_case=True)
    tok = build_tokenizer("BertWordPieceLowerCase", demo_vocab)
    examples = read_squad_examples(os.path.join(DEMO, "train.json"), is_training=True)[:30]
    windows = 0
    for ex in examples:
        feats = convert_examples_to_features([ex], tok, max_seq_length=48, doc_stride=12, max_query_length=64,
                                             is_training=True)
        enc = hf(ex.question, ex.context, truncation="only_second", max_length=48, stride=12,
                 return_overflowing_tokens=True, padding="max_length", return_offsets_mapping=True)
        assert len(feats) == len(enc["input_ids"]) > 1
        for f, ids, types, mask in zip(feats, enc["input_ids"], enc["token_type_ids"], enc["attention_mask"]):
            assert (f.input_ids, f.token_type_ids, f.attention_mask) == (ids, types, mask)
            windows += 1
            if f.start_position:  # the labelled span's characters are the answer
                text = ex.context[f.offsets[f.start_position][0]:f.offsets[f.end_position][1]]
                assert text == ex.answers[0][0]
    assert windows > 60


def _logits(feats, spans):
    """Start/end logits (-100 elsewhere) that favour each (feature, start, end) in `spans`."""
    start = np.full((len(feats), 32), -100.0, np.float32)
    end = np.full((len(feats), 32), -100.0, np.float32)
    for k, s, e, score in spans:
        start[k, s] = end[k, e] = score
    return start, end


def test_postprocess_picks_gold_span(word_tokenizer):
    ex = long_example(40)
    ex.context = ex.context.replace("w40 w41 w42", "W40 w41, W42")  # text comes from the context itself
    ex.answers = []
    feats = convert_examples_to_features([ex], word_tokenizer, max_seq_length=32, doc_stride=10, max_query_length=8,
                                         is_training=False)
    # Window 1 holds words 15..39 at positions 6..30; window 2 holds words 30..54.
    gold = (2, 6 + 10, 6 + 13)  # W40 .. W42 (the comma is a token of its own)
    start, end = _logits(feats, [(2, gold[1], gold[2], 5.0),
                                 (0, 2, 3, 50.0),    # question tokens: never an answer
                                 (1, 20, 10, 20.0),  # end before start
                                 (3, 6, 6 + 24, 30.0)])  # longer than --max-answer-length
    preds, nbest, _ = postprocess_predictions([ex], feats, start, end, n_best_size=20, max_answer_length=10)
    assert preds == {"q1": "W40 w41, W42"}
    assert nbest["q1"][0]["text"] == "W40 w41, W42" and nbest["q1"][0]["probability"] > 0.5
    assert len({c["text"] for c in nbest["q1"]}) == len(nbest["q1"]) <= 20
    # SQuAD 2.0: the null answer wins when [CLS] outscores the best span by more than the threshold.
    start[:, 0] = end[:, 0] = 3.0  # null score 6 vs span 10 (+ tiny others)
    preds, nbest, odds = postprocess_predictions([ex], feats, start, end, max_answer_length=10,
                                                 version_2_with_negative=True)
    assert preds == {"q1": "W40 w41, W42"} and odds["q1"] == pytest.approx(-4.0)
    assert [(c["start_logit"], c["end_logit"]) for c in nbest["q1"] if c["text"] == ""] == [(3.0, 3.0)]
    preds, _, _ = postprocess_predictions([ex], feats, start, end, max_answer_length=10,
                                          version_2_with_negative=True, null_score_diff_threshold=-5.0)
    assert preds == {"q1": ""}
    start[:, 0] = end[:, 0] = 6.0
    preds, _, _ = postprocess_predictions([ex], feats, start, end, max_answer_length=10, version_2_with_negative=True)
    assert preds == {"q1": ""}


def _squad(qas, version="1.1"):
    return {"version": version, "data": [{"title": "t", "paragraphs": [{"context": "c", "qas": qas}]}]}


def _qa(qid, *golds, impossible=None):
    qa = {"id": qid, "question": "?", "answers": [{"text": g, "answer_start": 0} for g in golds]}
    if impossible is not None:
        qa["is_impossible"] = impossible
    return qa


def test_official_evaluation_by_hand(tmp_path):
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert normalize_answer("an apple-a-day theatre") == "appleaday theatre"  # punctuation goes before articles
    v1 = _squad([_qa("a", "the cat", "a dog"), _qa("b", "big red ball"), _qa("c", "x")])
    # a: "Cat." matches "the cat" exactly; b: 2 of 3 tokens each way -> F1 2/3; c: no prediction -> 0.
    result = evaluate(v1, {"a": "Cat.", "b": "red ball game"}, warn=None)
    assert result == pytest.approx({"exact_match": 100 / 3, "f1": 100 * (1 + 2 / 3) / 3})
    assert list(result) == ["exact_match", "f1"]
    with pytest.raises(DataError, match="question z has no gold answer"):
        evaluate(_squad([_qa("z")]), {"z": ""}, version="1.1")
    v2 = _squad([_qa("p", "Paris", impossible=False), _qa("n1", impossible=True), _qa("n2", impossible=True),
                 _qa("h", "New York City", "the", impossible=False)], version="v2.0")
    # p exact; n1 "" on no answer = 1; n2 answers an unanswerable = 0; h: "York" P=1 R=1/3 -> F1 0.5
    # (the gold "the" normalises to "" and is dropped).
    result = evaluate(v2, {"p": "paris", "n1": "", "n2": "London", "h": "York"}, warn=None)
    assert list(result) == ["exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total", "NoAns_exact",
                            "NoAns_f1", "NoAns_total"]
    assert result == pytest.approx({"exact": 50.0, "f1": 62.5, "total": 4, "HasAns_exact": 50.0, "HasAns_f1": 75.0,
                                    "HasAns_total": 2, "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2})
    data, preds = tmp_path / "data.json", tmp_path / "preds.json"
    data.write_text(json.dumps(v1))
    preds.write_text(json.dumps({"a": "Cat.", "b": "red ball game", "c": "x"}))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "squad_evaluate.py"), str(data), str(preds)],
                       capture_output=True, text=True, check=True)
    assert json.loads(r.stdout) == pytest.approx({"exact_match": 200 / 3, "f1": 100 * (2 + 2 / 3) / 3})


def test_reader_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="missing.json does not exist"):
        read_squad_examples(str(tmp_path / "missing.json"), is_training=True)
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": [')
    with pytest.raises(DataError, match="bad.json is not valid JSON"):
        read_squad_examples(str(bad), is_training=True)
    bad.write_text('{"data": [{"paragraphs": [{"qas": []}]}]}')
    with pytest.raises(DataError, match="bad.json: article 0, paragraph 0 has no valid \"context\""):
        read_squad_examples(str(bad), is_training=True)
    bad.write_text(json.dumps(_squad([_qa("n", impossible=True)], "v2.0")))
    with pytest.raises(DataError, match="--version-2-with-negative"):
        read_squad_examples(str(bad), is_training=True)
    assert read_squad_examples(str(bad), is_training=True, version_2_with_negative=True)[0].answer_span is None


# ---------------------------------------------------------------- finetune_squad.py
