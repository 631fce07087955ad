"""finetune_embeddings.py as retrieval teams run it: query / document prompts and lengths
(the export's prompts encode as megabert), Matryoshka (the loss a weighted sum over cut
embeddings, exact under the gradient cache; scores per size; sentence-transformers'
truncate_dim), --no-duplicates and several training files (BatchPlan: no text twice in a
global batch, one file per batch, deterministic, resumable), --eval-interval with
--keep-best, and one-line errors on bad input. The layouts: tests/test_embeddings.py."""
import json

import numpy as np
import pytest
import torch

import megabert
from megabert.data import build_tokenizer
from megabert.errors import DataError
from megabert.tasks.embeddings.data import Pair, read_beir, read_pairs
from megabert.tasks.embeddings.evaluation import cut
from megabert.tasks.embeddings.features import TextFormat, pairs_to_tensors
from megabert.tasks.embeddings.grad_cache import ContrastiveObjective, GradientCacheRunner
from megabert.tasks.embeddings.loss import Matryoshka, contrastive_loss
from megabert.tasks.embeddings.sampling import BatchPlan, TrainingFile, plan_batches
from megabert.training.strategy import SequentialRunner, TrainingTask

from tests.helpers.cli_utils import run_main
from tests.test_embeddings import _features, _grads, _model, common, losses, run, setup  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")
SCRIPT = "finetune_embeddings.py"


# ---------------------------------------------------------------- prompts, lengths and the export


