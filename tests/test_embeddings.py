"""finetune_embeddings.py: retrieval metrics against a hand computation, the global-batch
negatives (DP=2 equals DP=1, loss and gradients), the gradient cache (equals one forward
with its graph, dropout masks replayed), the sentence-transformers export, exact resume,
and the layouts (DP, TP, PP, gradient accumulation) against one process; the same from a
transformers ModernBERT dir (its export a sentence-transformers ModernBertModel)."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

import megabert
from megabert.data import build_tokenizer
from megabert.errors import DataError
from megabert.tasks.embeddings.data import read_beir, read_pairs
from megabert.tasks.embeddings.features import TextFormat, pairs_to_tensors, texts_to_tensors
from megabert.tasks.embeddings.grad_cache import ContrastiveObjective, GradientCacheRunner
from megabert.tasks.embeddings.loss import Matryoshka, contrastive_loss
from megabert.tasks.embeddings.metrics import retrieval_metrics
from megabert.tasks.embeddings.model import BertForSentenceEmbedding, EmbeddingOptions, ModernBertForSentenceEmbedding
from megabert.training.strategy import SequentialRunner, TrainingTask

from tests.helpers.cli_utils import main_worker, run_main
from tests.helpers.dist_utils import run_distributed
from tests.helpers.modernbert_models import make_modernbert_dir, save_tokenizer
from tests.helpers.retrieval_files import write_retrieval_set

transformers = pytest.importorskip("transformers")
SCRIPT = "finetune_embeddings.py"


# ---------------------------------------------------------------- metrics and files


def test_metrics_equal_a_hand_computation():
    """trec_eval's nDCG@10 (graded gains, a judged doc missing from the corpus still in the
    ideal) and recall, MTEB's MRR@10, a query whose id is a document's (that document never
    retrieved for it), a query without relevant docs (zeros), and a tie (trec_eval's order:
    the larger doc id first)."""
    docs = ["d1", "d2", "d3", "d4", "d5"]
    scores = np.array([[0.1, 0.9, 0.5, 0.3, 0.2],     # q1: d2 d3 d4 d5 d1
                       [0.0, 0.8, 0.1, 0.7, 0.99],    # d5: itself dropped -> d2 d4 d3 d1
                       [0.5, 0.4, 0.3, 0.2, 0.1],     # q3: nothing relevant
                       [0.5, 0.5, 0.3, 0.2, 0.1]])    # q4: tie d1 = d2 -> d2 d1 ...
    qrels = {"q1": {"d1": 2, "d3": 1, "d9": 1}, "d5": {"d4": 1, "d2": 0}, "q3": {"d1": 0}, "q4": {"d1": 1}}
    got = retrieval_metrics(scores, ["q1", "d5", "q3", "q4"], docs, qrels)
    l2 = math.log2
    ndcg_q1 = (1 / l2(3) + 2 / l2(6)) / (2 / l2(2) + 1 / l2(3) + 1 / l2(4))
    expected = {"ndcg_at_10": (ndcg_q1 + 1 / l2(3) + 0 + 1 / l2(3)) / 4,
                "mrr_at_10": (1 / 2 + 1 / 2 + 0 + 1 / 2) / 4,
                "recall_at_10": (2 / 3 + 1 + 0 + 1) / 4,
                "recall_at_100": (2 / 3 + 1 + 0 + 1) / 4}
    assert got == pytest.approx(expected, abs=1e-12)
    # Past the cut: a relevant doc at rank 11 counts for recall@100 only.
    many = [f"x{i:02d}" for i in range(12)]
    row = np.linspace(1.0, 0.0, 12)[None, :]
    got = retrieval_metrics(row, ["q"], many, {"q": {"x10": 1}})
    assert (got["recall_at_10"], got["recall_at_100"], got["mrr_at_10"]) == (0.0, 1.0, 0.0)


def test_files_and_features(tmp_path):
    """Pairs with 0 to 2 negatives -> [n, T, s] features whose empty slots are masked;
    BEIR's passage text is title + " " + text; errors name the file and line."""
    paths = write_retrieval_set(tmp_path, train_pairs=3, dev_queries=2, train_topics=4, dev_topics=2,
                                negatives="mixed")
    pairs = read_pairs(paths["train"])
    assert [len(p.negatives) for p in pairs] == [0, 1, 2]
    tok = build_tokenizer("BertWordPieceLowerCase", paths["vocab"])
    t = pairs_to_tensors(pairs, tok, TextFormat(16))
    assert t["input_ids"].shape == (3, 4, 16) and t["text_mask"].tolist() == [
        [True, True, False, False], [True, True, True, False], [True, True, True, True]]
    hf = transformers.BertTokenizerFast(paths["vocab"], do_lower_case=True)
    ref = hf([pairs[2].query], padding="max_length", max_length=16, truncation=True)
    assert t["input_ids"][2, 0].tolist() == ref["input_ids"][0]
    beir = read_beir(paths["beir"])
    first = json.loads(open(os.path.join(paths["beir"], "corpus.jsonl")).readline())
    assert beir.passages[0] == first["title"] + " " + first["text"]
    assert set(beir.qrels) == set(beir.query_ids) == {"q0", "q1"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "a", "positive": "b"}\n{"query": "a", "positive": "b", "negative": 3}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: 'negative' must be a string or a list of strings"):
        read_pairs(str(bad))
    os.remove(os.path.join(paths["beir"], "qrels", "dev.tsv"))
    with pytest.raises(DataError, match=r"qrels/dev.tsv does not exist"):
        read_beir(paths["beir"])


