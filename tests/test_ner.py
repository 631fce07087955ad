"""Token classification (finetune_ner.py): the data readers, features against run_ner.py's
(transformers' tokenizer with is_split_into_words), windows that reassemble every word,
seqeval's numbers on a hand-made file (and ours against seqeval directly), the model
against transformers (TP 1 and 2), and finetune_ner.py end to end: outputs, exact resume,
the transformers export, DP=2 / TP=2 / PP=2 against one process, and --pack-sequences
(packed rows equal the features unpacked; a packed run resumes exactly)."""
import json
import os
import random

import numpy as np
import pytest
import torch

import megabert
from megabert.checkpoint.hf import megabert_to_hf
from megabert.corpus.tokenizer_training import BERT_SPECIALS
from megabert.data import build_tokenizer
from megabert.errors import DataError
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table
from megabert.tasks.ner.data import Sentence, label_set, read_sentences
from megabert.tasks.ner.features import best_window, sentences_to_features, window_starts, word_logits
from megabert.tasks.ner.finetuning import eval_results
from megabert.tasks.ner.metrics import ner_metrics

from tests.helpers.cli_utils import main_worker, run_main
from tests.helpers.dist_utils import run_distributed
from tests.helpers.hf_models import make_hf_dir

transformers = pytest.importorskip("transformers")
seqeval_metrics = pytest.importorskip("seqeval.metrics")

NAMES = {"PER": ["alice", "bob", "carol", "dave"], "LOC": ["paris", "rome", "oslo"], "ORG": ["acme", "globex"]}
FILLER = [f"w{i}" for i in range(24)]


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """Entity names that split into sub-words: "alicezz" is alice ##zz."""
    words = [w for names in NAMES.values() for w in names] + FILLER + ["##zz", "##z", "."]
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(BERT_SPECIALS + words) + "\n")
    return str(path)


def tagged_sentences(rng, n, longest=9):
    """Filler words with names of three classes (IOB2), some names of several words or sub-words."""
    out = []
    for _ in range(n):
        words, tags = [], []
        for _ in range(rng.randint(2, longest)):
            if rng.random() < 0.25:
                kind = rng.choice(sorted(NAMES))
                for j in range(rng.randint(1, 2)):
                    words.append(rng.choice(NAMES[kind]) + ("zz" if rng.random() < 0.3 else ""))
                    tags.append(("B-" if j == 0 else "I-") + kind)
            else:
                words.append(rng.choice(FILLER))
                tags.append("O")
        out.append(Sentence(tuple(words), tuple(tags)))
    return out


