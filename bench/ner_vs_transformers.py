"""NER learning curves: finetune_ner.py against a plain transformers token-classification
loop, same model size, data, initial weights and budget. Prints dev precision / recall / F1
(entity level, seqeval's default mode as run_ner.py) and word accuracy after every epoch,
and each epoch's mean training loss, side by side. Nothing passes or fails.

The data is synthetic, CoNLL-like and lower-cased: template sentences ("{PER} works for
{ORG} in {LOC}") with filler words, four entity classes (PER, LOC, ORG, MISC) whose names
are made of syllables (so most split into sub-words), some names in two classes (the
context decides), multi-word entities (IOB2), and dev sentences where a quarter of the
names never occur in training.

Both sides start from one transformers BertForTokenClassification saved with the label set
(random init, seeded), see the same batches in the same order (finetune_ner.py's shuffle,
fed to both) and train with the same recipe, megabert's fine-tuning defaults as they stand:
AdamW (weight decay on all but biases and LayerNorm), warmup then linear decay, gradient
clipping; dropout 0.1. megabert's curve comes from finetune_ner.py itself, run once per epoch
with --save: each run resumes the last one exactly (--lr-decay-iters fixes the schedule)
and scores the dev file. The transformers side is run_ner.py's model and tokenization
(is_split_into_words, the first sub-word labelled) in a plain loop with its
get_linear_schedule_with_warmup.

    python bench/ner_vs_transformers.py [--train 1000 --dev 300 --epochs 5 --lr 1e-3 --batch 32
                                         --seq 64 --layers 2 --hidden 128 --heads 2 --seeds 1]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megabert.arguments import parse_finetune_args  # noqa: E402
from megabert.corpus.tokenizer_training import BERT_SPECIALS  # noqa: E402
from megabert.tasks.ner.config import NER_DEFAULTS, NerConfig  # noqa: E402
from megabert.tasks.ner.data import Sentence, label_set, read_sentences  # noqa: E402
from megabert.tasks.ner.metrics import ner_metrics  # noqa: E402
from megabert.training.finetune import feature_batches  # noqa: E402

SYLLABLES = ["ka", "ro", "mi", "tu", "lo", "ne", "sa", "vi", "de", "bu", "fa", "gi", "ho", "ju", "pe", "qu"]
TEMPLATES = [
    "{PER} visited {LOC} on monday",
    "{ORG} hired {PER} last year",
    "{PER} works for {ORG} in {LOC}",
    "the {MISC} festival in {LOC} was big",
    "{PER} said that {ORG} will buy {ORG}",
    "fans of {MISC} music met {PER} in {LOC}",
    "{ORG} opened an office in {LOC}",
    "the {MISC} team beat {ORG} again",
]
FILLER = ["the", "a", "and", "then", "very", "today", "again", "news", "report", "said", "more", "some"]
SUFFIX = {"ORG": ["corp", "inc", "group"], "LOC": ["city", "bay"], "PER": [], "MISC": ["cup", "league"]}


def make_names(rng, count):
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count)]


def make_data(seed, n_train, n_dev):
    """(train sentences, dev sentences, vocab words)."""
    rng = random.Random(seed)
    pools = {kind: make_names(rng, 40) for kind in SUFFIX}
    kinds = sorted(SUFFIX)
    for kind in kinds:  # a quarter of each class's names also belongs to another class
        other = kinds[(kinds.index(kind) + 1) % len(kinds)]
        pools[other] += pools[kind][:10]

    def mention(kind, fresh):
        name = make_names(rng, 1)[0] if fresh else rng.choice(pools[kind])
        words = [name]
        if kind == "PER" and rng.random() < 0.5:
            words.append(make_names(rng, 1)[0] if fresh else rng.choice(pools["PER"]))
        if SUFFIX[kind] and rng.random() < 0.4:
            words.append(rng.choice(SUFFIX[kind]))
        return words, ["B-" + kind] + ["I-" + kind] * (len(words) - 1)

    def sentence(fresh_rate):
        words, tags = [], []
        for piece in rng.choice(TEMPLATES).split():
            if piece.startswith("{"):
                w, t = mention(piece[1:-1], rng.random() < fresh_rate)
            else:
                w, t = [piece], ["O"]
            if rng.random() < 0.3:
                w, t = [rng.choice(FILLER)] + w, ["O"] + t
            words += w
            tags += t
        return Sentence(tuple(words), tuple(tags))

    train = [sentence(0.0) for _ in range(n_train)]
    dev = [sentence(0.25) for _ in range(n_dev)]
    template_words = {w for t in TEMPLATES for w in t.split() if not w.startswith("{")}
    words = sorted(template_words | set(FILLER) | {s for v in SUFFIX.values() for s in v}) + SYLLABLES + \
        ["##" + s for s in SYLLABLES]
    return train, dev, words


def write_conll(path, sentences):
    with open(path, "w", encoding="utf-8") as f:
        f.write("-DOCSTART- O\n\n" + "\n\n".join("\n".join(f"{w} {t}" for w, t in zip(s.words, s.tags))
                                                  for s in sentences) + "\n")


def flags(args, work, seed):
    return ["--train-file", f"{work}/train.txt", "--validation-file", f"{work}/dev.txt", "--load", f"{work}/init",
            "--max-seq-length", str(args.seq), "--micro-batch-size", str(args.batch), "--global-batch-size",
            str(args.batch), "--lr", str(args.lr), "--seed", str(seed)]


def megabert_curve(args, work, seed, steps_per_epoch):
    """finetune_ner.py once per epoch, each run resuming the last from --save."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_ner", os.path.join(ROOT, "finetune_ner.py"))
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    total = args.epochs * steps_per_epoch
    metrics_file, curve = f"{work}/megabert_{seed}.jsonl", []
    for epoch in range(1, args.epochs + 1):
        out = f"{work}/megabert_{seed}_{epoch}"
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            rc = entry.main(flags(args, work, seed) + [
                "--output-dir", out, "--save", f"{work}/ckpt_{seed}", "--train-iters", str(epoch * steps_per_epoch),
                "--lr-decay-iters", str(total), "--log-interval", "1", "--metrics-file", metrics_file])
        if rc:
            sys.exit(f"finetune_ner.py failed:\n{captured.getvalue()[-3000:]}")
        result = json.load(open(f"{out}/eval_results.json"))
        curve.append({k.removeprefix("eval_"): v for k, v in result.items()})
    losses = [json.loads(line)["ner_loss"] for line in open(metrics_file)]
    for epoch, row in enumerate(curve):
        row["train_loss"] = statistics.fmean(losses[epoch * steps_per_epoch:(epoch + 1) * steps_per_epoch])
    return curve