# ---------------------------------------------------------------- the model, the loss and the cache


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The synthetic retrieval set and two tiny random transformers BertModels over its vocab
    (dropout 0.1 and 0)."""
    root = tmp_path_factory.mktemp("emb")
    paths = write_retrieval_set(root / "data", train_pairs=48, dev_queries=12, train_topics=16, dev_topics=8)
    # A second training file (other topics, the same words) for the several-files runs.
    other = write_retrieval_set(root / "other", train_pairs=32, dev_queries=2, train_topics=8, dev_topics=2, seed=1)
    paths["train2"] = str(root / "data" / "train2.jsonl")
    rows = [json.loads(line) for line in open(other["train"])]
    # Eight more queries of the first eight positives: copies --no-duplicates keeps apart.
    rows += [{**row, "query": row["query"] + " f9"} for row in rows[:8]]
    with open(paths["train2"], "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    size = len(open(paths["vocab"]).read().split())
    for name, p in (("dropout", 0.1), ("plain", 0.0)):
        cfg = transformers.BertConfig(vocab_size=size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=p,
                                      attention_probs_dropout_prob=p)
        torch.manual_seed(0)
        transformers.BertModel(cfg).save_pretrained(root / name)
        shutil.copyfile(paths["vocab"], root / name / "vocab.txt")
        paths[name] = str(root / name)
    return paths


def _model(path, ps, texts_per_example, pooling="mean", fp64=False):
    """fp64: the model in float64 (the PyTorch backends), where summation order no longer
    hides a wrong scale behind float32 rounding (~1e-6 relative over a batch's tokens)."""
    extra = dict(params_dtype=torch.float64, attention_backend="torch", layernorm_backend="torch",
                 dropout_add_backend="torch") if fp64 else {}
    model = BertForSentenceEmbedding.from_pretrained(path, ps, unpad_input=True, **extra)
    model.options = EmbeddingOptions(pooling=pooling, texts_per_example=texts_per_example)
    return model


def _features(paths, n=8, mixed=True):
    pairs = read_pairs(paths["train"])[:n]
    if mixed:  # rows with 0, 1 and 2 hard negatives
        from megabert.tasks.embeddings.data import Pair

        pairs = [Pair(p.query, p.positive, p.negatives * (i % 3)) for i, p in enumerate(pairs)]
    return pairs_to_tensors(pairs, build_tokenizer("BertWordPieceLowerCase", paths["vocab"]), TextFormat(24))


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _dp_body(rank, world, paths):
    ps = megabert.init_parallel()
    batch = _features(paths)
    t = batch["input_ids"].size(1)
    # DP = 1 on the whole global batch (no group: no communication), on every rank alike.
    model = _model(paths["plain"], ps, t, fp64=True).train()
    out = model(**batch)
    whole = contrastive_loss(out.embeddings, out.text_mask, temperature=0.05, dp_group=None)
    whole.backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    # DP = 2: each rank its half, the candidates gathered with their gradients; the
    # strategies' DP average of the gradients; the logged loss is the ranks' mean.
    half = {k: v[rank * 4:(rank + 1) * 4] for k, v in batch.items()}
    out = model(**half)
    loss = contrastive_loss(out.embeddings, out.text_mask, temperature=0.05, dp_group=ps.dp_group)
    loss.backward()
    _check_dp_average(loss, whole, model, ref)
    # The same with Matryoshka: every cut of the one gather's candidates.
    matryoshka = Matryoshka((32, 16, 8), (1.0, 0.5, 0.25))
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    whole = contrastive_loss(out.embeddings, out.text_mask, temperature=0.05, dp_group=None, matryoshka=matryoshka)
    whole.backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    out = model(**half)
    loss = contrastive_loss(out.embeddings, out.text_mask, temperature=0.05, dp_group=ps.dp_group,
                            matryoshka=matryoshka)
    loss.backward()
    _check_dp_average(loss, whole, model, ref)
    megabert.destroy_parallel()


def _check_dp_average(loss, whole, model, ref):
    """The DP ranks' mean loss and mean gradients equal one process's (1e-6)."""
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    assert abs(mean.item() / 2 - whole.item()) < 1e-6, (mean.item() / 2, whole.item())
    for k, g in _grads(model).items():
        torch.distributed.all_reduce(g)
        assert torch.allclose(g / 2, ref[k], atol=1e-6, rtol=0), (k, (g / 2 - ref[k]).abs().max().item())


def test_gathered_negatives_dp2_equal_dp1(setup):
    """The loss over the global batch with every rank's candidates gathered (and their
    gradients summed back) equals one process holding the whole batch: loss within 1e-6,
    every parameter gradient within 1e-6 (in float64; the float32 runs: the layouts test),
    plain and with Matryoshka (sizes 32, 16, 8)."""
    run_distributed(_dp_body, 2, setup)


@pytest.mark.parametrize("dropout", [False, True])
def test_gradient_cache_equals_one_forward(setup, dropout):
    """--embedding-chunk-size: 8 examples in chunks of 2 (and 3 micro-batches' worth of
    accumulation is the same code). Without dropout the cached step's loss and gradients
    equal one forward of all 8 with its graph; with dropout, they equal the forward of the
    same chunks with their graphs kept, from the same RNG state (the masks replayed)."""
    ps = megabert.init_parallel()
    try:
        batch = _features(setup)
        model = _model(setup["dropout" if dropout else "plain"], ps, batch["input_ids"].size(1), fp64=True).train()
        objective = ContrastiveObjective(0.05, None)
        task = TrainingTask(inputs=("input_ids", "token_type_ids", "attention_mask", "text_mask"),
                            output_loss=objective)
        runner = GradientCacheRunner(SequentialRunner(model, task), model, objective, ps, piece_size=2)
        torch.manual_seed(5)
        tracked = model.rng.get_states()  # the per-TP-rank stream (attention dropout) too
        metrics = runner.forward_backward([batch])
        cached_loss, cached = metrics[0]["contrastive_loss"].item(), _grads(model)
        assert len(metrics) == 4 and all(m["contrastive_loss"].item() == cached_loss for m in metrics)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        model.rng.set_states(tracked)
        if dropout:
            chunks = [model(**{k: v[i:i + 2] for k, v in batch.items()}) for i in range(0, 8, 2)]
            emb = torch.cat([c.embeddings for c in chunks])
            mask = torch.cat([c.text_mask for c in chunks])
        else:
            out = model(**batch)
            emb, mask = out.embeddings, out.text_mask
        loss = contrastive_loss(emb, mask, temperature=0.05, dp_group=None)
        loss.backward()
        assert abs(cached_loss - loss.item()) < 1e-6
        ref = _grads(model)
        assert set(ref) == set(cached)
        for k in ref:
            assert torch.allclose(cached[k], ref[k], atol=1e-6, rtol=0), (k, (cached[k] - ref[k]).abs().max().item())
    finally:
        megabert.destroy_parallel()


# ---------------------------------------------------------------- the entry script


def common(paths, load, out, *extra):
    return ["--train-file", paths["train"], "--eval-dir", paths["beir"], "--load", load, "--output-dir", out,
            "--max-seq-length", 24, "--micro-batch-size", 8, "--global-batch-size", 8, "--seed", 3, "--lr", 1e-3,
            "--log-interval", 1, *extra]


def run(*args):
    r = run_main(SCRIPT, *[str(a) for a in args])
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def losses(path):
    """The logged training losses (not the evaluation lines of --eval-interval)."""
    return [row["contrastive_loss"] for row in map(json.loads, open(path)) if "contrastive_loss" in row]


def st_encode(path, texts):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True, batch_size=4)