def conll(sentences, docstart=True):
    """CoNLL-2003's layout: token POS chunk tag."""
    blocks = ["\n".join(f"{w} NN I-NP {t}" for w, t in zip(s.words, s.tags)) for s in sentences]
    return ("-DOCSTART- -X- -X- O\n\n" if docstart else "") + "\n\n".join(blocks) + "\n"


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
    context on its shorter side; and reading the logits back gives each word its own."""
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
            assert starts == window_starts(n, length, length // 2 if overlap is None else overlap)
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
        back = word_logits(features, logits, [len(s.words) for s in sentences])
        for (i, w), (f, position) in owners.items():
            assert back[i][w].tolist() == [f, position]
        assert sum(len(x) for x in back) == len(owners)


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


# ---------------------------------------------------------------- the model


def _check_tagger(rank, world, hf_dir):
    """Logits, loss and every gradient equal transformers' BertForTokenClassification, with
    padded rows and ignored positions, on the unpadded encoder that fine-tuning runs."""
    ps = megabert.init_parallel(tensor_parallel_size=world)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (3, 12), generator=gen)
    am = torch.ones_like(ids)
    am[1, 8:] = 0
    am[2, 5:] = 0
    labels = torch.randint(0, 5, (3, 12), generator=gen).masked_fill(am == 0, -100)
    labels[0, 3:6] = -100  # later sub-words
    hf = transformers.BertForTokenClassification.from_pretrained(hf_dir, attn_implementation="eager")
    ref = hf(input_ids=ids, attention_mask=am, labels=labels)
    ref.loss.backward()
    model = megabert.BertForTokenClassification.from_pretrained(hf_dir, ps, unpad_input=True)
    assert model.config.id2label == hf.config.id2label
    out = model(ids, attention_mask=am, labels=labels)
    out.loss.backward()
    real = am.bool()
    torch.testing.assert_close(out.logits[real], ref.logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    grads = megabert_to_hf(gather_full({n: p.grad for n, p in model.named_parameters()}, ps, spec_table(model)),
                           spec_table(model))
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_model_equals_transformers_tp1_and_tp2(tmp_path):
    tags = ["B-LOC", "B-PER", "I-LOC", "I-PER", "O"]
    hf_dir = make_hf_dir(tmp_path / "hf", "BertForTokenClassification", id2label=dict(enumerate(tags)))
    _check_tagger(0, 1, hf_dir)
    megabert.destroy_parallel()
    run_distributed(_check_tagger, 2, hf_dir)


# ---------------------------------------------------------------- finetune_ner.py end to end


@pytest.fixture(scope="module")
def ner_setup(tmp_path_factory, vocab):
    """A tiny random BertForPreTraining with its vocab.txt (dropout on, and off for exact
    layout comparisons) and CoNLL train / dev files whose longer sentences need two or
    three windows at --max-seq-length 16."""
    import shutil

    d = tmp_path_factory.mktemp("ner")
    dirs = {}
    for name, p in (("dropout", 0.1), ("plain", 0.0)):
        torch.manual_seed(0)
        cfg = transformers.BertConfig(vocab_size=len(open(vocab).read().split()), hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                      hidden_dropout_prob=p, attention_probs_dropout_prob=p)
        transformers.BertForPreTraining(cfg).save_pretrained(d / name)
        shutil.copyfile(vocab, d / name / "vocab.txt")
        dirs[name] = str(d / name)
    rng = random.Random(3)
    train = write(d / "train.txt", conll(tagged_sentences(rng, 40, longest=20)))
    dev_sentences = tagged_sentences(rng, 16, longest=20)
    dev = write(d / "dev.txt", conll(dev_sentences))
    return dirs, train, dev, dev_sentences


def common(load, train, dev, out, *extra):
    return ["--train-file", train, "--validation-file", dev, "--load", load, "--output-dir", out, "--max-seq-length",
            16, "--micro-batch-size", 4, "--global-batch-size", 8, "--seed", 3, "--lr", 1e-2, "--log-interval", 1,
            *extra]


def ner(*args):
    r = run_main("finetune_ner.py", *map(str, args))
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def losses(path):
    return [json.loads(line)["ner_loss"] for line in open(path)]


def read_predictions(path):
    """predictions.txt as CoNLL: [(words, tags)] per sentence; the format checked line by line."""
    text = open(path, encoding="utf-8").read()
    assert text.endswith("\n") and not text.endswith("\n\n") and "-DOCSTART-" not in text
    out = []
    for block in text[:-1].split("\n\n"):
        rows = [line.split(" ") for line in block.split("\n")]
        assert all(len(r) == 2 for r in rows)
        out.append(([w for w, _ in rows], [t for _, t in rows]))
    return out


def test_finetune_outputs_resume_and_export(ner_setup, tmp_path):
    """One process: eval_results.json with run_ner.py's keys, equal to seqeval applied to
    predictions.txt (the dev file tagged as a test file); a run stopped after 6 steps and
    re-run resumes to the losses and results of the uninterrupted one (dropout on); its
    checkpoint exports to a transformers BertForTokenClassification that names the tags and
    gives the same logits, and imports back to the same results."""
    dirs, train, dev, dev_sentences = ner_setup
    schedule = ["--lr-decay-iters", 12, "--lr-warmup-fraction", 0.25]  # the same schedule for 6 and 12 steps
    full = common(dirs["dropout"], train, dev, tmp_path / "full", "--train-iters", 12, "--test-file", dev,
                  "--metrics-file", tmp_path / "f.jsonl", *schedule)
    assert "ner dev: eval_loss" in ner(*full).stdout
    results = json.load(open(tmp_path / "full" / "eval_results.json"))
    assert set(results) == {"eval_loss", "eval_precision", "eval_recall", "eval_f1", "eval_accuracy", "eval_samples"}
    assert results["eval_samples"] == 16 and 0 < results["eval_f1"] < 1  # some entities found: the check below bites
    predicted = read_predictions(tmp_path / "full" / "predictions.txt")
    assert [w for w, _ in predicted] == [list(s.words) for s in dev_sentences]
    gold, tags = [list(s.tags) for s in dev_sentences], [t for _, t in predicted]
    assert results["eval_f1"] == pytest.approx(seqeval_metrics.f1_score(gold, tags))
    assert results["eval_precision"] == pytest.approx(seqeval_metrics.precision_score(gold, tags))
    assert results["eval_recall"] == pytest.approx(seqeval_metrics.recall_score(gold, tags))
    assert results["eval_accuracy"] == pytest.approx(seqeval_metrics.accuracy_score(gold, tags))
    again = json.load(open(tmp_path / "full" / "predict_results.json"))
    assert again == {k.replace("eval_", "predict_"): v for k, v in results.items()}

    ckpt = tmp_path / "ckpt"
    first = common(dirs["dropout"], train, dev, tmp_path / "part", "--metrics-file", tmp_path / "p.jsonl", "--save",
                   ckpt, *schedule)
    ner(*[a for a in first if a not in ("--validation-file", dev)], "--train-iters", 6)  # train only
    ner(*first, "--train-iters", 12)  # finds its checkpoint under --save and resumes at step 2
    assert losses(tmp_path / "p.jsonl") == losses(tmp_path / "f.jsonl")
    assert json.load(open(tmp_path / "part" / "eval_results.json")) == pytest.approx(results)

    r = run_main("tools/checkpoint/convert_hf.py", "export", "--load", str(ckpt), "--hf-dir", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    hf = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "BertForTokenClassification"
    assert hf.config.id2label == {0: "B-LOC", 1: "B-ORG", 2: "B-PER", 3: "I-LOC", 4: "I-ORG", 5: "I-PER", 6: "O"}
    megabert.init_parallel()
    try:
        ours = megabert.BertForTokenClassification.from_pretrained(str(ckpt)).eval()
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
        enc = tok([list(s.words) for s in dev_sentences[:4]], is_split_into_words=True, padding=True,
                  return_tensors="pt")
        with torch.no_grad():
            real = enc["attention_mask"].bool()
            torch.testing.assert_close(ours(**enc).logits[real], hf(**enc).logits[real], atol=1e-5, rtol=1e-5)
    finally:
        megabert.destroy_parallel()
    # ... and back: the imported tagger evaluates as before (its tags from its config).
    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", str(tmp_path / "hf"), "--output",
                 str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr[-3000:]
    ner("--validation-file", dev, "--load", tmp_path / "back", "--output-dir", tmp_path / "again",
        "--max-seq-length", 16)
    assert json.load(open(tmp_path / "again" / "eval_results.json")) == pytest.approx(results, abs=1e-5)


def test_cli_errors_are_one_line(ner_setup, tmp_path):
    dirs, train, dev, _ = ner_setup
    bad = write(tmp_path / "bad.txt", "EU B-ORG\nrejects\n")
    r = run_main("finetune_ner.py", "--train-file", bad, "--load", dirs["plain"])
    err = r.stderr.strip()
    assert r.returncode == 2 and err.startswith("error: ") and "\n" not in err
    assert "bad.txt:2: the token 'rejects' has no tag" in err
    r = run_main("finetune_ner.py", "--validation-file", dev, "--load", dirs["plain"], "--output-dir", str(tmp_path))
    assert r.returncode == 2 and "names no tags (no id2label in its config)" in r.stderr
    other = make_hf_dir(tmp_path / "other", "BertForTokenClassification", id2label={0: "O", 1: "B-X"})
    r = run_main("finetune_ner.py", "--train-file", train, "--load", other, "--vocab-file",
                 os.path.join(dirs["plain"], "vocab.txt"))
    assert r.returncode == 2 and "holds a classifier for the labels O, B-X" in r.stderr
    r = run_main("finetune_ner.py", "--train-file", train, "--load", dirs["plain"], "--max-seq-length", "16",
                 "--stride", "14")
    assert r.returncode == 2 and "--stride 14 must be in [0, 14)" in r.stderr


def test_layouts_follow_one_process(ner_setup, tmp_path):
    """Without dropout, 12 steps at DP=2, TP=2 and PP=2 (finetune_ner.py's main() on two ranks
    of the warm worker pool) give one process's losses within 1e-4 (gradient accumulation
    over the same global batch), its dev results and its predictions.txt."""
    dirs, train, dev, _ = ner_setup

    def args(name):
        return common(dirs["plain"], train, dev, tmp_path / name, "--train-iters", 12, "--test-file", dev,
                      "--metrics-file", tmp_path / f"{name}.jsonl")

    ner(*args("one"))
    one = losses(tmp_path / "one.jsonl")
    one_results = json.load(open(tmp_path / "one" / "eval_results.json"))
    assert len(one) == 12 and any(t != "O" for line in open(tmp_path / "one" / "predictions.txt")
                                 for t in line.split()[1:])  # entities predicted: the comparison bites
    for name, extra in {"dp2": [], "tp2": ["--tensor-model-parallel-size", 2],
                        "pp2": ["--pipeline-model-parallel-size", 2]}.items():
        run_distributed(main_worker, 2, "finetune_ner.py", [str(a) for a in (*args(name), *extra)])
        assert losses(tmp_path / f"{name}.jsonl") == pytest.approx(one, abs=1e-4), name
        assert json.load(open(tmp_path / name / "eval_results.json")) == pytest.approx(one_results, abs=1e-4), name
        assert open(tmp_path / name / "predictions.txt").read() == open(tmp_path / "one" / "predictions.txt").read()


# ---------------------------------------------------------------- --pack-sequences


def vocab_size_of(vocab):
    return len(open(vocab).read().split())


def ner_packing_spec(*, max_samples_per_row, window):
    """NerTask.packing's spec for --max-seq-length 16."""
    from megabert.arguments import parse_finetune_args
    from megabert.tasks.ner.config import NER_DEFAULTS, NerConfig
    from megabert.tasks.ner.finetuning import NerTask

    cfg = parse_finetune_args(["--train-file", "unused.txt", "--load", "unused", "--max-seq-length", "16",
                               "--pack-sequences", "--max-samples-per-row", str(max_samples_per_row),
                               "--packing-window", str(window)], task_config=NerConfig, defaults=NER_DEFAULTS)
    return NerTask(cfg).packing(seed=5)


