"""GLUE: each task's TSV layout as the distribution ships it (CoLA without a header, MNLI's
extra columns and two dev sets, QQP's short rows), CSV / JSON-lines files, errors naming
file:line, the official metrics against scipy / scikit-learn, features, the model against
transformers (logits and gradients, TP 1 and 2), the Hugging Face export and import of the
classifier, and finetune_glue.py end to end: resume, layouts, and dev-metric parity with a
transformers loop."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from dist_utils import run_distributed

import megabert
from megabert.checkpoint.hf import megabert_to_hf
from megabert.corpus.tokenizer_training import BERT_SPECIALS
from megabert.data import build_tokenizer
from megabert.errors import ConfigError, DataError
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table
from megabert.tasks.glue.data import read_examples
from megabert.tasks.glue.features import examples_to_tensors, truncate_pair
from megabert.tasks.glue.metrics import average_ranks, glue_metrics, matthews_corrcoef, spearman
from megabert.tasks.glue.tasks import TASKS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
transformers = pytest.importorskip("transformers")


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


# ---------------------------------------------------------------- the distribution's TSVs


def test_tsv_layout_of_every_task(tmp_path):
    """Sentences and labels come from each task's columns, headers skipped where GLUE has them."""
    cases = {
        "cola": (["gj04\t1\t\tThe sailors rode the breeze clear of the rocks.", "gj04\t0\t*\tThe more we study."],
                 [("The sailors rode the breeze clear of the rocks.", None, 1), ("The more we study.", None, 0)]),
        "sst-2": (["sentence\tlabel", "it 's a \" charming \" journey \t1"], [("it 's a \" charming \" journey ", None, 1)]),
        "mrpc": (["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String", "1\t702876\t702977\tAmrozi accused .\tReferring ."],
                 [("Amrozi accused .", "Referring .", 1)]),
        "sts-b": (["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
                   "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane.\tAn air plane.\t5.000"],
                  [("A plane.", "An air plane.", 5.0)]),
        "qqp": (["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", "1\t3\t4\tWhy?\tHow?\t0"],
                [("Why?", "How?", 0)]),
        "mnli": (["index\tpromptID\tpairID\tgenre\tp1\tp2\tp3\tp4\tsentence1\tsentence2\tlabel1\tgold_label",
                  "0\t31193\t31193n\tgov\t(\t(\t(\t(\tPremise .\tHypothesis .\tneutral\tneutral"],
                 [("Premise .", "Hypothesis .", 2)]),
        "qnli": (["index\tquestion\tsentence\tlabel", "0\tWhat?\tThis.\tnot_entailment"], [("What?", "This.", 1)]),
        "rte": (["index\tsentence1\tsentence2\tlabel", "0\tA .\tB .\tentailment"], [("A .", "B .", 0)]),
        "wnli": (["index\tsentence1\tsentence2\tlabel", "0\tA .\tB .\t1"], [("A .", "B .", 1)]),
    }
    for name, (lines, want) in cases.items():
        got = read_examples(write(tmp_path / f"{name}.tsv", lines), TASKS[name])
        assert [(e.text_a, e.text_b, e.label) for e in got] == want, name
    # MNLI's dev rows carry five annotator labels before the gold one (16 columns).
    dev = write(tmp_path / "dev_matched.tsv", ["header"] + ["\t".join(
        ["0", "1", "1e", "fiction"] + ["("] * 4 + ["P", "H"] + ["neutral"] * 4 + ["contradiction", "entailment"])])
    assert read_examples(dev, TASKS["mnli"])[0].label == 1
    # Test files: an index column and no label (CoLA's has a header, unlike its train/dev).
    test = read_examples(write(tmp_path / "t.tsv", ["index\tsentence", "0\tBill left ."]), TASKS["cola"], test=True)
    assert [(e.text_a, e.label) for e in test] == [("Bill left .", None)]
    test = read_examples(write(tmp_path / "q.tsv", ["id\tquestion1\tquestion2", "0\tA?\tB?"]), TASKS["qqp"], test=True)
    assert [(e.text_a, e.text_b) for e in test] == [("A?", "B?")]