def test_resume_and_sentence_transformers_export(setup, tmp_path):
    """4 steps with dropout and gradient accumulation (the cache replaying masks) equal 2
    steps, a stop, and the same command again resuming from --save: the losses and the
    dev scores. The sentence-transformers export encodes as megabert: the fine-tuned model
    from --save (mean pooling, normalised) and a cls / dot-product variant, within 1e-5."""
    schedule = ["--lr-decay-iters", 4, "--lr-warmup-fraction", 0.25, "--micro-batch-size", 4]
    run(*common(setup, setup["dropout"], tmp_path / "full", "--train-iters", 4, "--metrics-file",
                tmp_path / "f.jsonl", *schedule))
    results = json.load(open(tmp_path / "full" / "eval_results.json"))
    assert set(results) == {"ndcg_at_10", "mrr_at_10", "recall_at_10", "recall_at_100"}
    assert all(0 <= v <= 1 for v in results.values())
    ckpt = tmp_path / "ckpt"
    part = common(setup, setup["dropout"], tmp_path / "part", "--metrics-file", tmp_path / "p.jsonl", "--save", ckpt,
                  *schedule)
    run(*part, "--train-iters", 2)
    run(*part, "--train-iters", 4)
    assert losses(tmp_path / "p.jsonl") == losses(tmp_path / "f.jsonl")
    assert json.load(open(tmp_path / "part" / "eval_results.json")) == results

    corpus = [json.loads(line) for line in open(os.path.join(setup["beir"], "corpus.jsonl"))]
    texts = [d["title"] + " " + d["text"] for d in corpus[:6]] + ["k1 " * 40, "f2"]  # one cut at 24 tokens
    tok = build_tokenizer("BertWordPieceLowerCase", setup["vocab"])
    ps = megabert.init_parallel()
    try:
        model = _model(str(ckpt), ps, 1).eval()
        with torch.no_grad():
            ours = model(**texts_to_tensors(texts, tok, 24)).embeddings[:, 0].numpy()
    finally:
        megabert.destroy_parallel()
    np.testing.assert_allclose(st_encode(tmp_path / "part" / "sentence-transformers", texts), ours, atol=1e-5,
                               rtol=0)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0)

    run("--eval-dir", setup["beir"], "--load", setup["plain"], "--output-dir", tmp_path / "cls", "--max-seq-length",
        24, "--pooling", "cls", "--no-normalize")
    ps = megabert.init_parallel()
    try:
        model = BertForSentenceEmbedding.from_pretrained(setup["plain"], ps, unpad_input=True)
        model.options = EmbeddingOptions(pooling="cls", normalize=False)
        with torch.no_grad():
            ours = model.eval()(**texts_to_tensors(texts, tok, 24)).embeddings[:, 0].numpy()
    finally:
        megabert.destroy_parallel()
    np.testing.assert_allclose(st_encode(tmp_path / "cls" / "sentence-transformers", texts), ours, atol=1e-5, rtol=0)
    assert not np.allclose(np.linalg.norm(ours, axis=1), 1.0)