def hf_features(tok, sentences, label2id, seq):
    """run_ner.py's tokenize_and_align_labels: labels at each word's first sub-word."""
    enc = tok([list(s.words) for s in sentences], is_split_into_words=True, padding="max_length", max_length=seq,
              truncation=True, return_tensors="pt")
    labels, firsts = torch.full_like(enc["input_ids"], -100), []
    for i, s in enumerate(sentences):
        previous, positions = None, []
        for position, word in enumerate(enc.word_ids(i)):
            if word is not None and word != previous:
                labels[i, position] = label2id[s.tags[word]]
                positions.append(position)
            previous = word
        if len(positions) != len(s.words):
            sys.exit(f"--seq {seq} cuts a sentence of {len(s.words)} words: raise it (both sides must see every word)")
        firsts.append(positions)
    return {"input_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"],
            "attention_mask": enc["attention_mask"], "labels": labels}, firsts


def transformers_curve(args, work, seed, steps_per_epoch, train, dev, labels):
    import transformers

    cfg = parse_finetune_args(flags(args, work, seed) + ["--output-dir", work], task_config=NerConfig,
                              defaults=NER_DEFAULTS)
    optim = cfg.optim
    model = transformers.BertForTokenClassification.from_pretrained(f"{work}/init")
    tok = transformers.BertTokenizerFast(f"{work}/init/vocab.txt", do_lower_case=True)
    label2id = {t: i for i, t in enumerate(labels)}
    train_tensors, _ = hf_features(tok, train, label2id, args.seq)
    dev_tensors, dev_firsts = hf_features(tok, dev, label2id, args.seq)
    total = args.epochs * steps_per_epoch
    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
               "weight_decay": optim.weight_decay},
              {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps)
    schedule = transformers.get_linear_schedule_with_warmup(opt, int(optim.lr_warmup_fraction * total), total)
    batches = feature_batches(train_tensors, global_batch=args.batch, micro_batch=args.batch, dp_rank=0, dp_size=1,
                              seed=seed)
    curve = []
    for epoch in range(args.epochs):
        model.train()
        losses = []
        for _ in range(steps_per_epoch):
            loss = model(**next(batches)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad)
            opt.step()
            schedule.step()
            opt.zero_grad()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(**{k: v[i:i + 256] for k, v in dev_tensors.items() if k != "labels"}).logits
                                for i in range(0, len(dev), 256)])
        predicted = [[labels[int(logits[i, p].argmax())] for p in firsts] for i, firsts in enumerate(dev_firsts)]
        row = ner_metrics([list(s.tags) for s in dev], predicted)
        row["train_loss"] = statistics.fmean(losses)
        curve.append(row)
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--dev", type=int, default=300)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seeds", type=int, default=1, help="runs per side (seeds S..S+N-1: init, shuffle, dropout)")
    p.add_argument("--first-seed", type=int, default=1, help="S")
    args = p.parse_args()
    import transformers

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = tempfile.mkdtemp(prefix="ner_bench_")
    try:
        train, dev, words = make_data(0, args.train, args.dev)
        write_conll(f"{work}/train.txt", train)
        write_conll(f"{work}/dev.txt", dev)
        with open(f"{work}/vocab.txt", "w") as f:
            f.write("\n".join(BERT_SPECIALS + words) + "\n")
        labels = label_set(read_sentences(f"{work}/train.txt"))
        steps_per_epoch = math.ceil(len(train) / args.batch)  # one window per sentence at --seq
        print(f"data: {len(train)} train / {len(dev)} dev sentences, labels {' '.join(labels)}; model: "
              f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads; lr {args.lr}, batch {args.batch}, "
              f"{args.epochs} epochs of {steps_per_epoch} steps, seq {args.seq}; torch {torch.__version__}, "
              f"transformers {transformers.__version__}, {torch.get_num_threads()} threads", flush=True)
        sides = {"megabert": [], "transformers": []}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            torch.manual_seed(seed)
            cfg = transformers.BertConfig(vocab_size=len(BERT_SPECIALS) + len(words), hidden_size=args.hidden,
                                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                          intermediate_size=4 * args.hidden, max_position_embeddings=max(128, args.seq),
                                          id2label=dict(enumerate(labels)),
                                          label2id={t: i for i, t in enumerate(labels)})
            shutil.rmtree(f"{work}/init", ignore_errors=True)
            transformers.BertForTokenClassification(cfg).save_pretrained(f"{work}/init")
            shutil.copyfile(f"{work}/vocab.txt", f"{work}/init/vocab.txt")
            for name, fn in (("megabert", lambda: megabert_curve(args, work, seed, steps_per_epoch)),
                             ("transformers", lambda: transformers_curve(args, work, seed, steps_per_epoch, train,
                                                                         dev, labels))):
                start = time.perf_counter()
                sides[name].append(fn())
                f1 = ", ".join(f"{100 * row['f1']:.2f}" for row in sides[name][-1])
                print(f"seed {seed} {name}: dev F1 by epoch {f1} ({time.perf_counter() - start:.0f} s)", flush=True)
        print()
        print(f"{'epoch':>5} | {'megabert loss':>13} {'P':>6} {'R':>6} {'F1':>6} {'acc':>6} | "
              f"{'transformers loss':>17} {'P':>6} {'R':>6} {'F1':>6} {'acc':>6}   (dev, mean of {args.seeds} seed(s))")
        for epoch in range(args.epochs):
            cells = []
            for name in sides:
                rows = [curve[epoch] for curve in sides[name]]
                mean = {k: statistics.fmean(r[k] for r in rows) for k in ("train_loss", "precision", "recall", "f1",
                                                                          "accuracy")}
                width = 13 if name == "megabert" else 17
                cells.append(f"{mean['train_loss']:>{width}.4f} " + " ".join(
                    f"{100 * mean[k]:6.2f}" for k in ("precision", "recall", "f1", "accuracy")))
            print(f"{epoch + 1:>5} | " + " | ".join(cells))
        for name in sides:
            f1 = [100 * curve[-1]["f1"] for curve in sides[name]]
            spread = f" (sd {statistics.stdev(f1):.2f}; {min(f1):.2f} to {max(f1):.2f})" if len(f1) > 1 else ""
            print(f"final dev F1 {name}: {statistics.fmean(f1):.2f}{spread}; seeds {', '.join(f'{x:.2f}' for x in f1)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
