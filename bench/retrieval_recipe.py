"""The retrieval recipe, megabert against sentence-transformers on the same synthetic data:
hard negatives mined with a model against in-batch negatives alone, and Matryoshka (dev
nDCG@10 per embedding size). Prints figures; no pass/fail.

Data (tests/helpers/retrieval_files.py): (query, positive) pairs over topics of key words,
where sibling topics share half of their key words: a random in-batch passage is an easy
negative, a sibling topic's passage a hard one. The dev set (BEIR layout) holds new topics,
with their siblings, so its near-duplicates are what separates the runs.

Same on both sides: the model (a transformers BertModel, random init from one seed, loaded by
both), the pairs and their order (megabert's permutation, replayed), the global batch, the
steps, InfoNCE at temperature 0.05 (MultipleNegativesRankingLoss scale 20), mean pooling,
normalised embeddings, AdamW with megabert's fine-tuning recipe, and the scorer
(megabert.tasks.embeddings.metrics).

Runs, each from the same init:
1. in-batch negatives alone;
2. mined: negatives mined with run 1's model from the pairs' positives (megabert:
   tools/mine_hard_negatives.py; sentence-transformers: mine_hard_negatives on its run 1,
   which needs the `datasets` package), then trained on (query, positive, negative);
3. Matryoshka on the mined pairs (--matryoshka-dims / MatryoshkaLoss), scored per size, beside
   run 2's model cut to the same sizes.

    python bench/retrieval_recipe.py [--pairs 512 --hidden 64 --batch 32 --epochs 2]
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from bench.embeddings_vs_sentence_transformers import make_init, run_arguments, st_model  # noqa: E402
from megabert.config import OptimConfig  # noqa: E402
from megabert.optim import LRSchedule  # noqa: E402
from megabert.tasks.embeddings.data import Pair, read_beir, read_pairs  # noqa: E402
from megabert.tasks.embeddings.evaluation import cut  # noqa: E402
from megabert.tasks.embeddings.metrics import retrieval_metrics  # noqa: E402
from megabert.training.finetune import feature_batches  # noqa: E402
from tests.helpers.retrieval_files import write_retrieval_set  # noqa: E402


def script(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path).removesuffix(".py"), os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Megabert:
    """finetune_embeddings.py and tools/mine_hard_negatives.py as a user runs them (in process)."""

    def __init__(self, work: str, args):
        self.work, self.args = work, args
        self.train_script, self.mine_script = script("finetune_embeddings.py"), script("tools/mine_hard_negatives.py")

    def _run(self, module, argv) -> None:
        with open(os.path.join(self.work, "megabert.log"), "a") as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            rc = module.main([str(a) for a in argv])
        assert rc in (0, None), f"{module.__name__} failed (see {self.work}/megabert.log)"

    def train(self, name: str, train_file: str, init: str, beir: str, *extra) -> dict:
        a = self.args
        out = os.path.join(self.work, name)
        self._run(self.train_script, ["--train-file", train_file, "--eval-dir", beir, "--load", init, "--output-dir",
                                      out, "--max-seq-length", a.seq, "--micro-batch-size", a.batch,
                                      "--global-batch-size", a.batch, "--lr", a.lr, "--seed", a.seed, "--epochs",
                                      a.epochs, *extra])
        return json.load(open(os.path.join(out, "eval_results.json")))

    def scores_per_dim(self, name: str, model_dir: str, beir: str, dims) -> dict:
        out = os.path.join(self.work, name)
        self._run(self.train_script, ["--eval-dir", beir, "--load", model_dir, "--output-dir", out,
                                      "--max-seq-length", self.args.seq, "--matryoshka-dims", ",".join(map(str, dims))])
        results = json.load(open(os.path.join(out, "eval_results.json")))
        return {d: results[f"ndcg_at_10@{d}"] for d in dims}

    def mine(self, model_dir: str, pairs: str, output: str) -> None:
        a = self.args
        margin = ["--relative-margin", a.relative_margin] if a.relative_margin is not None else []
        self._run(self.mine_script, ["--pairs", pairs, "--load", model_dir, "--output", output, "--num-negatives", 1,
                                     "--range-min", a.range_min, *margin, "--micro-batch-size", 128])


def st_train(init: str, pairs: list[Pair], args, dims=None):
    """sentence-transformers' model and loss (MNRL, or MatryoshkaLoss around it) in a plain loop
    over megabert's order of the pairs."""
    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss
    except ImportError:
        from sentence_transformers.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    torch.manual_seed(args.seed)
    model = st_model(init, args.seq)
    loss_fn = MultipleNegativesRankingLoss(model, scale=1.0 / 0.05)
    if dims:
        loss_fn = MatryoshkaLoss(model, loss_fn, matryoshka_dims=list(dims))
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.999), eps=1e-6)
    steps = int(np.ceil(args.epochs * len(pairs) / args.batch))
    schedule = LRSchedule(OptimConfig(lr=args.lr, lr_warmup_fraction=0.1, lr_decay_style="linear",
                                      lr_decay_iters=steps), steps)
    order = feature_batches({"input_ids": torch.arange(len(pairs))}, global_batch=args.batch,
                            micro_batch=args.batch, dp_rank=0, dp_size=1, seed=args.seed)
    tokenize = getattr(model, "preprocess", None) or model.tokenize  # renamed in sentence-transformers 6
    for step in range(1, steps + 1):
        model.train()
        rows = [pairs[i] for i in next(order)["input_ids"].tolist()]
        columns = [[r.query for r in rows], [r.positive for r in rows]]
        if rows[0].negatives:
            columns.append([r.negatives[0] for r in rows])
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        loss = loss_fn([dict(tokenize(c)) for c in columns], None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


def st_ndcg(model, beir, dims) -> dict:
    """nDCG@10 of the model, and of its embeddings cut to each size (re-normalised)."""
    q = model.encode(beir.queries, batch_size=128, convert_to_numpy=True, show_progress_bar=False)
    p = model.encode(beir.passages, batch_size=128, convert_to_numpy=True, show_progress_bar=False)
    out = {}
    for d in dims:
        out[d] = retrieval_metrics(cut(q, d, True) @ cut(p, d, True).T, beir.query_ids, beir.corpus_ids,
                                   beir.qrels)["ndcg_at_10"]
    return out


def st_mine(model, pairs: list[Pair], args) -> list[Pair] | None:
    try:
        import datasets
    except ImportError:
        return None
    from sentence_transformers.util import mine_hard_negatives

    data = datasets.Dataset.from_dict({"query": [p.query for p in pairs], "positive": [p.positive for p in pairs]})
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        mined = mine_hard_negatives(data, model, num_negatives=1, range_min=args.range_min,
                                    relative_margin=args.relative_margin, output_format="triplet", verbose=False)
    by_query = {q: n for q, n in zip(mined["query"], mined["negative"])}
    # Pairs whose query found no negative keep none (as megabert's output); the batch then has
    # no hard-negative column for them, so they are dropped from the triplet training.
    return [Pair(p.query, p.positive, (by_query[p.query],)) for p in pairs if p.query in by_query]


def main() -> None:
    p = run_arguments(__doc__)
    # About the positives a topic has (1024 pairs over 128 topics): they are relevant, so the
    # top ranks are skipped rather than mined as (false) negatives. A margin instead can leave
    # a weak first model's pairs without a negative, which sentence-transformers' triplets
    # then drop while megabert trains them with in-batch negatives alone.
    p.add_argument("--range-min", type=int, default=8)
    p.add_argument("--relative-margin", type=float, default=None)
    args = p.parse_args()
    work = args.work_dir or tempfile.mkdtemp(prefix="retrieval_bench_")
    paths = write_retrieval_set(os.path.join(work, "data"), train_pairs=args.pairs, dev_queries=args.dev_queries,
                                train_topics=128, dev_topics=100, passages_per_dev_topic=3, seed=args.seed,
                                negatives="none")
    init = os.path.join(work, "init")
    make_init(init, paths["vocab"], args)
    beir = read_beir(paths["beir"])
    dims = [args.hidden // f for f in (1, 2, 4, 8)]
    logging.disable(logging.WARNING)
    start = time.perf_counter()

    mb = Megabert(work, args)
    mb_inbatch = mb.train("mb_inbatch", paths["train"], init, paths["beir"])["ndcg_at_10"]
    mined_file = os.path.join(work, "mb_mined.jsonl")
    mb.mine(os.path.join(work, "mb_inbatch", "sentence-transformers"), paths["train"], mined_file)
    mined = read_pairs(mined_file)
    mb_mined = mb.train("mb_mined", mined_file, init, paths["beir"])["ndcg_at_10"]
    mb_plain_dims = mb.scores_per_dim("mb_mined_dims", os.path.join(work, "mb_mined", "sentence-transformers"),
                                      paths["beir"], dims)
    results = mb.train("mb_matryoshka", mined_file, init, paths["beir"], "--matryoshka-dims", ",".join(map(str, dims)))
    mb_matryoshka = {d: results[f"ndcg_at_10@{d}"] for d in dims}

    pairs = read_pairs(paths["train"])
    st_first = st_train(init, pairs, args)
    st_inbatch = st_ndcg(st_first, beir, dims[:1])[dims[0]]
    st_pairs = st_mine(st_first, pairs, args)
    st_mined = st_plain_dims = st_matryoshka = None
    if st_pairs is not None:
        st_second = st_train(init, st_pairs, args)
        st_plain_dims = st_ndcg(st_second, beir, dims)
        st_mined = st_plain_dims[dims[0]]
        st_matryoshka = st_ndcg(st_train(init, st_pairs, args, dims), beir, dims)

    def show(v):
        return f"{v:.4f}" if v is not None else "  -   "

    print(f"\nsynthetic retrieval: {args.pairs} pairs, dev {len(beir.query_ids)} queries / {len(beir.corpus_ids)} "
          f"passages on unseen topics with near-duplicate siblings; BERT {args.layers}x{args.hidden} (random init, "
          f"dropout 0.1), seq {args.seq}, batch {args.batch}, {args.epochs} epochs, lr {args.lr}; mining: 1 negative, "
          f"range_min {args.range_min}, relative_margin {args.relative_margin}")
    print(f"mined: megabert {sum(len(p.negatives) for p in mined)} of {len(mined)} pairs got a negative"
          + (f", sentence-transformers {len(st_pairs)}" if st_pairs is not None else
             "; sentence-transformers' mine_hard_negatives skipped (needs the datasets package)"))
    print(f"\n{'dev nDCG@10':<34} {'megabert':>9} {'sent-tr':>9}")
    print(f"{'in-batch negatives alone':<34} {show(mb_inbatch):>9} {show(st_inbatch):>9}")
    print(f"{'+ 1 mined hard negative':<34} {show(mb_mined):>9} {show(st_mined):>9}")
    print(f"\n{'nDCG@10 per size (mined pairs)':<34} {'megabert':>9} {'sent-tr':>9}   {'Matryoshka':>10} {'sent-tr':>9}")
    for d in dims:
        print(f"{f'dim {d}':<34} {show(mb_plain_dims[d]):>9} {show(st_plain_dims and st_plain_dims[d]):>9}   "
              f"{show(mb_matryoshka[d]):>10} {show(st_matryoshka and st_matryoshka[d]):>9}")
    print(f"\n(left: trained without Matryoshka, cut after; right: trained with it)  {time.perf_counter() - start:.0f} s; "
          f"work dir: {work}")


if __name__ == "__main__":
    main()