def test_qqp_short_rows_are_skipped_elsewhere_errors_name_file_and_line(tmp_path, caplog):
    """QQP's train.tsv has rows cut short by stray newlines: run_glue.py skips them, so do we
    (with one warning); any other task's short row, and an unknown label, stop with file:line."""
    qqp = write(tmp_path / "qqp.tsv", ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", "1\t3\t4\tWhy?\tHow?\t0",
                                       "2\t5\t6\tHow do I", "read this?\t1", "3\t7\t8\tA?\tB?\t1"])
    assert [e.label for e in read_examples(qqp, TASKS["qqp"])] == [0, 1]
    assert "skipped 2 rows" in caplog.text and "line 3" in caplog.text
    rte = write(tmp_path / "rte.tsv", ["index\tsentence1\tsentence2\tlabel", "0\tA\tB\tentailment", "1\tA only"])
    with pytest.raises(DataError, match=r"rte\.tsv:3: 2 tab-separated columns, rte needs 4"):
        read_examples(rte, TASKS["rte"])
    bad = write(tmp_path / "mnli.tsv", ["h"] + ["\t".join(["0"] * 8 + ["P", "H", "neutral", "maybe"])])
    with pytest.raises(DataError, match=r"mnli\.tsv:2: label 'maybe' is not one of mnli's labels \(contradiction, "):
        read_examples(bad, TASKS["mnli"])
    sts = write(tmp_path / "sts.tsv", ["h", "\t".join(["x"] * 9 + ["high"])])
    with pytest.raises(DataError, match=r"sts\.tsv:2: label 'high' is not a number"):
        read_examples(sts, TASKS["sts-b"])
    with pytest.raises(DataError, match="does not exist"):
        read_examples(str(tmp_path / "none.tsv"), TASKS["rte"])


def test_csv_and_json_lines_with_named_columns(tmp_path):
    """run_glue.py's --train_file: sentence1/sentence2 when present, else the first two
    non-label columns; labels by name or id."""
    csv_path = write(tmp_path / "d.csv", ["idx,sentence1,sentence2,label", '0,"A, quoted",B,entailment', "1,C,D,1"])
    assert [(e.text_a, e.text_b, e.label) for e in read_examples(csv_path, TASKS["rte"])] == \
        [("A, quoted", "B", 0), ("C", "D", 1)]
    js = write(tmp_path / "d.json", [json.dumps({"sentence": "good", "label": 1}), "",
                                     json.dumps({"sentence": "bad", "label": "0"})])
    assert [(e.text_a, e.text_b, e.label) for e in read_examples(js, TASKS["sst-2"])] == \
        [("good", None, 1), ("bad", None, 0)]
    broken = write(tmp_path / "b.json", [json.dumps({"sentence": "x", "label": 1}), "{oops"])
    with pytest.raises(DataError, match=r"b\.json:2: not a JSON object"):
        read_examples(broken, TASKS["sst-2"])
    with pytest.raises(DataError, match=r"c\.csv:3: label '7' is not one of sst-2's labels"):
        read_examples(write(tmp_path / "c.csv", ["sentence,label", "a,1", "b,7"]), TASKS["sst-2"])


# ---------------------------------------------------------------- metrics