def test_prompts_lengths_and_matryoshka_export(setup, tmp_path):
    """--query-prompt / --document-prompt and the two lengths format training pairs, the dev
    set and the export alike: the export's config_sentence_transformers.json holds the
    prompts as `query` and `document`; SentenceTransformer(dir).encode(x, prompt_name="query")
    and encode_document equal megabert's query and passage embeddings (1e-5), and with
    truncate_dim=16 (normalised) its Matryoshka cut; eval_results.json scores every size."""
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "out"
    run("--eval-dir", setup["beir"], "--load", setup["plain"], "--output-dir", out, "--max-seq-length", 24,
        "--query-max-length", 10, "--query-prompt", "f1 f2 ", "--document-prompt", "f3 ", "--matryoshka-dims", "32,16")
    results = json.load(open(out / "eval_results.json"))
    assert {"ndcg_at_10", "ndcg_at_10@32", "ndcg_at_10@16", "recall_at_100@16"} <= set(results)
    assert results["ndcg_at_10@32"] == pytest.approx(results["ndcg_at_10"], abs=1e-6)
    st_dir = out / "sentence-transformers"
    config = json.load(open(st_dir / "config_sentence_transformers.json"))
    assert config["prompts"] == {"query": "f1 f2 ", "document": "f3 "}

    tok = build_tokenizer("BertWordPieceLowerCase", setup["vocab"])
    fmt = TextFormat(24, query_length=10, query_prompt="f1 f2 ", document_prompt="f3 ")
    queries = ["k1 k2 f4", "k3 " * 7]  # the second is cut at 10 tokens (its prompt's two included)
    docs = ["k5 k6 f7 f8", "k9 " * 30]  # the second is cut at 24
    q = fmt.queries(queries, tok)
    assert q["attention_mask"].sum(1).tolist() == [2 + 2 + 3, 10]
    assert q["input_ids"].shape == (2, 24)
    pairs = pairs_to_tensors([Pair(queries[1], docs[1], (docs[0],))], tok, fmt)
    assert torch.equal(pairs["input_ids"][0, 0], q["input_ids"][1])
    assert torch.equal(pairs["input_ids"][0, 1:], fmt.documents(docs[::-1], tok)["input_ids"])
    ps = megabert.init_parallel()
    try:
        model = _model(setup["plain"], ps, 1).eval()
        with torch.no_grad():
            ours_q = model(**q).embeddings[:, 0].numpy()
            ours_d = model(**fmt.documents(docs, tok)).embeddings[:, 0].numpy()
    finally:
        megabert.destroy_parallel()
    st = SentenceTransformer(str(st_dir), device="cpu")
    # Queries short enough for the export's one max_seq_length (the documents' 24): cut alike.
    np.testing.assert_allclose(st.encode(queries[:1], prompt_name="query"), ours_q[:1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(st.encode_query(queries[:1]), ours_q[:1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(st.encode_document(docs), ours_d, atol=1e-5, rtol=0)
    small = SentenceTransformer(str(st_dir), device="cpu", truncate_dim=16)
    np.testing.assert_allclose(small.encode(docs, prompt_name="document", normalize_embeddings=True),
                               cut(ours_d, 16, True), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- Matryoshka


def test_matryoshka_loss_and_gradient_cache(setup):
    """The Matryoshka loss is the weighted sum of InfoNCE over the cut, re-normalised
    embeddings (a hand computation); under the gradient cache (chunks of 2) its loss and
    every gradient equal one forward with its graph (1e-6, float64)."""
    ps = megabert.init_parallel()
    try:
        batch = _features(setup)
        model = _model(setup["plain"], ps, batch["input_ids"].size(1), fp64=True).train()
        m = Matryoshka((32, 16, 8), (1.0, 0.5, 0.25))
        out = model(**batch)
        loss = contrastive_loss(out.embeddings, out.text_mask, temperature=0.05, dp_group=None, matryoshka=m)
        e, mask = out.embeddings.detach(), out.text_mask
        expected = 0.0
        for d, w in zip(m.dims, m.weights):
            x = torch.nn.functional.normalize(e[..., :d], dim=-1)
            pool = torch.cat([x[:, 1], x[:, 2:].reshape(-1, d)])
            valid = torch.cat([mask[:, 1], mask[:, 2:].reshape(-1)])
            logits = (x[:, 0] @ pool.t() / 0.05).masked_fill(~valid, float("-inf"))
            expected += w * torch.nn.functional.cross_entropy(logits, torch.arange(len(x)))
        assert abs(loss.item() - expected.item()) < 1e-10
        loss.backward()
        ref = _grads(model)
        model.zero_grad(set_to_none=True)
        objective = ContrastiveObjective(0.05, None, m)
        task = TrainingTask(inputs=("input_ids", "token_type_ids", "attention_mask", "text_mask"),
                            output_loss=objective)
        metrics = GradientCacheRunner(SequentialRunner(model, task), model, objective, ps,
                                      piece_size=2).forward_backward([batch])
        assert abs(metrics[0]["contrastive_loss"].item() - loss.item()) < 1e-6
        for k, g in _grads(model).items():
            assert torch.allclose(g, ref[k], atol=1e-6, rtol=0), (k, (g - ref[k]).abs().max().item())
    finally:
        megabert.destroy_parallel()


# ---------------------------------------------------------------- no duplicates, several files


def _pairs(n, shared_every=0, prefix="q"):
    """n pairs; with shared_every k, every k-th pair's positive is the same passage."""
    return [Pair(f"{prefix}{i}", "the shared passage" if shared_every and i % shared_every == 0 else f"p{prefix}{i}",
                 (f"n{prefix}{i}",)) for i in range(n)]


def _texts(pairs, batch):
    return [t for i in batch for t in (pairs[i].query, pairs[i].positive, *pairs[i].negatives)]


def test_no_duplicates_removes_the_false_negative():
    """A passage that is the positive of every 4th pair: the plain order puts two of its
    copies in one global batch (each query then scores its own positive's copy as a
    negative: a false negative); --no-duplicates never does, over 3 epochs, with every pair
    handed out (deferred, not dropped) and the deferrals counted; the same seed gives the
    same batches and a resume from step 5 the rest of them."""
    pairs = _pairs(64, shared_every=4)
    files = [TrainingFile("a", "a.jsonl", 0, pairs)]
    plain = BatchPlan(files, global_batch=8, seed=3, no_duplicates=False)
    plain_batches = [b for _, b in _take(plain, 24)]
    assert any(_texts(pairs, b).count("the shared passage") > 1 for b in plain_batches)
    plan = BatchPlan(files, global_batch=8, seed=3, no_duplicates=True)
    batches = [b for _, b in _take(plan, 24)]
    for b in batches:
        texts = _texts(pairs, b)
        assert len(texts) == len(set(texts)), b
    assert plan.deferrals > 0 and plan.deferred_pairs
    # Every pair comes (no pair dropped): 24 batches of 8 = 3 epochs' worth of 64.
    counts = np.bincount([i for b in batches for i in b], minlength=64)
    assert counts.min() >= 1 and counts.sum() == 192
    assert [b for _, b in _take(BatchPlan(files, global_batch=8, seed=3, no_duplicates=True), 24)] == batches
    assert [b for _, b in _take(BatchPlan(files, global_batch=8, seed=3, no_duplicates=True), 19, skip=5)] == \
        batches[5:]
    # Without duplicates in the data, the order is the driver's (feature_batches).
    from megabert.training.finetune import feature_batches

    clean = [TrainingFile("a", "a.jsonl", 0, _pairs(20))]
    ours = plan_batches(BatchPlan(clean, global_batch=8, seed=3, no_duplicates=True),
                        {"input_ids": torch.arange(20)}, micro_batch=4, dp_rank=1, dp_size=2, consumed=16)
    theirs = feature_batches({"input_ids": torch.arange(20)}, global_batch=8, micro_batch=4, dp_rank=1, dp_size=2, seed=3,
                             consumed=16)
    assert [next(ours)["input_ids"].tolist() for _ in range(6)] == [next(theirs)["input_ids"].tolist() for _ in range(6)]


def _take(plan, n, skip=0):
    it = plan.global_batches(skip=skip)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("sampling", ["proportional", "round_robin"])
def test_several_files_one_per_global_batch(sampling):
    """Two files: every global batch (all DP ranks' micro-batches) comes from one of them;
    round_robin alternates; proportional draws with weights (a 1:3 weight gives the second
    file about 3/4 of the steps); every DP rank sees the same file at every step."""
    files = [TrainingFile("a", "a.jsonl", 0, _pairs(24, prefix="a")),
             TrainingFile("b", "b.jsonl", 24, _pairs(40, prefix="b"))]
    weights = [1.0, 3.0] if sampling == "proportional" else None
    seen = []
    streams = []
    for rank in range(2):
        plan = BatchPlan(files, global_batch=8, seed=5, no_duplicates=True, sampling=sampling, weights=weights)
        order = []
        streams.append((plan_batches(plan, {"i": torch.arange(64)}, micro_batch=2, dp_rank=rank, dp_size=2,
                                     consumed=0, on_step=order.append), order))
    for step in range(200):
        rows = []
        for it, order in streams:
            rows += [i for _ in range(2) for i in next(it)["i"].tolist()]
        files_of = {0 if i < 24 else 1 for i in rows}
        assert len(files_of) == 1 and len(rows) == 8 and len(set(rows)) == 8
        seen.append(files_of.pop())
        assert streams[0][1][-1] == streams[1][1][-1] == seen[-1]
    if sampling == "round_robin":
        assert seen[:6] == [0, 1, 0, 1, 0, 1]
    else:
        assert 0.65 < np.mean(seen) < 0.85


def test_several_files_resume_and_per_file_loss(setup, tmp_path):
    """Two training files, --no-duplicates and Matryoshka through the entry script: the
    metrics hold the loss per file (contrastive_loss_NAME, the mean over that file's steps);
    4 steps equal 2, a stop and the same command resuming from --save (losses and scores)."""
    extra = ["--train-file", setup["train"], setup["train2"], "--no-duplicates", "--matryoshka-dims", "32,8",
             "--dataset-sampling", "round_robin", "--lr-decay-iters", 4, "--lr-warmup-fraction", 0.25,
             "--micro-batch-size", 4]
    run(*common(setup, setup["plain"], tmp_path / "full", "--train-iters", 4, "--metrics-file",
                tmp_path / "f.jsonl", *extra))
    lines = [json.loads(line) for line in open(tmp_path / "f.jsonl")]
    # round_robin, one step per log line: the step's file's loss is the step's loss.
    assert [sorted(k for k in line if k.startswith("contrastive_loss_")) for line in lines] == \
        [["contrastive_loss_train"], ["contrastive_loss_train2"]] * 2
    assert all(line["contrastive_loss_train" + ("2" if i % 2 else "")] == line["contrastive_loss"]
               for i, line in enumerate(lines))
    part = common(setup, setup["plain"], tmp_path / "part", "--metrics-file", tmp_path / "p.jsonl", "--save",
                  tmp_path / "ckpt", *extra)
    run(*part, "--train-iters", 2)
    run(*part, "--train-iters", 4)
    assert losses(tmp_path / "p.jsonl") == losses(tmp_path / "f.jsonl")
    assert json.load(open(tmp_path / "part" / "eval_results.json")) == \
        json.load(open(tmp_path / "full" / "eval_results.json"))


# ---------------------------------------------------------------- evaluation during training


def test_keep_best_exports_the_best(setup, tmp_path):
    """--eval-interval 1 --keep-best ndcg_at_10: eval_results.json is the evaluation with the
    highest nDCG@10 (its step recorded; the first of equals), and the exported weights are
    that step's: those of the same run stopped there."""
    from safetensors.torch import load_file

    schedule = ["--lr-decay-iters", 4, "--lr-warmup-fraction", 0.25, "--lr", 3e-3]
    run(*common(setup, setup["plain"], tmp_path / "best", "--train-iters", 4, "--eval-interval", 1, "--keep-best",
                "ndcg_at_10", "--metrics-file", tmp_path / "m.jsonl", *schedule))
    dev = {r["iteration"]: r["dev_ndcg_at_10"] for r in map(json.loads, open(tmp_path / "m.jsonl"))
           if "dev_ndcg_at_10" in r}
    assert sorted(dev) == [1, 2, 3]
    results = json.load(open(tmp_path / "best" / "eval_results.json"))
    run(*common(setup, setup["plain"], tmp_path / "last", "--train-iters", 4, *schedule))
    dev[4] = json.load(open(tmp_path / "last" / "eval_results.json"))["ndcg_at_10"]
    best = max(dev, key=lambda k: (dev[k], -k))
    assert results["step"] == best and results["ndcg_at_10"] == pytest.approx(dev[best], abs=1e-12)
    run(*common(setup, setup["plain"], tmp_path / "stop", "--train-iters", best, *schedule))
    ours = load_file(tmp_path / "best" / "sentence-transformers" / "model.safetensors")
    stop = load_file(tmp_path / "stop" / "sentence-transformers" / "model.safetensors")
    for k, v in ours.items():
        assert torch.equal(v, stop[k]), k


# ---------------------------------------------------------------- bad input


def _one_line_error(r, text):
    assert r.returncode != 0 and text in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]


def test_bad_input_is_one_line(setup, tmp_path):
    """Pairs: no positive, a negative of the wrong type. BEIR: a non-UTF-8 byte in
    corpus.jsonl, qrels naming a document the corpus lacks, a duplicated corpus _id; qrels
    without a header keep their first judgement. The script: Matryoshka sizes above the
    hidden size, a file too small for one global batch without duplicates."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "a", "positive": "b"}\n{"query": "a"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: 'positive' must be a string, got nothing"):
        read_pairs(str(bad))
    bad.write_text('{"query": "a", "positive": "b", "negative": {"x": 1}}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: 'negative' must be a string or a list of strings"):
        read_pairs(str(bad))

    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "queries.jsonl").write_text('{"_id": "q1", "text": "k1"}\n{"_id": "q2", "text": "k2"}\n')
    corpus = '{"_id": "d1", "text": "k1 k3"}\n{"_id": "d2", "title": "t", "text": "k2"}\n'
    (beir / "corpus.jsonl").write_text(corpus)
    (beir / "qrels" / "dev.tsv").write_text("q1\td1\t1\nq2\td2\t1\n")  # no header
    assert read_beir(str(beir)).qrels == {"q1": {"d1": 1}, "q2": {"d2": 1}}
    (beir / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td9\t1\n")
    with pytest.raises(DataError, match=r"dev.tsv:3: corpus-id 'd9' is not in .*corpus.jsonl"):
        read_beir(str(beir))
    (beir / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    (beir / "corpus.jsonl").write_text(corpus + '{"_id": "d1", "text": "again"}\n')
    with pytest.raises(DataError, match=r"corpus.jsonl:3: _id 'd1' is already line 1's"):
        read_beir(str(beir))
    (beir / "corpus.jsonl").write_bytes(corpus.encode() + b'{"_id": "d3", "text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"corpus.jsonl:3: byte 0xe9 at column 27 is not UTF-8"):
        read_beir(str(beir))

    r = run_main(SCRIPT, *map(str, common(setup, setup["plain"], tmp_path / "o", "--matryoshka-dims", "64,16")))
    _one_line_error(r, "--matryoshka-dims 64,16: 64 exceeds the model's hidden size 32")
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"query": f"q{i}", "positive": "same"}) + "\n" for i in range(12)))
    r = run_main(SCRIPT, *map(str, common(setup, setup["plain"], tmp_path / "o", "--no-duplicates", "--train-file",
                                          small)))
    _one_line_error(r, f"--no-duplicates: {small} cannot fill one global batch of 8 pairs without repeating a text "
                       f"(12 pairs, 13 distinct texts)")
