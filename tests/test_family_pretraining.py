"""pretrain_bert.py with the families beyond BERT and ModernBERT: --load of a transformers dir
continues pre-training (its first loss is transformers' loss on the same batch, in bf16 within
its rounding, and a bf16 run resumes; TP 2 gives the losses of one process), --model-family
NAME pre-trains one from scratch with its recipe, and --pack-sequences runs with it."""
import json
import math
import os

import pytest

import megabert
from megabert.arguments import parse_args

from tests.conftest import _corpus
from tests.helpers.cli_utils import main_worker, run_main
from tests.helpers.dist_utils import run_distributed
from tests.helpers.family_models import make_family_dir
from tests.helpers.modernbert_models import save_tokenizer

transformers = pytest.importorskip("transformers")

FAMILIES = ["eurobert", "gte", "nomic_bert", "ultrabert"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tokenizer.json (the tiny models' 99 ids) and a corpus preprocessed with it."""
    d = tmp_path_factory.mktemp("family_corpus")
    _corpus(d / "corpus.jsonl", docs=60)
    with open(d / "corpus.jsonl") as f:
        save_tokenizer(d, [json.loads(line)["text"] for line in f])
    r = run_main("tools/preprocess_data.py", "--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "c"),
                 "--json-keys", "text", "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-file",
                 str(d / "tokenizer.json"), "--split-sentences", "--workers", "1")
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module", params=FAMILIES)
def hf_dir(request, corpus, tmp_path_factory):
    path = make_family_dir(tmp_path_factory.mktemp(request.param) / "hf", request.param)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.isfile(corpus / name):
            with open(corpus / name) as src, open(os.path.join(path, name), "w") as dst:
                dst.write(src.read())
    return path


def _argv(d, *extra):
    return ["--data-path", str(d / "c_text_sentence"), "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1",
            "--eval-interval", "0", "--num-workers", "0", "--split", "1,0,0", *extra]


def _reference_loss(argv, hf_dir) -> float:
    """transformers' fp32 loss on the first batch the run `argv` (one process) trains on."""
    from megabert.data import build_tokenizer
    from megabert.tasks.pretraining.batches import build_batches
    from megabert.training.resolve import resolve_run

    ps = megabert.init_parallel()
    run = resolve_run(parse_args(argv), ps)
    assert run.model.model_family == json.load(open(os.path.join(hf_dir, "config.json")))["model_type"]
    batch = next(build_batches(run, ps, build_tokenizer(run.data.tokenizer_type, run.data.vocab_file))[0](0))
    megabert.destroy_parallel()
    hf = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, attn_implementation="sdpa")
    return hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss.item()


def test_continued_pretraining_first_loss_equals_transformers(corpus, hf_dir, tmp_path):
    argv = _argv(corpus, "--load", hf_dir, "--save", str(tmp_path / "ckpt"), "--metrics-file",
                 str(tmp_path / "m.jsonl"), "--micro-batch-size", "4")
    ref = _reference_loss(argv, hf_dir)
    r = run_main("pretrain_bert.py", *argv)
    assert r.returncode == 0, r.stderr
    first = json.loads(open(tmp_path / "m.jsonl").readline())
    assert abs(first["lm_loss"] - ref) < 1e-5 * max(1.0, ref), (first["lm_loss"], ref)


def test_bf16_continued_pretraining_runs_and_resumes(corpus, hf_dir, tmp_path):
    """--bf16 from a transformers dir: the first loss is the fp32 one (transformers' on the same
    batch) within bf16's tolerance, and a run that stops after iteration 1 resumes at 2."""
    metrics, ckpt = tmp_path / "m.jsonl", str(tmp_path / "ckpt")
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--vocab-file", str(corpus / "tokenizer.json")]
    argv = _argv(corpus, "--load", hf_dir, "--save", ckpt, "--exit-interval", "1", "--bf16", "--metrics-file",
                 str(metrics), "--micro-batch-size", "4", *tokenizer)
    ref = _reference_loss(argv, hf_dir)
    r = run_main("pretrain_bert.py", *argv)
    assert r.returncode == 0, r.stderr
    r = run_main("pretrain_bert.py", *_argv(corpus, "--load", ckpt, "--save", ckpt, "--bf16", "--metrics-file",
                                            str(metrics), "--micro-batch-size", "4", *tokenizer))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in open(metrics)]
    assert [m["iteration"] for m in lines] == [1, 2] and math.isfinite(lines[1]["lm_loss"]), lines
    first = lines[0]["lm_loss"]
    print(f"BF16 {lines[0]['lm_loss']:.5f} fp32 {ref:.5f} diff {abs(first - ref):.1e}", flush=True)
    # Autocast rounds each GEMM's inputs to bf16 (8 significant bits: relative error up to
    # 2^-8); the loss averages the masked tokens' errors, so it stays within one such unit of
    # the fp32 loss (measured: 5e-5 to 7e-4 relative over the four families).
    assert abs(first - ref) < 2 ** -8 * ref, (first, ref)


def _losses(corpus, hf_dir, tmp_path, world, *layout):
    metrics = tmp_path / f"m{world}.jsonl"
    argv = _argv(corpus, "--load", hf_dir, "--train-iters", "3", "--metrics-file", str(metrics), *layout)
    run_distributed(main_worker, world, "pretrain_bert.py", argv)
    return [json.loads(line)["lm_loss"] for line in open(metrics)]


def test_continued_pretraining_at_tp2_equals_one_process(corpus, hf_dir, tmp_path):
    one = _losses(corpus, hf_dir, tmp_path, 1)
    two = _losses(corpus, hf_dir, tmp_path, 2, "--tensor-model-parallel-size", "2")
    assert len(one) == 3 and one[0] != one[2]
    for a, b in zip(one, two):
        assert abs(a - b) < 1e-5 * max(1.0, abs(a)), (one, two)


@pytest.mark.parametrize("family", FAMILIES)
def test_pretraining_from_scratch_with_packed_rows(corpus, family, tmp_path):
    r = run_main("pretrain_bert.py", *_argv(corpus, "--model-family", family, "--num-layers", "2", "--hidden-size",
                                            "32", "--num-attention-heads", "4", "--local-attention", "8",
                                            "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-file",
                                            str(corpus / "tokenizer.json"), "--pack-sequences",
                                            "--metrics-file", str(tmp_path / "m.jsonl")))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [m["iteration"] for m in lines] == [1, 2] and all(m["lm_loss"] > 0 for m in lines)
    assert "sop_loss" not in lines[0] and lines[0]["samples_per_row"] >= 1
