"""Token classification (finetune_ner.py; its data in test_ner_data.py): the model against
transformers (TP 1 and 2), and finetune_ner.py end to end: outputs, exact resume,
the transformers export, DP=2 / TP=2 / PP=2 against one process, and --pack-sequences
(packed rows equal the features unpacked; a packed run resumes exactly)."""
import json
import os
import random

import pytest
import torch

import megabert
from megabert.checkpoint.hf import megabert_to_hf
from megabert.data import build_tokenizer
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table
from megabert.tasks.ner.data import label_set
from megabert.tasks.ner.features import sentences_to_features

from tests.helpers.cli_utils import main_worker, run_main
from tests.helpers.dist_utils import run_distributed
from tests.helpers.hf_models import make_hf_dir
from tests.helpers.ner_files import conll, tagged_sentences, write, write_vocab

transformers = pytest.importorskip("transformers")
seqeval_metrics = pytest.importorskip("seqeval.metrics")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


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
    # Every window labelled (more labels than --train-windows owned): these 12 steps find entities.
    schedule += ["--train-windows", "all"]
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
    return NerTask(cfg, None).packing(seed=5)  # no --load is read for packing


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