def test_metrics_equal_scipy_and_sklearn():
    scipy_stats = pytest.importorskip("scipy.stats")
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    labels, preds = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    got = glue_metrics(("accuracy", "f1", "matthews_correlation"), preds, labels)
    assert got["accuracy"] == pytest.approx(sk.accuracy_score(labels, preds))
    assert got["f1"] == pytest.approx(sk.f1_score(labels, preds))
    assert got["matthews_correlation"] == pytest.approx(sk.matthews_corrcoef(labels, preds))
    three = rng.integers(0, 3, 100), rng.integers(0, 3, 100)
    assert matthews_corrcoef(*three) == pytest.approx(sk.matthews_corrcoef(*three))
    assert matthews_corrcoef([1, 1, 1], [0, 1, 1]) == 0.0  # a constant side: sklearn's 0
    # STS-B: scores on a 0.2 grid and rounded predictions, so both sides hold many ties.
    gold, pred = np.round(rng.uniform(0, 5, 300) * 5) / 5, np.round(rng.uniform(0, 5, 300), 1)
    got = glue_metrics(("pearson", "spearmanr"), pred, gold)
    assert got["pearson"] == pytest.approx(scipy_stats.pearsonr(pred, gold)[0], abs=1e-12)
    assert got["spearmanr"] == pytest.approx(scipy_stats.spearmanr(pred, gold)[0], abs=1e-12)


def test_metrics_by_hand():
    """Cases checked by hand, for machines without scipy / scikit-learn."""
    assert list(average_ranks([10, 20, 20, 5])) == [2.0, 3.5, 3.5, 1.0]
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # 3/sqrt(10)
    # tp=2 fp=1 fn=1 tn=1: F1 = 4/6, MCC = (2*1 - 1*1) / sqrt(3*3*2*2) = 1/6
    preds, labels = [1, 1, 1, 0, 0], [1, 1, 0, 1, 0]
    got = glue_metrics(("accuracy", "f1", "matthews_correlation"), np.array(preds), np.array(labels))
    assert got == pytest.approx({"accuracy": 0.6, "f1": 2 / 3, "matthews_correlation": 1 / 6})


# ---------------------------------------------------------------- features and the model


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(BERT_SPECIALS + [f"w{i}" for i in range(60)] + ["good", "bad", "."]) + "\n")
    return str(path)


def test_features_equal_transformers_tokenizer(vocab):
    """[CLS] A [SEP] B [SEP], token types and padding as BertTokenizer's encode_plus."""
    from megabert.tasks.glue.data import GlueExample

    hf = transformers.BertTokenizerFast(vocab, do_lower_case=True)
    examples = [GlueExample("w1 w2 good .", "w3 bad", 1), GlueExample("w4", None, 0)]
    got = examples_to_tensors(examples, build_tokenizer("BertWordPieceLowerCase", vocab), 12, regression=False)
    for i, e in enumerate(examples):
        ref = hf(e.text_a, e.text_b, padding="max_length", max_length=12)
        for key in ("input_ids", "token_type_ids", "attention_mask"):
            assert got[key][i].tolist() == ref[key], key
    assert got["labels"].tolist() == [1, 0]
    assert truncate_pair([1, 2, 3, 4, 5], [6, 7], 5) == ([1, 2, 3], [6, 7])  # the longer loses, b on ties
    assert truncate_pair([1, 2], [6, 7, 8], 4) == ([1, 2], [6, 7])


def make_hf_classifier(path, num_labels, dropout=0.0):
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout, num_labels=num_labels)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    with torch.no_grad():  # non-trivial biases and LayerNorms, so a swapped name would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return str(path)


