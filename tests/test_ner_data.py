"""Token classification's data (finetune_ner.py): the readers, features against run_ner.py's
(transformers' tokenizer with is_split_into_words), windows that reassemble every word, and
seqeval's numbers on a hand-made file (ours against seqeval directly)."""
import json
import random

import numpy as np
import pytest
import torch

from megabert.data import build_tokenizer
from megabert.errors import DataError
from megabert.tasks.ner.data import Sentence, label_set, read_sentences
from megabert.tasks.ner.features import best_window, sentences_to_features, window_starts, word_logits
from megabert.tasks.ner.finetuning import eval_results
from megabert.tasks.ner.metrics import ner_metrics

from tests.helpers.ner_files import FILLER, conll, tagged_sentences, write, write_vocab

transformers = pytest.importorskip("transformers")
seqeval_metrics = pytest.importorskip("seqeval.metrics")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


# ---------------------------------------------------------------- data and features


def test_conll_and_json_lines_read_alike(tmp_path):
    sentences = tagged_sentences(random.Random(0), 5)
    a = read_sentences(write(tmp_path / "a.txt", conll(sentences)))
    jsonl = "\n".join(json.dumps({"id": i, "tokens": s.words, "ner_tags": s.tags}) for i, s in enumerate(sentences))
    b = read_sentences(write(tmp_path / "b.json", jsonl + "\n"))
    assert a == b == sentences
    # Two -DOCSTART- documents, blank lines doubled, a tab-separated two-column line, no final blank line.
    c = read_sentences(write(tmp_path / "c.txt", "-DOCSTART- O\n\nEU B-ORG\nrejects O\n\n\n-DOCSTART- O\n\n"
                                                   "Peter\tB-PER\nBlackburn\tI-PER"))
    assert c == [Sentence(("EU", "rejects"), ("B-ORG", "O")), Sentence(("Peter", "Blackburn"), ("B-PER", "I-PER"))]
    assert label_set(c) == ("B-ORG", "B-PER", "I-PER", "O")
    # A test file may give the tokens alone.
    assert read_sentences(write(tmp_path / "t.txt", "EU\nrejects\n"), labelled=False) == \
        [Sentence(("EU", "rejects"), None)]


