"""pretrain_bert.py with the families beyond BERT and ModernBERT: --load of a transformers dir
continues pre-training (its first loss is transformers' loss on the same batch; TP 2 gives the
losses of one process), --model-family NAME pre-trains one from scratch with its recipe, and
--pack-sequences runs with it."""
import json
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


def test_continued_pretraining_first_loss_equals_transformers(corpus, hf_dir, tmp_path):
    from megabert.data import build_tokenizer
    from megabert.tasks.pretraining.batches import build_batches
    from megabert.training.resolve import resolve_run

    argv = _argv(corpus, "--load", hf_dir, "--save", str(tmp_path / "ckpt"), "--metrics-file",
                 str(tmp_path / "m.jsonl"), "--micro-batch-size", "4")
    ps = megabert.init_parallel()
    run = resolve_run(parse_args(argv), ps)
    assert run.model.model_family == json.load(open(os.path.join(hf_dir, "config.json")))["model_type"]
    batch = next(build_batches(run, ps, build_tokenizer(run.data.tokenizer_type, run.data.vocab_file))[0](0))
    megabert.destroy_parallel()

    r = run_main("pretrain_bert.py", *argv)
    assert r.returncode == 0, r.stderr
    first = json.loads(open(tmp_path / "m.jsonl").readline())
    hf = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, attn_implementation="sdpa")
    ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    assert abs(first["lm_loss"] - ref.item()) < 1e-5 * max(1.0, ref.item()), (first["lm_loss"], ref.item())


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
