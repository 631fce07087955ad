"""How well GLUE fine-tuning learns: finetune_glue.py (its real main(), in this process)
against a plain transformers loop on an SST-2-format task, same data, same initial weights
and the same budget, N seeds a side, interleaved. Prints dev accuracy per seed and the
mean and standard deviation per side. Nothing passes or fails: it measures.

Data: a synthetic SST-2-format set (train.tsv / dev.tsv, "sentence<TAB>label", no download):
sentences of 6 to 14 words, each with two to four opinion words among neutral ones; "not"
flips the word after it; the label is 1 when the positive opinions outnumber the negative
ones (ties are left out). The vocab is a WordPiece trained on the set.

Model: per seed s, a random-init transformers BertForSequenceClassification (torch seed s;
2 layers, hidden 128, 2 heads, intermediate 512, dropout 0.1) saved as a Hugging Face dir,
pooler and classifier included; both sides start from it.

The transformers side is what a user of transformers would write: run_glue.py's features
(the fast tokenizer, padding to --max-seq-length), torch.optim.AdamW(model.parameters(), lr)
with its defaults (weight decay 0.01 on every parameter, eps 1e-8), 10% linear warm-up then
linear decay (get_linear_schedule_with_warmup), no clipping, a fresh shuffle per epoch.

    nice -n 5 python bench/glue_vs_transformers.py [--seeds 4] [--sentences 1000] [--epochs 4]
        [--lr 1e-3] [--batch 32] [--jobs 2] [--megabert-flag=--clip-grad=0 ...]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

POSITIVE = ["good", "great", "lovely", "brilliant", "charming", "funny", "moving", "clever", "warm", "superb"]
NEGATIVE = ["bad", "dull", "awful", "boring", "clumsy", "weak", "tedious", "bland", "messy", "poor"]
NEUTRAL = ["the", "film", "story", "actors", "plot", "music", "was", "and", "quite", "with", "a", "scenes",
           "ending", "director", "script", "very", "at", "times", "its", "cast", "really", "overall", "but"]


def make_sentence(rng: random.Random) -> tuple[str, int] | None:
    words = [rng.choice(NEUTRAL) for _ in range(rng.randint(4, 10))]
    score = 0
    for _ in range(rng.randint(2, 4)):
        positive = rng.random() < 0.5
        word = rng.choice(POSITIVE if positive else NEGATIVE)
        negated = rng.random() < 0.25
        score += (1 if positive else -1) * (-1 if negated else 1)
        pos = rng.randint(0, len(words))
        words[pos:pos] = ["not", word] if negated else [word]
    if score == 0:
        return None
    return " ".join(words), int(score > 0)


def make_tsv(path: str, count: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    while len(rows) < count:
        row = make_sentence(rng)
        if row is not None:
            rows.append(row)
    with open(path, "w", encoding="utf-8") as f:
        f.write("sentence\tlabel\n")
        f.writelines(f"{s}\t{label}\n" for s, label in rows)


def read_tsv(path: str) -> tuple[list[str], list[int]]:
    lines = open(path, encoding="utf-8").read().splitlines()[1:]
    return [line.split("\t")[0] for line in lines], [int(line.split("\t")[1]) for line in lines]


def make_init_dir(path: str, vocab_file: str, seed: int) -> str:
    import shutil
    import transformers

    vocab_size = sum(1 for _ in open(vocab_file, encoding="utf-8"))
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=512, max_position_embeddings=512,
                                     num_labels=2)
    torch.manual_seed(seed)
    transformers.BertForSequenceClassification(config).save_pretrained(path)
    shutil.copy(vocab_file, os.path.join(path, "vocab.txt"))
    return path


def run_transformers(args, init_dir: str, seed: int) -> dict:
    import transformers

    tok = transformers.BertTokenizerFast(os.path.join(init_dir, "vocab.txt"), do_lower_case=True)

    def tensors(path):
        texts, labels = read_tsv(path)
        enc = tok(texts, truncation=True, max_length=args.max_seq_length, padding="max_length", return_tensors="pt")
        return {**{k: enc[k] for k in ("input_ids", "token_type_ids", "attention_mask")},
                "labels": torch.tensor(labels)}

    train, dev = tensors(os.path.join(args.data_dir, "train.tsv")), tensors(os.path.join(args.data_dir, "dev.tsv"))
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification.from_pretrained(init_dir).train()
    n = len(train["input_ids"])
    total = math.ceil(n / args.batch) * args.epochs
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = transformers.get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    g = torch.Generator().manual_seed(seed)
    for _ in range(args.epochs):
        order = torch.randperm(n, generator=g)
        for k in range(0, n, args.batch):
            index = order[k:k + args.batch]
            model(**{key: t[index] for key, t in train.items()}).loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(**{k: v[i:i + 128] for k, v in dev.items() if k != "labels"}).logits
                            for i in range(0, len(dev["labels"]), 128)])
    return {"accuracy": 100.0 * (logits.argmax(-1) == dev["labels"]).float().mean().item()}


def run_megabert(args, init_dir: str, seed: int, out_dir: str) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_glue", os.path.join(ROOT, "finetune_glue.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--task-name", "sst-2", "--data-dir", args.data_dir, "--load", init_dir, "--output-dir", out_dir,
            "--max-seq-length", str(args.max_seq_length), "--epochs", str(args.epochs), "--lr", str(args.lr),
            "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch), "--seed", str(seed),
            "--log-interval", "1000000", *args.megabert_flag]
    with contextlib.redirect_stdout(io.StringIO()):
        rc = module.main(argv)
    if rc:
        raise SystemExit(f"finetune_glue.py failed (exit {rc}): {' '.join(argv)}")
    return {"accuracy": 100.0 * json.load(open(os.path.join(out_dir, "eval_results.json")))["eval_accuracy"]}


def one_run(args, work: str, seed: int, side: str) -> dict:
    torch.set_num_threads(1)
    import logging
    import transformers
    transformers.logging.set_verbosity_error()
    logging.getLogger("megabert").setLevel(logging.WARNING)
    init_dir = os.path.join(work, f"init{seed}")
    t0 = time.perf_counter()
    if side == "transformers":
        r = run_transformers(args, init_dir, seed)
    else:
        r = run_megabert(args, init_dir, seed, tempfile.mkdtemp(prefix=f"megabert{seed}_", dir=work))
    r["seconds"] = time.perf_counter() - t0
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--sentences", type=int, default=1000, help="training sentences (dev: a quarter as many)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-seq-length", type=int, default=32)
    p.add_argument("--sides", default="transformers,megabert")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process with one thread")
    p.add_argument("--megabert-flag", action="append", default=[],
                   help="an extra finetune_glue.py flag (repeat; --megabert-flag=--clip-grad=0)")
    p.add_argument("--work-dir", default=None, help="default a temporary dir; one that holds the data is reused")
    args = p.parse_args()
    args.megabert_flag = [x for f in args.megabert_flag for x in f.split("=", 1)]
    import transformers
    from megabert.corpus.tokenizer_training import train_wordpiece

    work = args.work_dir or tempfile.mkdtemp(prefix="glue_vs_tf_")
    args.data_dir = os.path.join(work, "SST-2")
    os.makedirs(args.data_dir, exist_ok=True)
    vocab = os.path.join(work, "vocab.txt")
    if not os.path.exists(vocab):  # a work dir's data, vocab and initial models are reused as they are
        make_tsv(os.path.join(args.data_dir, "train.tsv"), args.sentences, seed=1000)
        make_tsv(os.path.join(args.data_dir, "dev.tsv"), args.sentences // 4, seed=2000)
        texts = read_tsv(os.path.join(args.data_dir, "train.tsv"))[0]
        train_wordpiece(texts, vocab, vocab_size=200, min_frequency=1)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    for seed in seeds:
        if not os.path.isdir(os.path.join(work, f"init{seed}")):
            make_init_dir(os.path.join(work, f"init{seed}"), vocab, seed)
    sides = args.sides.split(",")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, 1 thread per run, {args.jobs} runs at "
          f"a time | SST-2 format: {args.sentences} train / {args.sentences // 4} dev sentences, seq "
          f"{args.max_seq_length}, {args.epochs} epochs, lr {args.lr}, batch {args.batch} | megabert flags: "
          f"{' '.join(args.megabert_flag) or 'default'}", flush=True)
    runs = [(seed, side) for seed in seeds for side in (sides if seed % 2 else sides[::-1])]
    results: dict[str, dict[int, dict]] = {s: {} for s in sides}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = {pool.submit(one_run, args, work, seed, side): (seed, side) for seed, side in runs}
        for future in concurrent.futures.as_completed(futures):
            seed, side = futures[future]
            r = results[side][seed] = future.result()
            print(f"seed {seed} {side:<13} accuracy {r['accuracy']:6.2f} ({r['seconds']:.0f} s)", flush=True)
    for side in sides:
        acc = [results[side][s]["accuracy"] for s in seeds]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        print(f"{side:<13} accuracy mean {statistics.mean(acc):6.2f} sd {sd:5.2f} (min {min(acc):.1f} max "
              f"{max(acc):.1f})")
    print(json.dumps({s: [round(results[s][seed]["accuracy"], 2) for seed in seeds] for s in sides}))


if __name__ == "__main__":
    main()