def _check_classifier(rank, world, hf_dirs):
    """Logits, loss and every gradient equal transformers' (3 classes and regression), with
    padded rows, on the unpadded encoder that fine-tuning runs."""
    ps = megabert.init_parallel(tensor_parallel_size=world)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (3, 12), generator=gen)
    tt = (torch.arange(12) >= 6).long().expand(3, 12)
    am = torch.ones_like(ids)
    am[1, 8:] = 0
    am[2, 5:] = 0
    for hf_dir, labels in zip(hf_dirs, (torch.tensor([0, 2, 1]), torch.tensor([0.5, 3.0, 4.2]))):
        hf = transformers.BertForSequenceClassification.from_pretrained(hf_dir, attn_implementation="eager")
        ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am, labels=labels)
        ref.loss.backward()
        model = megabert.BertForSequenceClassification.from_pretrained(hf_dir, ps, unpad_input=True)
        assert model.config.num_labels == hf.config.num_labels
        out = model(ids, token_type_ids=tt, attention_mask=am, labels=labels)
        out.loss.backward()
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
        grads = megabert_to_hf(gather_full({n: p.grad for n, p in model.named_parameters()}, ps, spec_table(model)),
                               spec_table(model))
        ref_grads = {n: p.grad for n, p in hf.named_parameters()}
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_model_equals_transformers_tp1_and_tp2(tmp_path):
    dirs = (make_hf_classifier(tmp_path / "mnli", 3), make_hf_classifier(tmp_path / "stsb", 1))
    _check_classifier(0, 1, dirs)
    megabert.destroy_parallel()
    run_distributed(_check_classifier, 2, dirs)


# ---------------------------------------------------------------- finetune_glue.py end to end

MNLI_LABELS = ("contradiction", "entailment", "neutral")


def mnli_rows(rng, n, words=60):
    """Premise and hypothesis of random words; the class is cued by the hypothesis' first word."""
    rows = []
    for _ in range(n):
        y = int(rng.integers(0, 3))
        premise = " ".join(f"w{int(i)}" for i in rng.integers(3, words, rng.integers(3, 9)))
        hypothesis = " ".join([f"w{y}"] + [f"w{int(i)}" for i in rng.integers(3, words, rng.integers(1, 5))])
        rows.append((premise, hypothesis, MNLI_LABELS[y]))
    return rows


def write_mnli(path, rng):
    """An MNLI folder as GLUE ships it: 12-column train, 16-column dev sets, 10-column tests."""
    path.mkdir()
    head = "index\tpromptID\tpairID\tgenre\tp1\tp2\tp3\tp4\tsentence1\tsentence2"
    for name, n, dev in (("train.tsv", 48, False), ("dev_matched.tsv", 20, True), ("dev_mismatched.tsv", 12, True)):
        extra = "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label" if dev else "\tlabel1\tgold_label"
        labels = (lambda y: "\t".join([y] * 6)) if dev else (lambda y: f"{y}\t{y}")
        write(path / name, [head + extra] + [f"{i}\t0\t0n\tfiction\t(\t(\t(\t(\t{p}\t{h}\t{labels(y)}"
                                              for i, (p, h, y) in enumerate(mnli_rows(rng, n))])
    for name, n in (("test_matched.tsv", 7), ("test_mismatched.tsv", 5)):
        write(path / name, [head] + [f"{i}\t0\t0n\tfiction\t(\t(\t(\t(\t{p}\t{h}" for i, (p, h, _) in
                                     enumerate(mnli_rows(rng, n))])
    return str(path)


@pytest.fixture(scope="module")
def glue_setup(tmp_path_factory, vocab):
    """A tiny random BertForPreTraining from transformers with its vocab.txt (one with
    dropout, one without for exact layout comparisons) and an MNLI folder."""
    import shutil

    d = tmp_path_factory.mktemp("glue")
    dirs = {}
    for name, p in (("dropout", 0.1), ("plain", 0.0)):
        torch.manual_seed(0)
        cfg = transformers.BertConfig(vocab_size=len(open(vocab).read().split()), hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                      hidden_dropout_prob=p, attention_probs_dropout_prob=p)
        transformers.BertForPreTraining(cfg).save_pretrained(d / name)
        shutil.copyfile(vocab, d / name / "vocab.txt")
        dirs[name] = str(d / name)
    return dirs, write_mnli(d / "MNLI", np.random.default_rng(0))