@pytest.mark.parametrize("name, text, message", [
    ("bad.txt", "EU B-ORG\nrejects\n", "bad.txt:2: the token 'rejects' has no tag"),
    ("ids.json", '{"tokens": ["EU"], "ner_tags": [3]}\n', "ids.json:1: \"ner_tags\" holds class ids"),
    ("short.json", '{"tokens": ["EU", "x"], "ner_tags": ["O"]}\n', "one tag per token (2 tokens)"),
    ("empty.txt", "-DOCSTART- O\n\n", "holds no sentences"),
])
def test_bad_files_are_named(tmp_path, name, text, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_sentences(write(tmp_path / name, text))


def test_features_equal_run_ner(vocab):
    """Short sentences: input ids and labels as run_ner.py's tokenize_and_align_labels makes
    them with transformers' tokenizer (first sub-word labelled; with label_all_tokens every
    sub-word, B-X as I-X after the first)."""
    tok = transformers.BertTokenizerFast(vocab, do_lower_case=True)
    sentences = tagged_sentences(random.Random(1), 20)
    labels = label_set(sentences)
    label2id = {t: i for i, t in enumerate(labels)}
    b_to_i = [labels.index("I-" + t[2:]) if t.startswith("B-") and "I-" + t[2:] in labels else i
              for i, t in enumerate(labels)]
    ours = build_tokenizer("BertWordPieceLowerCase", vocab)
    for all_tokens in (False, True):
        got = sentences_to_features(sentences, ours, 32, label2id=label2id, label_all_tokens=all_tokens)
        assert len(got.windows) == len(sentences)
        for i, s in enumerate(sentences):
            enc = tok(list(s.words), is_split_into_words=True, padding="max_length", max_length=32, truncation=True)
            ref, previous = [], None
            for word in enc.word_ids():
                if word is None:
                    ref.append(-100)
                elif word != previous:
                    ref.append(label2id[s.tags[word]])
                else:
                    ref.append(b_to_i[label2id[s.tags[word]]] if all_tokens else -100)
                previous = word
            assert got.tensors["input_ids"][i].tolist() == enc["input_ids"]
            assert got.tensors["attention_mask"][i].tolist() == enc["attention_mask"]
            assert got.tensors["labels"][i].tolist() == ref


def test_windows_reassemble_every_word(vocab):
    """Sentences up to 12 windows long, with words of up to 40 sub-words (longer than a
    window): each window is [CLS] + a slice of the sentence's sub-words + [SEP]; every word
    is owned by exactly one window, at its first sub-word, the window where it has the most
    context on its shorter side; and reading the logits back gives each word its own (or,
    by default, the mean of its probabilities over every window that holds it)."""
    tok = build_tokenizer("BertWordPieceLowerCase", vocab)
    rng = random.Random(2)
    sentences = []
    for _ in range(30):
        words = [rng.choice(FILLER) if rng.random() < 0.7 else "alice" + "zz" * rng.randint(1, 40)
                 for _ in range(rng.randint(1, 60))]
        sentences.append(Sentence(tuple(words), ("O",) * len(words)))
    pieces = [[tok.tokenize(w) for w in s.words] for s in sentences]
    for max_seq, overlap in ((8, None), (8, 0), (12, 9), (16, 5), (64, None)):
        length = max_seq - 2
        features = sentences_to_features(sentences, tok, max_seq, overlap=overlap)
        owners = {}
        for f, window in enumerate(features.windows):
            ids = [t for p in pieces[window.sentence] for t in p]
            row = features.tensors["input_ids"][f]
            assert row[:window.length + 2].tolist() == [tok.cls, *ids[window.start:window.start + window.length],
                                                          tok.sep]
            assert 0 < window.length <= length and features.tensors["attention_mask"][f].sum() == window.length + 2
            for position, word in window.owned:
                assert (window.sentence, word) not in owners
                owners[window.sentence, word] = (f, position)
        for i, p in enumerate(pieces):
            n = sum(map(len, p))
            mine = [f for f, w in enumerate(features.windows) if w.sentence == i]
            spans = [(features.windows[f].start, features.windows[f].length) for f in mine]
            starts = [s for s, _ in spans]
            assert starts == window_starts(n, length, 3 * length // 4 if overlap is None else overlap)
            assert starts[0] == 0 and starts[-1] + spans[-1][1] == n  # the whole sentence, in order
            first = 0
            for w, word_pieces in enumerate(p):
                f, position = owners[i, w]
                window = features.windows[f]
                assert window.start + position - 1 == first  # its first sub-word ([CLS] at 0)
                ctx = [min(first - s, s + m - 1 - first) for s, m in spans if s <= first < s + m]
                assert min(first - window.start, window.start + window.length - 1 - first) == max(ctx)
                assert mine[best_window(first, starts, [m for _, m in spans])] == f
                first += len(word_pieces)
        # Logits that encode (window, position) come back to each word from its owner.
        n = len(features.windows)
        logits = np.zeros((n, max_seq, 2), np.float32)
        logits[..., 0] = np.arange(n)[:, None]
        logits[..., 1] = np.arange(max_seq)[None, :]
        back = word_logits(features, logits, [len(s.words) for s in sentences], "max-context")
        for (i, w), (f, position) in owners.items():
            assert back[i][w].tolist() == [f, position]
        assert sum(len(x) for x in back) == len(owners)
        # --predict-windows mean: the log of the tag probabilities averaged over every window
        # whose span holds the word's first sub-word (found here from the spans alone).
        logits = np.random.default_rng(max_seq).normal(size=(n, max_seq, 3)).astype(np.float32) * 3
        mean = word_logits(features, logits, [len(s.words) for s in sentences], "mean")
        for i, p in enumerate(pieces):
            first = 0
            for w, word_pieces in enumerate(p):
                held = [(f, first - x.start + 1) for f, x in enumerate(features.windows)
                        if x.sentence == i and x.start <= first < x.start + x.length]
                probs = [torch.softmax(torch.from_numpy(logits[f, position]).double(), -1) for f, position in held]
                assert mean[i][w] == pytest.approx(torch.stack(probs).mean(0).log().numpy(), abs=1e-5)
                first += len(word_pieces)


def test_mean_prediction_outvotes_the_most_central_window(vocab):
    """A word in three windows: the window where it sits most central leans to tag 0, the
    two others are sure of tag 1. "mean" (the default) predicts 1, "max-context" 0."""
    tok = build_tokenizer("BertWordPieceLowerCase", vocab)
    sentence = Sentence(tuple([FILLER[1]] * 12), ("O",) * 12)
    features = sentences_to_features([sentence], tok, 8, overlap=4)  # windows of 6 at 0, 2, 4, 6
    word, first = 5, 5
    held = [(f, first - x.start + 1) for f, x in enumerate(features.windows) if x.start <= first < x.start + x.length]
    assert len(held) == 3
    logits = np.zeros((len(features.windows), 8, 2), np.float32)
    (owner, at), = [(f, p) for f, x in enumerate(features.windows) for p, w in x.owned if w == word]
    for f, position in held:
        logits[f, position] = [0.5, 0.0] if f == owner else [0.0, 4.0]
    assert (owner, at) in held
    assert word_logits(features, logits, [12])[0][word].argmax() == 1
    assert word_logits(features, logits, [12], "max-context")[0][word].argmax() == 0


# ---------------------------------------------------------------- metrics

GOLD = """-DOCSTART- -X- O

John B-PER
Smith I-PER
lives O
in O
New B-LOC
York I-LOC
. O

Acme B-ORG
hired O
Mary B-PER
and O
Bob B-PER
"""
# Entities: PER John Smith, LOC New York, ORG Acme, PER Mary, PER Bob (5). The prediction
# finds John Smith and Mary, cuts New York to New (wrong), calls Acme a PER (wrong), misses
# Bob, and invents "hired" as a MISC: 2 correct of 5 predicted, of 5 gold.
PREDICTED = ["B-PER", "I-PER", "O", "O", "B-LOC", "O", "O",
             "B-PER", "B-MISC", "B-PER", "O", "O"]


def test_seqeval_numbers_on_a_hand_made_file(tmp_path):
    """P = 2/5, R = 2/5, F1 = 0.4, accuracy 8/12 words, from the file and from logits, equal
    to seqeval called directly as run_ner.py calls it (evaluate's "seqeval", default mode)."""
    sentences = read_sentences(write(tmp_path / "gold.txt", GOLD))
    gold = [list(s.tags) for s in sentences]
    predicted = [PREDICTED[:7], PREDICTED[7:]]
    expected = {"precision": 0.4, "recall": 0.4, "f1": 0.4, "accuracy": 8 / 12}
    assert ner_metrics(gold, predicted) == pytest.approx(expected)
    report = seqeval_metrics.classification_report(gold, predicted, output_dict=True, zero_division=0)["micro avg"]
    assert (report["precision"], report["recall"], report["f1-score"]) == pytest.approx((0.4, 0.4, 0.4))
    # Through eval_results: one-hot logits for the predicted tags.
    labels = ("B-LOC", "B-MISC", "B-ORG", "B-PER", "I-LOC", "I-PER", "O")
    logits = [np.eye(len(labels), dtype=np.float32)[[labels.index(t) for t in p]] * 5 for p in predicted]
    got = eval_results(sentences, logits, labels)
    assert {k: got[f"eval_{k}"] for k in expected} == pytest.approx(expected)
    assert got["eval_samples"] == 2 and got["eval_loss"] > 0


def test_iob1_and_iobes_are_scored_as_they_come():
    """seqeval's default mode (run_ner.py's) reads IOB1 (I- opens an entity) and IOBES (E-
    closes, S- stands alone) as they are: on well-formed tags it equals seqeval's strict
    mode with that scheme; an ill-formed prediction is scored as conlleval scores it."""
    from seqeval.scheme import IOB1, IOBES

    # IOB1: "I-PER I-PER B-PER" is two people, the B- splitting adjacent entities of one type.
    iob1_gold = [["I-PER", "I-PER", "B-PER", "O", "I-LOC"]]
    iob1_pred = [["I-PER", "I-PER", "I-PER", "O", "I-LOC"]]  # one long person: 1 of 2 predicted right
    ours = ner_metrics(iob1_gold, iob1_pred)
    assert (ours["precision"], ours["recall"]) == pytest.approx((1 / 2, 1 / 3))
    assert ours["f1"] == pytest.approx(seqeval_metrics.f1_score(iob1_gold, iob1_pred, mode="strict", scheme=IOB1))
    iobes_gold = [["S-PER", "O", "B-LOC", "I-LOC", "E-LOC", "S-ORG"]]
    iobes_pred = [["S-PER", "O", "B-LOC", "E-LOC", "O", "S-ORG"]]
    ours = ner_metrics(iobes_gold, iobes_pred)
    assert (ours["precision"], ours["recall"], ours["accuracy"]) == pytest.approx((2 / 3, 2 / 3, 4 / 6))
    assert ours["f1"] == pytest.approx(seqeval_metrics.f1_score(iobes_gold, iobes_pred, mode="strict", scheme=IOBES))
    # I-PER after O: an entity for conlleval (and run_ner.py); not one for strict IOB2.
    assert ner_metrics([["O", "B-PER"]], [["O", "I-PER"]])["f1"] == 1.0