def test_layouts_follow_one_process(setup, tmp_path):
    """Without dropout, 3 steps of a global batch of 8 at DP=2 (negatives gathered), DP=2 with
    gradient accumulation and chunks (the cache at each rank), TP=2 (one micro-batch: the direct step),
    PP=2 (two micro-batches through the pipeline schedule, cached; and one, direct), ZeRO-3
    at DP=2 and one process with --embedding-chunk-size 2 give one process's losses within
    1e-5, and its dev scores (queries and passages encoded through the stages, gathered over
    DP ranks; per Matryoshka size) and its exported weights; with two training files,
    --no-duplicates, Matryoshka and --eval-interval/--keep-best on (the per-file losses and the
    step-2 scores too)."""

    def args(name, *extra):
        # Two training files (round robin), --no-duplicates and Matryoshka: the batch order is
        # BatchPlan's at every layout, the loss a sum over sizes; an evaluation during training
        # (at step 2 of 3, exported if the best) through every layout's forward and gather.
        return common(setup, setup["plain"], tmp_path / name, "--train-iters", 3, "--metrics-file",
                      tmp_path / f"{name}.jsonl", "--train-file", setup["train"], setup["train2"],
                      "--dataset-sampling", "round_robin", "--no-duplicates", "--matryoshka-dims", "32,16",
                      "--eval-interval", 2, "--keep-best", "ndcg_at_10", *extra)

    run(*args("one"))
    one = losses(tmp_path / "one.jsonl")
    one_results = json.load(open(tmp_path / "one" / "eval_results.json"))
    assert len(one) == 3
    run(*args("chunk", "--embedding-chunk-size", 2))
    # dp2_accum: 2 micro-batches per rank in chunks of 1, so the overlapped DP reduction
    # counts 4 backward passes per step, not 2.
    layouts = {"dp2": [], "dp2_accum": ["--micro-batch-size", 2, "--embedding-chunk-size", 1],
               "tp2": ["--tensor-model-parallel-size", 2, "--micro-batch-size", 8],
               "pp2": ["--pipeline-model-parallel-size", 2, "--micro-batch-size", 4],
               "pp2_direct": ["--pipeline-model-parallel-size", 2, "--micro-batch-size", 8],
               "zero3": ["--deepspeed", "--zero-stage", 3]}
    for name, extra in layouts.items():
        run_distributed(main_worker, 2, SCRIPT, [str(a) for a in args(name, "--micro-batch-size", 4, *extra)])
    from safetensors.torch import load_file

    one_weights = load_file(tmp_path / "one" / "sentence-transformers" / "model.safetensors")
    per_file = [{k: v for k, v in json.loads(line).items() if k.startswith("contrastive_loss_")}
                for line in open(tmp_path / "one.jsonl") if "contrastive_loss" in line]
    assert [list(p) for p in per_file] == [["contrastive_loss_train"], ["contrastive_loss_train2"],
                                           ["contrastive_loss_train"]]
    def dev(name):
        return [{k: v for k, v in json.loads(line).items() if k.startswith("dev_")}
                for line in open(tmp_path / f"{name}.jsonl") if "dev_ndcg_at_10" in line]

    assert len(dev("one")) == 1 and "step" in one_results
    for name in ("chunk", *layouts):
        assert losses(tmp_path / f"{name}.jsonl") == pytest.approx(one, abs=1e-5), name
        assert dev(name)[0] == pytest.approx(dev("one")[0], abs=1e-5), name
        theirs = [{k: v for k, v in json.loads(line).items() if k.startswith("contrastive_loss_")}
                  for line in open(tmp_path / f"{name}.jsonl") if "contrastive_loss" in line]
        assert [list(p) for p in theirs] == [list(p) for p in per_file], name
        assert all(p == pytest.approx(q, abs=1e-5) for p, q in zip(theirs, per_file)), name
        assert json.load(open(tmp_path / name / "eval_results.json")) == pytest.approx(one_results, abs=1e-5), name
        # The export gathers every TP shard, pipeline stage and ZeRO-3 partition.
        weights = load_file(tmp_path / name / "sentence-transformers" / "model.safetensors")
        assert weights.keys() == one_weights.keys(), name
        for k, v in weights.items():
            assert torch.allclose(v, one_weights[k], atol=1e-5, rtol=0), (name, k)