@pytest.mark.parametrize("unpad", [True, False], ids=["varlen", "block-diagonal-mask"])
def test_packed_rows_equal_the_features_unpacked(vocab, unpad):
    """BertForTokenClassification on packed rows of NER features (windows of long sentences
    among them): every real token's logits equal its feature's unpacked (fp32, dropout 0),
    and ner_task's training loss over the batch's labelled sub-words and every gradient
    equal the unpacked batch's within 1e-6, on the unpadded encoder and on the padded one
    (block-diagonal attention mask)."""
    from megabert.config import ModelConfig
    from megabert.data.packing import pack_window
    from megabert.tasks.ner.finetuning import ner_task
    from megabert.training.strategy import LOSS_SHARES

    sentences = tagged_sentences(random.Random(4), 12, longest=20)
    labels = label_set(sentences)
    features = sentences_to_features(sentences, build_tokenizer("BertWordPieceLowerCase", vocab), 16,
                                     label2id={t: i for i, t in enumerate(labels)}, drop_unlabelled=True)
    n = len(features.windows)
    assert n > len(sentences)  # windows of long sentences are features like any other
    megabert.init_parallel()
    try:
        config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=vocab_size_of(vocab),
                             max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
                             num_labels=len(labels), unpad_input=unpad)
        model = megabert.BertForTokenClassification(config, seed=3)
        feats = [{k: t[i].numpy() for k, t in features.tensors.items()} for i in range(n)]
        spec = ner_packing_spec(max_samples_per_row=4, window=n)
        window = pack_window(feats, 0, spec)
        assert len(window["row_samples"]) < n and window["row_samples"].sum() == n
        packed = {k: torch.from_numpy(v) for k, v in window.items() if k != "row_samples"}
        unpacked = dict(features.tensors)
        task = ner_task()

        def run(batch):
            model.zero_grad()
            batch = {**batch, LOSS_SHARES: task.loss_counts(batch).float()}  # one micro-batch, one rank
            out = model(**task.model_inputs(batch))
            loss, _ = task.train_loss(out, batch)
            loss.backward()
            return out, loss, {name: p.grad.clone() for name, p in model.named_parameters()}

        (p_out, p_loss, p_grads), (u_out, u_loss, u_grads) = run(packed), run(unpacked)
        assert task.loss_counts(packed) == task.loss_counts(unpacked)
        torch.testing.assert_close(p_loss, u_loss, atol=1e-6, rtol=0)
        assert p_grads.keys() == u_grads.keys()
        for name in u_grads:
            torch.testing.assert_close(p_grads[name], u_grads[name], atol=1e-6, rtol=0, msg=name)
        # Each feature's tokens sit in its row with its positions from 0 and its own logits.
        for r, lengths in enumerate(window["packed_seqlens"]):
            at = 0
            for length in map(int, lengths[lengths > 0]):
                tokens = window["input_ids"][r, at:at + length]
                assert window["position_ids"][r, at:at + length].tolist() == list(range(length))
                f = next(i for i in range(n) if features.tensors["attention_mask"][i].sum() == length
                         and (features.tensors["input_ids"][i, :length].numpy() == tokens).all())
                torch.testing.assert_close(p_out.logits[r, at:at + length], u_out.logits[f, :length],
                                           atol=1e-5, rtol=1e-5)
                at += length
    finally:
        megabert.destroy_parallel()