def run_main(*args):
    """finetune_glue.py's main in this process (a single rank): no interpreter start-up."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_glue", os.path.join(ROOT, "finetune_glue.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in args])


def common(load, data, out, *extra):
    return ["--task-name", "mnli", "--data-dir", data, "--load", load, "--output-dir", out, "--max-seq-length", 32,
            "--micro-batch-size", 4, "--global-batch-size", 8, "--seed", 3, "--lr", 1e-3, "--log-interval", 1, *extra]


def losses(path):
    return [json.loads(line)["glue_loss"] for line in open(path)]


def test_finetune_mnli_outputs_resume_and_export(glue_setup, tmp_path, capsys):
    """MNLI end to end in one process: eval_results.json with run_glue.py's keys for both dev
    sets, the submission files in words; a run stopped after 2 steps and re-run resumes to
    the losses and results of the uninterrupted one (dropout on: RNG and data position
    restored; the second half recomputes activations); its checkpoint exports to a transformers BertForSequenceClassification that
    predicts the same and names the labels."""
    dirs, data = glue_setup
    schedule = ["--lr-decay-iters", 4, "--lr-warmup-fraction", 0.25]  # the same schedule for 2 and 4 steps
    full = common(dirs["dropout"], data, tmp_path / "full", "--train-iters", 4, "--metrics-file", tmp_path / "f.jsonl",
                  *schedule)
    assert run_main(*full) == 0
    results = json.load(open(tmp_path / "full" / "eval_results.json"))
    assert set(results) == {"eval_loss", "eval_accuracy", "eval_samples", "eval_loss_mm", "eval_accuracy_mm",
                            "eval_samples_mm"}
    assert (results["eval_samples"], results["eval_samples_mm"]) == (20, 12) and 0 <= results["eval_accuracy"] <= 1
    for name, n in (("MNLI-m.tsv", 7), ("MNLI-mm.tsv", 5)):
        lines = open(tmp_path / "full" / name).read().splitlines()
        assert lines[0] == "index\tprediction" and len(lines) == n + 1
        assert all(line.split("\t")[1] in MNLI_LABELS for line in lines[1:])
    assert "mnli dev: eval_loss" in capsys.readouterr().out

    ckpt = tmp_path / "ckpt"
    first = common(dirs["dropout"], data, tmp_path / "part", "--metrics-file", tmp_path / "p.jsonl", "--save", ckpt,
                   *schedule)
    assert run_main(*first, "--train-iters", 2, "--no-do-eval", "--no-do-predict") == 0
    # Finds its checkpoint under --save and resumes at step 2; recomputing the layers'
    # activations (dropout masks drawn again alike) changes no loss.
    assert run_main(*first, "--train-iters", 4, "--recompute-granularity", "full") == 0
    assert losses(tmp_path / "p.jsonl") == losses(tmp_path / "f.jsonl")
    assert json.load(open(tmp_path / "part" / "eval_results.json")) == pytest.approx(results)

    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_hf", os.path.join(ROOT, "tools", "checkpoint", "convert_hf.py"))
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    assert convert.main(["export", "--load", str(ckpt), "--hf-dir", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "BertForSequenceClassification"
    assert hf.config.id2label == dict(enumerate(MNLI_LABELS)) and hf.config.problem_type == "single_label_classification"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    rows = [line.split("\t") for line in open(os.path.join(data, "test_matched.tsv")).read().splitlines()[1:]]
    enc = tok([r[8] for r in rows], [r[9] for r in rows], padding="max_length", max_length=32, return_tensors="pt")
    with torch.no_grad():
        words = [hf.config.id2label[int(i)] for i in hf(**enc).logits.argmax(-1)]
    assert words == [line.split("\t")[1] for line in open(tmp_path / "part" / "MNLI-m.tsv").read().splitlines()[1:]]
    # ... and back: the imported classifier predicts as before (no head initialised from the seed).
    assert convert.main(["import", "--hf-dir", str(tmp_path / "hf"), "--output", str(tmp_path / "back")]) == 0
    assert run_main(*common(tmp_path / "back", data, tmp_path / "again", "--no-do-train")) == 0
    assert json.load(open(tmp_path / "again" / "eval_results.json")) == pytest.approx(results, abs=1e-5)


def test_cli_errors_are_one_line(glue_setup, tmp_path, capsys):
    dirs, data = glue_setup
    bad = tmp_path / "bad.tsv"
    bad.write_text("index\tsentence1\tsentence2\tlabel\n0\tA\tB\tperhaps\n")
    assert run_main("--task-name", "rte", "--train-file", bad, "--validation-file", bad, "--load", dirs["plain"],
                    "--output-dir", tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "bad.tsv:2: label 'perhaps' is not one of rte's labels" in err
    assert "\n" not in err
    three = make_hf_classifier(tmp_path / "mnli_model", 3)
    good = write(tmp_path / "good.tsv", ["sentence\tlabel", "w1 good\t1"])
    assert run_main("--task-name", "sst-2", "--train-file", good, "--no-do-eval", "--no-do-predict", "--load", three,
                    "--vocab-file", glue_setup[0]["plain"] + "/vocab.txt") == 2
    assert "holds a classifier for another number of labels than sst-2's 2" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--task-name is required"):
        from megabert.tasks.glue.config import GlueConfig

        GlueConfig(data_dir="x", output_dir="o")


def torchrun(procs, *args):
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node", str(procs),
           os.path.join(ROOT, "finetune_glue.py")]
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_layouts_follow_one_process(glue_setup, tmp_path):
    """Without dropout, 6 fine-tuning steps at TP=2, PP=2 and ZeRO-3 DP=2 (two processes under
    torchrun each) give one process's losses within 1e-4 (gradient accumulation over the same
    global batch), and their dev results (through pipeline stages, gathered over DP ranks)."""
    dirs, data = glue_setup

    def args(name):
        return common(dirs["plain"], data, tmp_path / name, "--train-iters", 6, "--metrics-file",
                      tmp_path / f"{name}.jsonl", "--no-do-predict")

    assert run_main(*args("one")) == 0
    one = losses(tmp_path / "one.jsonl")
    one_results = json.load(open(tmp_path / "one" / "eval_results.json"))
    assert len(one) == 6
    layouts = {"tp2": ["--tensor-model-parallel-size", 2], "pp2": ["--pipeline-model-parallel-size", 2],
               "zero3": ["--deepspeed", "--zero-stage", 3]}
    for name, extra in layouts.items():
        r = torchrun(2, *args(name), *extra)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        assert losses(tmp_path / f"{name}.jsonl") == pytest.approx(one, abs=1e-4), name
        assert json.load(open(tmp_path / name / "eval_results.json")) == pytest.approx(one_results, abs=1e-4), name


def test_bf16_fp16_and_zero3_offload_follow_fp32(glue_setup, tmp_path):
    """The same Strategy as pre-training and SQuAD carries GLUE's other set-ups: bf16 and
    fp16 (dynamic loss scaling) follow fp32 to their precision, and ZeRO-3 with optimizer
    and parameter offload (DeepSpeedCPUAdam, one process) gives fp32's losses."""
    dirs, data = glue_setup
    curves = {}
    environ = dict(os.environ)  # DeepSpeed's launch variables (RANK, ...) must not outlive the test
    try:
        _precision_and_offload_runs(dirs, data, tmp_path, curves)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert len(curves["fp32"]) == 4
    assert curves["offload"] == pytest.approx(curves["fp32"], abs=1e-4)
    for half in ("bf16", "fp16"):
        assert curves[half] == pytest.approx(curves["fp32"], abs=3e-2) and curves[half] != curves["fp32"], half


