"""Sentence-embedding fine-tuning, megabert against sentence-transformers: the learning
curve (training loss, and dev nDCG@10 / MRR@10 / recall at points along the run) and the
final dev scores on a small synthetic retrieval set (tests/helpers/retrieval_files.py: new
topics at dev time, so the model must learn to match words), printed side by side.

Same on both sides: the model (a transformers BertModel of --layers / --hidden, random init
from one seed, saved once and loaded by both), the training pairs (query, positive, one hard
negative) and their order (megabert's per-epoch permutation, replayed for the other side),
the global batch, the steps, the loss (InfoNCE over in-batch + hard negatives at
temperature 0.05 = MultipleNegativesRankingLoss' scale 20, mean pooling, normalised
embeddings), AdamW with megabert's fine-tuning recipe (lr, 10% warm-up then linear decay,
weight decay 0.01 off biases and LayerNorms, eps 1e-6, clipping at 1.0), dropout 0.1, and the
scorer (megabert.tasks.embeddings.metrics; sentence-transformers' own
InformationRetrievalEvaluator is printed beside it for its final model, as a check of the
scorer).

megabert: finetune_embeddings.py's main() as a user runs it, stopped at each curve point with
--save and run again to the next (the resume is exact: tests/test_embeddings.py), so each
point's eval_results.json is the uninterrupted run's. sentence-transformers: its
SentenceTransformer (Transformer -> Pooling -> Normalize) and MultipleNegativesRankingLoss in
a plain loop (its Trainer needs `datasets` and `accelerate`, not installed here).

    python bench/embeddings_vs_sentence_transformers.py [--pairs 1024 --batch 32 --epochs 3 --points 4]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from megabert.config import OptimConfig  # noqa: E402
from megabert.optim import LRSchedule  # noqa: E402
from megabert.tasks.embeddings.data import read_beir, read_pairs  # noqa: E402
from megabert.tasks.embeddings.metrics import retrieval_metrics  # noqa: E402
from megabert.training.finetune import feature_batches  # noqa: E402
from tests.helpers.retrieval_files import write_retrieval_set  # noqa: E402

KEYS = ("ndcg_at_10", "mrr_at_10", "recall_at_10", "recall_at_100")


def make_init(path: str, vocab: str, args) -> None:
    import transformers

    cfg = transformers.BertConfig(vocab_size=len(open(vocab).read().split()), hidden_size=args.hidden,
                                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                  intermediate_size=4 * args.hidden, max_position_embeddings=64,
                                  hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    torch.manual_seed(args.seed)
    transformers.BertModel(cfg).save_pretrained(path)
    shutil.copyfile(vocab, os.path.join(path, "vocab.txt"))


def common_flags(args) -> list[str]:
    return ["--max-seq-length", str(args.seq), "--micro-batch-size", str(args.batch), "--global-batch-size",
            str(args.batch), "--lr", str(args.lr), "--seed", str(args.seed)]


def run_megabert(paths, init, work, args, steps, points) -> tuple[list[float], dict[int, dict], float]:
    spec = importlib.util.spec_from_file_location("finetune_embeddings", os.path.join(ROOT, "finetune_embeddings.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    metrics_file, ckpt = os.path.join(work, "megabert.jsonl"), os.path.join(work, "ckpt")
    curve, seconds = {}, 0.0
    for point in points:
        out = os.path.join(work, f"megabert_{point}")
        argv = ["--train-file", paths["train"], "--eval-dir", paths["beir"], "--load", init, "--output-dir", out,
                "--save", ckpt, "--train-iters", str(point), "--lr-decay-iters", str(steps),
                "--lr-warmup-fraction", "0.1", "--metrics-file", metrics_file, "--log-interval", "1",
                *common_flags(args)]
        start = time.perf_counter()
        with open(os.path.join(work, "megabert.log"), "a") as log, contextlib.redirect_stdout(log):
            rc = script.main(argv)  # its per-step lines go to the log; the table below is the output
        assert rc in (0, None), f"finetune_embeddings.py failed (see {work}/megabert.log)"
        seconds += time.perf_counter() - start
        curve[point] = json.load(open(os.path.join(out, "eval_results.json")))
    losses = [json.loads(line)["contrastive_loss"] for line in open(metrics_file)]
    return losses, curve, seconds


def st_model(init: str, seq: int):
    from sentence_transformers import SentenceTransformer
    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer import modules
    except ImportError:
        from sentence_transformers import models as modules

    transformer = modules.Transformer(init, max_seq_length=seq)
    dimension = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension
    pooling = modules.Pooling(dimension(), "mean")
    return SentenceTransformer(modules=[transformer, pooling, modules.Normalize()], device="cpu")


def st_scores(model, beir) -> dict:
    q = model.encode(beir.queries, batch_size=128, convert_to_numpy=True, show_progress_bar=False)
    p = model.encode(beir.passages, batch_size=128, convert_to_numpy=True, show_progress_bar=False)
    return retrieval_metrics(q @ p.T, beir.query_ids, beir.corpus_ids, beir.qrels)


def run_sentence_transformers(paths, init, args, steps, points) -> tuple[list[float], dict[int, dict], float, object]:
    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    except ImportError:
        from sentence_transformers.losses import MultipleNegativesRankingLoss

    torch.manual_seed(args.seed)
    model = st_model(init, args.seq)
    loss_fn = MultipleNegativesRankingLoss(model, scale=1.0 / 0.05)
    # megabert's weight-decay rule (biases and LayerNorms excluded), eps and schedule.
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.999), eps=1e-6)
    schedule = LRSchedule(OptimConfig(lr=args.lr, lr_warmup_fraction=0.1, lr_decay_style="linear",
                                      lr_decay_iters=steps), steps)
    pairs, beir = read_pairs(paths["train"]), read_beir(paths["beir"])
    order = feature_batches({"input_ids": torch.arange(len(pairs))}, global_batch=args.batch,
                            micro_batch=args.batch, dp_rank=0, dp_size=1, seed=args.seed)
    losses, curve, seconds = [], {}, 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        model.train()
        rows = [pairs[i] for i in next(order)["input_ids"].tolist()]
        columns = [[r.query for r in rows], [r.positive for r in rows], [r.negatives[0] for r in rows]]
        tokenize = getattr(model, "preprocess", None) or model.tokenize  # renamed in sentence-transformers 6
        features = [dict(tokenize(c)) for c in columns]
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        loss = loss_fn(features, None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seconds += time.perf_counter() - start
        losses.append(loss.item())
        if step in points:
            model.eval()
            curve[step] = st_scores(model, beir)
    return losses, curve, seconds, model


def st_evaluator_check(model, beir) -> dict:
    """sentence-transformers' own scorer on its final model (binary qrels here)."""
    from sentence_transformers.evaluation import InformationRetrievalEvaluator

    relevant = {q: {d for d, s in docs.items() if s > 0} for q, docs in beir.qrels.items()}
    ev = InformationRetrievalEvaluator(dict(zip(beir.query_ids, beir.queries)),
                                       dict(zip(beir.corpus_ids, beir.passages)), relevant, mrr_at_k=[10],
                                       ndcg_at_k=[10], accuracy_at_k=[10], precision_recall_at_k=[10, 100],
                                       map_at_k=[10], show_progress_bar=False, name="dev")
    out = ev(model)
    pick = {"ndcg_at_10": "ndcg@10", "mrr_at_10": "mrr@10", "recall_at_10": "recall@10", "recall_at_100": "recall@100"}
    return {k: next(v for name, v in out.items() if name.endswith(suffix)) for k, suffix in pick.items()}


