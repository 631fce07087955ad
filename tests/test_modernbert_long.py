"""ModernBERT at its full context: pretrain_bert.py --seq-length 8192 on a corpus whose
documents are longer than 8192 tokens, through the entry script as a user runs it (from
scratch, and continued from a transformers dir, whose first loss on an 8192-token batch
is transformers' own)."""
import json
import math
import os
import random

import pytest

import megabert
from megabert.arguments import parse_args

from tests.conftest import WORDS
from tests.helpers.cli_utils import run_main
from tests.helpers.modernbert_models import make_modernbert_dir, save_tokenizer

transformers = pytest.importorskip("transformers")

SEQ = 8192


def _long_corpus(path, docs=4, sentences=700, seed=0):
    """`docs` documents of `sentences` sentences each: about 12k tokens a document with the
    test's BPE vocab, so a sample fills all 8192 positions from one document."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14))).capitalize() + "."
                     for _ in range(sentences)]
            f.write(json.dumps({"text": " ".join(sents)}) + "\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A transformers ModernBERT dir of 8192 positions (window 128) with its tokenizer.json,
    and the long corpus preprocessed with it."""
    d = tmp_path_factory.mktemp("modernbert_long")
    hf_dir = make_modernbert_dir(d / "hf", max_position_embeddings=SEQ, local_attention=128, num_hidden_layers=3,
                                 global_attn_every_n_layers=2)
    _long_corpus(d / "corpus.jsonl")
    with open(d / "corpus.jsonl") as f:
        save_tokenizer(hf_dir, [json.loads(line)["text"] for line in f])
    r = run_main("tools/preprocess_data.py", "--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "c"),
                 "--json-keys", "text", "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-file",
                 os.path.join(hf_dir, "tokenizer.json"), "--split-sentences", "--workers", "1")
    assert r.returncode == 0, r.stderr
    return d, hf_dir


def _argv(d, hf_dir, metrics, *extra):
    return ["--data-path", str(d / "c_text_sentence"), "--seq-length", str(SEQ), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "4", "--lr", "3e-3", "--lr-warmup-iters", "0",
            "--log-interval", "1", "--eval-interval", "0", "--num-workers", "0", "--split", "1,0,0",
            "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-file", os.path.join(hf_dir, "tokenizer.json"),
            "--metrics-file", str(metrics), *extra]


def _batches(argv, n):
    """The first `n` training batches pretrain_bert.py draws with these flags."""
    from megabert.data import build_tokenizer
    from megabert.tasks.pretraining.batches import build_batches
    from megabert.training.resolve import resolve_run

    cfg = parse_args(argv)
    ps = megabert.init_parallel()
    run = resolve_run(cfg, ps)
    it = build_batches(run, ps, build_tokenizer(run.data.tokenizer_type, run.data.vocab_file))[0](0)
    out = [next(it) for _ in range(n)]
    megabert.destroy_parallel()
    return out


def _rows(metrics):
    return [json.loads(line) for line in open(metrics)]


def test_pretraining_from_scratch_at_8192(setup, tmp_path):
    """A 2-layer, hidden-64 ModernBERT trains four steps on 8192-token samples: half the
    samples fill all 8192 positions from one document, 30% of every sample's tokens are
    predicted, and the loss is finite and falls."""
    d, hf_dir = setup
    argv = _argv(d, hf_dir, tmp_path / "m.jsonl", "--model-family", "modernbert", "--num-layers", "2",
                 "--hidden-size", "64", "--num-attention-heads", "2", "--short-seq-prob", "0")
    cfg = parse_args(argv)
    assert cfg.model.max_position_embeddings == SEQ and cfg.model.local_attention == 128
    lengths = []
    for batch in _batches(argv, 8):
        assert batch["input_ids"].shape == (1, SEQ)
        lengths.append(int(batch["attention_mask"].sum()))
        predicted = int((batch["labels"] != -100).sum())
        assert predicted == round(0.3 * (lengths[-1] - 2)), (lengths[-1], predicted)  # never [CLS], [SEP]
    # A document of about 12k tokens gives one full row and a row of its remaining sentences
    # (Megatron's sample mapping); the full ones have no padding at all.
    assert max(lengths) == SEQ and lengths.count(SEQ) >= len(lengths) // 2, lengths

    r = run_main("pretrain_bert.py", *argv)
    assert r.returncode == 0, r.stderr
    losses = [row["lm_loss"] for row in _rows(tmp_path / "m.jsonl")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    # From a uniform guess over the vocab (ln 99 = 4.6) the unigram distribution is learnt first.
    assert abs(losses[0] - math.log(99)) < 0.5 and losses[-1] < losses[0] - 0.1, losses


def test_continued_pretraining_at_8192_equals_transformers(setup, tmp_path):
    """pretrain_bert.py --load of a transformers dir at 8192 tokens: the first logged loss is
    transformers' on the same batch (RoPE at far positions, the local layers' window over a
    long row, the unpadded encoder and masked-only logits all agree)."""
    import torch

    d, hf_dir = setup
    argv = _argv(d, hf_dir, tmp_path / "m.jsonl", "--load", hf_dir, "--train-iters", "2")
    batch = _batches(argv, 1)[0]
    r = run_main("pretrain_bert.py", *argv)
    assert r.returncode == 0, r.stderr
    first = _rows(tmp_path / "m.jsonl")[0]
    hf = transformers.ModernBertForMaskedLM.from_pretrained(hf_dir, attn_implementation="sdpa")
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    assert abs(first["lm_loss"] - ref.item()) < 1e-5 * max(1.0, ref.item()), (first["lm_loss"], ref.item())