def _precision_and_offload_runs(dirs, data, tmp_path, curves):
    for name, extra in (("fp32", []), ("bf16", ["--bf16"]), ("fp16", ["--fp16"]),
                        ("offload", ["--deepspeed", "--zero-stage", 3, "--zero-offload-optimizer", "cpu",
                                     "--zero-offload-params", "cpu"])):
        assert run_main(*common(dirs["plain"], data, tmp_path / name, "--train-iters", 4, "--no-do-predict",
                                "--metrics-file", tmp_path / f"{name}.jsonl", *extra)) == 0
        curves[name] = losses(tmp_path / f"{name}.jsonl")


def sst2_rows(rng, n):
    """A sentence of random words holding "good" (label 1) or "bad" (label 0) somewhere."""
    rows = []
    for _ in range(n):
        y, k = int(rng.integers(0, 2)), int(rng.integers(2, 8))
        words = [f"w{int(i)}" for i in rng.integers(0, 60, k)]
        words.insert(int(rng.integers(0, k + 1)), "good" if y else "bad")
        rows.append((" ".join(words), y))
    return rows


def test_dev_accuracy_equals_a_transformers_loop(vocab, tmp_path):
    """An SST-2-format task: finetune_glue.py and run_glue.py's training loop (Trainer's AdamW
    without decay on biases and LayerNorm, linear warmup and decay, clipping at 1.0) from the
    same BertForSequenceClassification, on the same batches with the same hyper-parameters,
    reach the same dev accuracy (within 1 point). Dropout is off so that the two runs differ
    by float rounding alone, not by their random masks."""
    from megabert.training.finetune import feature_batches

    rng = np.random.default_rng(0)
    train, dev = sst2_rows(rng, 96), sst2_rows(rng, 200)
    data = tmp_path / "SST-2"
    data.mkdir()
    write(data / "train.tsv", ["sentence\tlabel"] + [f"{s}\t{y}" for s, y in train])
    write(data / "dev.tsv", ["sentence\tlabel"] + [f"{s}\t{y}" for s, y in dev])
    cfg = transformers.BertConfig(vocab_size=len(open(vocab).read().split()), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(cfg)
    hf.save_pretrained(tmp_path / "init")
    epochs, lr, batch, seq, seed = 12, 4e-3, 16, 16, 1
    assert run_main("--task-name", "sst-2", "--data-dir", data, "--load", tmp_path / "init", "--vocab-file", vocab,
                    "--output-dir", tmp_path / "out", "--max-seq-length", seq, "--micro-batch-size", batch, "--epochs",
                    epochs, "--lr", lr, "--seed", seed, "--log-interval", 1000, "--no-do-predict") == 0
    ours = json.load(open(tmp_path / "out" / "eval_results.json"))["eval_accuracy"]

    tok = transformers.BertTokenizerFast(vocab, do_lower_case=True)

    def encode(rows):
        enc = tok([s for s, _ in rows], padding="max_length", max_length=seq, truncation=True, return_tensors="pt")
        return {**enc, "labels": torch.tensor([y for _, y in rows])}

    steps = int(np.ceil(epochs * len(train) / batch))
    no_decay = [any(k in n for k in ("bias", "LayerNorm.weight")) for n, _ in hf.named_parameters()]
    params = [p for _, p in hf.named_parameters()]
    opt = torch.optim.AdamW([{"params": [p for p, nd in zip(params, no_decay) if not nd], "weight_decay": 0.01},
                             {"params": [p for p, nd in zip(params, no_decay) if nd], "weight_decay": 0.0}],
                            lr=lr, eps=1e-6)
    schedule = transformers.get_linear_schedule_with_warmup(opt, int(0.1 * steps), steps)
    batches = feature_batches(encode(train), global_batch=batch, micro_batch=batch, dp_rank=0, dp_size=1, seed=seed)
    hf.train()
    for _ in range(steps):
        hf(**next(batches)).loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad()
    hf.eval()
    with torch.no_grad():
        enc = encode(dev)
        theirs = (hf(**enc).logits.argmax(-1) == enc["labels"]).float().mean().item()
    print(f"dev accuracy: megabert {ours:.4f}, transformers loop {theirs:.4f}")
    assert abs(ours - theirs) <= 0.01 and theirs > 0.6  # the task was learnt, not both at chance


def test_google_run_classifier_head_names():
    """run_classifier.py keeps its classifier as top-level output_weights [num_labels, hidden]
    and output_bias: read as transformers' classifier, which makes the checkpoint a
    BertForSequenceClassification of that many labels."""
    from megabert.checkpoint.tf import _architecture, hf_name

    assert hf_name("output_weights") == ("classifier.weight", False)
    assert hf_name("output_bias") == ("classifier.bias", False)
    assert hf_name("output_weights/adam_m") is None
    assert _architecture({"classifier.weight": torch.zeros(3, 8)}) == "BertForSequenceClassification"
    assert _architecture({"qa_outputs.weight": torch.zeros(2, 8)}) == "BertForQuestionAnswering"


def test_eval_results_keys_and_submission_formats(tmp_path):
    """run_glue.py's keys (eval_combined_score where a task has two metrics) and GLUE's
    submission lines: label words, 0/1, STS-B scores with three decimals."""
    from megabert.tasks.glue.finetuning import eval_results, write_submission

    logits = np.array([[2.0, -1.0], [0.0, 1.0], [0.5, 0.1]], np.float32)
    mrpc = eval_results(TASKS["mrpc"], logits, np.array([0, 1, 1]))
    assert set(mrpc) == {"eval_loss", "eval_accuracy", "eval_f1", "eval_combined_score", "eval_samples"}
    assert mrpc["eval_accuracy"] == pytest.approx(2 / 3) and mrpc["eval_f1"] == pytest.approx(2 / 3)
    scores = np.array([[4.25], [0.5], [2.0]], np.float32)
    sts = eval_results(TASKS["sts-b"], scores, np.array([5.0, 1.0, 2.5]))
    assert sts["eval_pearson"] > 0.9 and sts["eval_spearmanr"] == pytest.approx(1.0)
    assert sts["eval_loss"] == pytest.approx(np.mean([0.75 ** 2, 0.5 ** 2, 0.5 ** 2]))
    write_submission(tmp_path / "STS-B.tsv", TASKS["sts-b"], scores)
    assert open(tmp_path / "STS-B.tsv").read() == "index\tprediction\n0\t4.250\n1\t0.500\n2\t2.000\n"
    write_submission(tmp_path / "RTE.tsv", TASKS["rte"], logits)
    assert open(tmp_path / "RTE.tsv").read().splitlines()[1:] == ["0\tentailment", "1\tnot_entailment",
                                                                    "2\tentailment"]
    write_submission(tmp_path / "CoLA.tsv", TASKS["cola"], logits)
    assert open(tmp_path / "CoLA.tsv").read().splitlines()[1:] == ["0\t0", "1\t1", "2\t0"]


def test_regression_model_saves_as_transformers_regression(tmp_path, vocab):
    """STS-B's one-output model: save_hf writes problem_type regression, and transformers'
    model from that directory gives the same scores."""
    from megabert.config import ModelConfig

    megabert.init_parallel()
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=70, num_labels=1,
                      max_position_embeddings=64)
    model = megabert.BertForSequenceClassification(cfg).eval()
    model.save_hf(str(tmp_path / "hf"), vocab)
    megabert.destroy_parallel()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.problem_type == "regression" and hf.config.num_labels == 1
    ids = torch.randint(1, 70, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_finetune_from_google_tf_dir(glue_setup, tmp_path):
    """--load takes a Google TF BERT directory (its vocab.txt when --vocab-file is left out)."""
    _, data = glue_setup
    tf_dir = os.path.join(ROOT, "tests", "fixtures", "tf_bert_tiny")
    assert run_main("--task-name", "mnli", "--data-dir", data, "--load", tf_dir, "--output-dir", tmp_path,
                    "--max-seq-length", 32, "--micro-batch-size", 8, "--train-iters", 2, "--no-do-predict") == 0
    assert json.load(open(tmp_path / "eval_results.json"))["eval_samples"] == 20
