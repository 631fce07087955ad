"""GLUE with a model (files, metrics and submission formats: tests/test_glue_data.py):
features against transformers' tokenizer, the model against transformers (logits and
gradients, TP 1 and 2), the Hugging Face export and import of the classifier, and
finetune_glue.py end to end: resume, layouts, and dev-metric parity with a transformers
loop."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

import megabert
from megabert.checkpoint.hf import megabert_to_hf
from megabert.corpus.tokenizer_training import BERT_SPECIALS
from megabert.data import build_tokenizer
from megabert.errors import ConfigError
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table
from megabert.tasks.glue.features import examples_to_tensors, truncate_pair

from tests.helpers.cli_utils import main_worker
from tests.helpers.dist_utils import run_distributed
from tests.helpers.glue_files import write
from tests.helpers.hf_models import make_hf_dir
from tests.helpers.pretrain_runs import TORCHRUN


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
transformers = pytest.importorskip("transformers")


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
    return make_hf_dir(path, "BertForSequenceClassification", dropout=dropout, num_labels=num_labels)


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
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(procs),
           os.path.join(ROOT, "finetune_glue.py")]
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_layouts_follow_one_process(glue_setup, tmp_path):
    """Without dropout, 6 fine-tuning steps at TP=2, PP=2 and ZeRO-3 DP=2 (two processes each:
    TP=2 under torchrun, the others finetune_glue.py's main() on the warm worker pool) give
    one process's losses within 1e-4 (gradient accumulation over the same global batch), and
    their dev results (through pipeline stages, gathered over DP ranks)."""
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
        if name == "tp2":
            r = torchrun(2, *args(name), *extra)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        else:
            run_distributed(main_worker, 2, "finetune_glue.py", [str(a) for a in (*args(name), *extra)])
        assert losses(tmp_path / f"{name}.jsonl") == pytest.approx(one, abs=1e-4), name
        assert json.load(open(tmp_path / name / "eval_results.json")) == pytest.approx(one_results, abs=1e-4), name


def test_bf16_fp16_and_zero3_offload_follow_fp32(glue_setup, tmp_path):
    """The same Strategy as pre-training and SQuAD carries GLUE's other set-ups: bf16 and
    fp16 (dynamic loss scaling) follow fp32 to their precision, and ZeRO-3 with optimizer
    and parameter offload (the fused AdamW on the CPU partitions, one process) gives fp32's losses."""
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


def test_finetune_packed_resumes_exactly(glue_setup, tmp_path):
    """finetune_glue.py --pack-sequences: rows of several MNLI features; a run stopped after 2
    steps resumes to the uninterrupted run's losses (dropout on), and evaluation (unpacked)
    writes eval_results.json."""
    dirs, data = glue_setup
    packed = ["--pack-sequences", "--max-samples-per-row", 4, "--micro-batch-size", 2, "--global-batch-size", 4,
              "--lr-decay-iters", 4, "--lr-warmup-fraction", 0.25]
    full = common(dirs["dropout"], data, tmp_path / "full", "--train-iters", 4, "--metrics-file", tmp_path / "f.jsonl",
                  *packed)
    assert run_main(*full) == 0
    assert set(json.load(open(tmp_path / "full" / "eval_results.json"))) >= {"eval_loss", "eval_accuracy"}
    rows = [json.loads(line) for line in open(tmp_path / "f.jsonl")]
    assert len(rows) == 4 and all(r["samples_per_row"] > 1 and 0 < r["real_token_share"] <= 1 for r in rows)
    part = common(dirs["dropout"], data, tmp_path / "part", "--metrics-file", tmp_path / "p.jsonl", "--save",
                  tmp_path / "ckpt", "--no-do-eval", "--no-do-predict", *packed)
    assert run_main(*part, "--train-iters", 2) == 0
    assert run_main(*part, "--train-iters", 4) == 0
    assert losses(tmp_path / "p.jsonl") == losses(tmp_path / "f.jsonl")