def test_finetune_packed_resumes_exactly(ner_setup, tmp_path):
    """finetune_ner.py --pack-sequences: rows of 32 holding several NER features (the windows
    of long sentences among them); a run stopped after 2 steps resumes to the uninterrupted
    run's losses (dropout on), and evaluation (unpacked) writes eval_results.json."""
    dirs, train, dev, _ = ner_setup
    packed = ["--pack-sequences", "--max-samples-per-row", 4, "--micro-batch-size", 2, "--global-batch-size", 4,
              "--max-seq-length", 32, "--stride", 8, "--lr-decay-iters", 4, "--lr-warmup-fraction", 0.25]
    full = common(dirs["dropout"], train, dev, tmp_path / "full", "--train-iters", 4, "--metrics-file",
                  tmp_path / "f.jsonl", *packed)
    ner(*full)
    results = json.load(open(tmp_path / "full" / "eval_results.json"))
    assert results["eval_samples"] == 16 and {"eval_loss", "eval_f1"} <= set(results)
    rows = [json.loads(line) for line in open(tmp_path / "f.jsonl")]
    assert len(rows) == 4 and all(r["samples_per_row"] > 1 and 0 < r["real_token_share"] <= 1 for r in rows)
    part = common(dirs["dropout"], train, dev, tmp_path / "part", "--metrics-file", tmp_path / "p.jsonl", "--save",
                  tmp_path / "ckpt", *packed)
    ner(*[a for a in part if a not in ("--validation-file", dev)], "--train-iters", 2)  # train only
    ner(*part, "--train-iters", 4)  # resumes at step 2
    assert losses(tmp_path / "p.jsonl") == losses(tmp_path / "f.jsonl")
    assert json.load(open(tmp_path / "part" / "eval_results.json")) == pytest.approx(results)