@pytest.fixture(scope="module")
def modernbert(setup, tmp_path_factory):
    """A tiny random transformers ModernBERT (masked LM, 4 layers with local and global
    attention, dropout 0) and a BPE tokenizer.json trained on the retrieval set's texts."""
    root = tmp_path_factory.mktemp("modernbert")
    make_modernbert_dir(root)
    corpus = [json.loads(line) for line in open(os.path.join(setup["beir"], "corpus.jsonl"))]
    texts = [d["title"] + " " + d["text"] for d in corpus]
    texts += [t for p in read_pairs(setup["train"]) for t in (p.query, p.positive, *p.negatives)]
    save_tokenizer(root, texts)
    return str(root), texts


def test_modernbert_trains_exports_and_follows_tp2(setup, modernbert, tmp_path):
    """finetune_embeddings.py --load a transformers ModernBERT dir (its tokenizer.json): 2 steps
    in one process and at TP=2 give the same losses, dev scores and exported weights (within
    1e-5); the export is a sentence-transformers ModernBertModel + tokenizer.json whose
    encode() equals megabert's mean-pooled, normalised embeddings of the fine-tuned model
    (from --save) within 1e-5, over texts of several lengths padded in one batch and one cut
    at --max-seq-length; and the [CLS] / dot-product variant's."""
    from safetensors.torch import load_file

    hf_dir, texts = modernbert

    def args(name, *extra):
        return common(setup, hf_dir, tmp_path / name, "--train-iters", 2, "--metrics-file",
                      tmp_path / f"{name}.jsonl", *extra)

    run(*args("one", "--save", tmp_path / "ckpt"))
    run_distributed(main_worker, 2, SCRIPT, [str(a) for a in args("tp2", "--tensor-model-parallel-size", 2)])
    one = losses(tmp_path / "one.jsonl")
    assert len(one) == 2 and one[0] != one[1]
    assert losses(tmp_path / "tp2.jsonl") == pytest.approx(one, abs=1e-5)
    assert json.load(open(tmp_path / "tp2" / "eval_results.json")) == pytest.approx(
        json.load(open(tmp_path / "one" / "eval_results.json")), abs=1e-5)
    st_dir = tmp_path / "one" / "sentence-transformers"
    one_weights, tp2_weights = load_file(st_dir / "model.safetensors"), \
        load_file(tmp_path / "tp2" / "sentence-transformers" / "model.safetensors")
    assert tp2_weights.keys() == one_weights.keys()
    for k, v in tp2_weights.items():
        assert torch.allclose(v, one_weights[k], atol=1e-5, rtol=0), k
    assert json.load(open(st_dir / "config.json"))["architectures"] == ["ModernBertModel"]
    assert os.path.isfile(st_dir / "tokenizer.json")

    sample = texts[:6] + [" ".join(texts[:8]), texts[0].split()[0]]  # one cut at 24 tokens, one short
    tok = build_tokenizer("HuggingFaceTokenizer", os.path.join(hf_dir, "tokenizer.json"))
    ps = megabert.init_parallel()
    try:
        model = ModernBertForSentenceEmbedding.from_pretrained(str(tmp_path / "ckpt"), ps, unpad_input=True)
        model.options = EmbeddingOptions(pooling="mean", texts_per_example=1)
        features = texts_to_tensors(sample, tok, 24)
        with torch.no_grad():
            ours = model.eval()(**features).embeddings[:, 0].numpy()
    finally:
        megabert.destroy_parallel()
    lengths = features["attention_mask"].sum(1).tolist()
    assert max(lengths) == 24 and min(lengths) < 8, lengths
    np.testing.assert_allclose(st_encode(st_dir, sample), ours, atol=1e-5, rtol=0)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0)

    # [CLS] pooling without normalisation (the last layer computes position 0 alone), untrained.
    run("--eval-dir", setup["beir"], "--load", hf_dir, "--output-dir", tmp_path / "cls", "--max-seq-length", 24,
        "--pooling", "cls", "--no-normalize")
    ps = megabert.init_parallel()
    try:
        model = ModernBertForSentenceEmbedding.from_pretrained(hf_dir, ps, unpad_input=True)
        model.options = EmbeddingOptions(pooling="cls", normalize=False)
        with torch.no_grad():
            ours = model.eval()(**features).embeddings[:, 0].numpy()
    finally:
        megabert.destroy_parallel()
    np.testing.assert_allclose(st_encode(tmp_path / "cls" / "sentence-transformers", sample), ours, atol=1e-5,
                               rtol=0)
    assert not np.allclose(np.linalg.norm(ours, axis=1), 1.0)


def test_cli_errors_are_one_line(setup, tmp_path):
    r = run_main(SCRIPT, "--train-file", setup["train"], "--load", setup["plain"], "--output-dir", str(tmp_path),
                 "--micro-batch-size", "4", "--global-batch-size", "8", "--embedding-chunk-size", "3")
    assert r.returncode == 2 and r.stderr.strip() == \
        "error: --embedding-chunk-size 3 must divide --micro-batch-size 4"
    r = run_main(SCRIPT, "--train-file", setup["train"], "--load", setup["plain"])
    assert r.returncode == 2 and "--output-dir is required" in r.stderr and "\n" not in r.stderr.strip()