def run_arguments(description: str) -> argparse.ArgumentParser:
    """The data, model and training flags of this bench and bench/retrieval_recipe.py."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=1024)
    p.add_argument("--dev-queries", type=int, default=200)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None)
    return p


def main() -> None:
    p = run_arguments(__doc__)
    p.add_argument("--points", type=int, default=4, help="dev evaluations along the run")
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    work = args.work_dir or tempfile.mkdtemp(prefix="emb_bench_")
    if os.path.isdir(os.path.join(work, "ckpt")):
        shutil.rmtree(os.path.join(work, "ckpt"))  # a fresh run, not a resume of an earlier one
    paths = write_retrieval_set(os.path.join(work, "data"), train_pairs=args.pairs, dev_queries=args.dev_queries,
                                train_topics=128, dev_topics=100, passages_per_dev_topic=3, seed=args.seed)
    init = os.path.join(work, "init")
    make_init(init, paths["vocab"], args)
    steps = int(np.ceil(args.epochs * args.pairs / args.batch))
    points = sorted({max(1, round(steps * (i + 1) / args.points)) for i in range(args.points)})
    beir = read_beir(paths["beir"])

    import logging
    logging.disable(logging.WARNING)  # info lines and deprecation notes of both sides; the table is the output
    before = st_scores(st_model(init, args.seq).eval(), beir)
    mb_losses, mb_curve, mb_s = run_megabert(paths, init, work, args, steps, points)
    st_losses, st_curve, st_s, st_final = run_sentence_transformers(paths, init, args, steps, points)

    print(f"\nsynthetic retrieval: {args.pairs} pairs (query, positive, 1 hard negative), dev {len(beir.query_ids)} "
          f"queries / {len(beir.corpus_ids)} passages on unseen topics; BERT {args.layers}x{args.hidden} (random "
          f"init, dropout 0.1), seq {args.seq}, batch {args.batch}, {steps} steps, lr {args.lr}, T 0.05, mean "
          f"pooling, normalised; {torch.get_num_threads()} CPU threads\n")
    print("training loss (mean over the steps of each stretch)")
    print(f"{'steps':>12} {'megabert':>10} {'sent-tr':>10}")
    edges = [0] + points
    for a, b in zip(edges[:-1], edges[1:]):
        print(f"{f'{a + 1}-{b}':>12} {np.mean(mb_losses[a:b]):>10.4f} {np.mean(st_losses[a:b]):>10.4f}")
    print("\ndev scores along the run (megabert | sentence-transformers)")
    print(f"{'step':>6} " + " ".join(f"{k:>23}" for k in KEYS))
    print(f"{0:>6} " + " ".join(f"{before[k]:>10.4f} | {before[k]:<10.4f}" for k in KEYS))
    for s in points:
        print(f"{s:>6} " + " ".join(f"{mb_curve[s][k]:>10.4f} | {st_curve[s][k]:<10.4f}" for k in KEYS))
    print("\nfinal: " + "  ".join(f"{k} {mb_curve[points[-1]][k]:.4f} vs {st_curve[points[-1]][k]:.4f}"
                                  for k in KEYS))
    check = st_evaluator_check(st_final, beir)
    print("sentence-transformers' InformationRetrievalEvaluator on its final model: " +
          "  ".join(f"{k} {check[k]:.4f}" for k in KEYS) + "  (megabert's scorer: " +
          "  ".join(f"{st_curve[points[-1]][k]:.4f}" for k in KEYS) + ")")
    print(f"training wall time (s, this machine, not a speed comparison: megabert's includes a model load, "
          f"a dev evaluation and a save per curve point): megabert {mb_s:.1f}, sentence-transformers {st_s:.1f}")
    print(f"work dir: {work}")


if __name__ == "__main__":
    main()
