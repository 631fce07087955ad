"""NER learning curves: finetune_ner.py against a plain transformers token-classification
loop, same model size, data, initial weights and budget. Prints dev precision / recall / F1
(entity level, seqeval's default mode as run_ner.py) and word accuracy after every epoch,
and each epoch's mean training loss, side by side. Nothing passes or fails.

The data is synthetic, CoNLL-like and lower-cased: template sentences ("{PER} works for
{ORG} in {LOC}") with filler words, four entity classes (PER, LOC, ORG, MISC) whose names
are made of syllables (so most split into sub-words), some names in two classes (the
context decides), multi-word entities (IOB2), and dev sentences where a quarter of the
names never occur in training.

--long-fraction F (issue 52's harder set: 0.02 at --seq 128, dropout 0, 8 epochs) chains
template sentences into some of 130-260 WordPieces, longer than one window. transformers'
run_ner truncates them: its loop trains on the first window and its scores come two ways,
over every word (a truncated word predicted "O") and run_ner.py's own (the truncated words
left out of gold and predictions alike). finetune_ner.py windows them and scores every
word. Both sides also get their F1 over the sentences that fit one window and over the
longer ones.

Both sides start from one transformers BertForTokenClassification saved with the label set
(random init, seeded), see the same number of steps of the same batch size (finetune_ner.py's
shuffle, fed to both; a window is a feature of its own, so a long sentence's later windows
take places in megabert's batches) and train with each side's defaults: megabert's flags as
they stand (AdamW eps 1e-6, weight decay 0.01 but on biases and LayerNorm, warmup then
linear decay, clipping at 1.0); for transformers Trainer's (eps 1e-8, no weight decay,
clipping at 1.0) with 10% warm-up and linear decay (--peer-recipe megabert: megabert's
settings on both sides; --peer-schedule megabert: finetune_ner.py's learning rates, one step
ahead of get_linear_schedule_with_warmup's, whose first step is at lr 0). megabert's curve
comes from finetune_ner.py itself, run once per epoch with --save: each run resumes the last
one exactly (--lr-decay-iters fixes the schedule) and scores the dev file (--final-only: one
run, scored at its end). The transformers side is run_ner.py's model and tokenization (is_split_into_words, the first
sub-word labelled, truncation) in a plain loop with its get_linear_schedule_with_warmup.
--megabert-flag passes a flag to finetune_ner.py (ablations). --position-shifts 0,2,5,10 also
scores the transformers model on the dev sentences within one window with their position ids
moved on by k: how much its tags hang on where a word sits in the window (issue 52's cause:
the reason finetune_ner.py averages a word over every window that holds it). Each run on
--threads.

    python bench/ner_vs_transformers.py [--train 1000 --dev 300 --epochs 5 --lr 1e-3 --batch 32
                                         --seq 64 --layers 2 --hidden 128 --heads 2 --seeds 1]
    nice python bench/ner_vs_transformers.py --long-fraction 0.02 --seq 128 --dropout 0 --epochs 8 \
        --final-only --seeds 3        # issue 52's harder set
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
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
TEMPLATE_WORDS = {w for t in TEMPLATES for w in t.split() if not w.startswith("{")} | {"and"}


def make_names(rng, count):
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count)]


def make_data(seed, n_train, n_dev, long_fraction=0.0):
    """(train sentences, dev sentences, vocab words). `long_fraction`: the share of sentences
    that chain template sentences with "and" until they are 130-260 WordPieces long (longer
    than a 128-token window: transformers' run_ner truncates them, finetune_ner.py windows
    them)."""
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

    def clause(fresh_rate):
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
        return words, tags

    def sentence(fresh_rate):
        words, tags = clause(fresh_rate)
        if rng.random() < long_fraction:
            target = rng.randint(130, 260)
            while wordpieces(words) < target:
                w, t = clause(fresh_rate)
                words, tags = words + ["and"] + w, tags + ["O"] + t
        return Sentence(tuple(words), tuple(tags))

    train = [sentence(0.0) for _ in range(n_train)]
    dev = [sentence(0.25) for _ in range(n_dev)]
    words = sorted(TEMPLATE_WORDS | set(FILLER) | {s for v in SUFFIX.values() for s in v}) + SYLLABLES + \
        ["##" + s for s in SYLLABLES]
    return train, dev, words


def wordpieces(words):
    """WordPieces of the words under the bench's vocab: a template or filler word is one, a
    name one per syllable (every syllable is two letters)."""
    return sum(1 if any(w in v for v in (FILLER, *SUFFIX.values())) or w in TEMPLATE_WORDS else len(w) // 2
               for w in words)


def write_conll(path, sentences):
    with open(path, "w", encoding="utf-8") as f:
        f.write("-DOCSTART- O\n\n" + "\n\n".join("\n".join(f"{w} {t}" for w, t in zip(s.words, s.tags))
                                                  for s in sentences) + "\n")


def flags(args, work, seed):
    return ["--train-file", f"{work}/train.txt", "--validation-file", f"{work}/dev.txt", "--load", f"{work}/init",
            "--max-seq-length", str(args.seq), "--micro-batch-size", str(args.batch), "--global-batch-size",
            str(args.batch), "--lr", str(args.lr), "--seed", str(seed), *args.megabert_flag]


def megabert_curve(args, work, seed, steps_per_epoch):
    """finetune_ner.py once per epoch, each run resuming the last from --save (--final-only:
    one run, scored at the end)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_ner", os.path.join(ROOT, "finetune_ner.py"))
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    total = args.epochs * steps_per_epoch
    metrics_file, curve = f"{work}/megabert_{seed}.jsonl", []
    if os.path.exists(metrics_file):
        os.remove(metrics_file)
    shutil.rmtree(f"{work}/ckpt_{seed}", ignore_errors=True)
    for epoch in (args.epochs,) if args.final_only else range(1, args.epochs + 1):
        out = f"{work}/megabert_{seed}_{epoch}"
        captured = io.StringIO()
        save = [] if args.final_only else ["--save", f"{work}/ckpt_{seed}"]
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            rc = entry.main(flags(args, work, seed) + save + [
                "--output-dir", out, "--test-file", f"{work}/dev.txt", "--train-iters", str(epoch * steps_per_epoch),
                "--lr-decay-iters", str(total), "--log-interval", "1", "--metrics-file", metrics_file])
        if rc:
            sys.exit(f"finetune_ner.py failed:\n{captured.getvalue()[-3000:]}")
        result = json.load(open(f"{out}/eval_results.json"))
        predicted = [s.tags for s in read_sentences(f"{out}/predictions.txt")]
        dev = read_sentences(f"{work}/dev.txt")
        # run_ner.py's score of the transformers side, over the same words: those within the
        # first window of each sentence (the ones run_ner.py keeps).
        kept = kept_words(dev, f"{work}/vocab.txt", args.seq)
        curve.append({**{k.removeprefix("eval_"): v for k, v in result.items()}, **by_length(args, dev, predicted),
                      "f1_run_ner": ner_metrics([s.tags[:n] for s, n in zip(dev, kept)],
                                                [p[:n] for p, n in zip(predicted, kept)])["f1"]})
    losses = [json.loads(line)["ner_loss"] for line in open(metrics_file)]
    for row, epoch in zip(curve, (args.epochs,) if args.final_only else range(1, args.epochs + 1)):
        row["train_loss"] = statistics.fmean(losses[(epoch - 1) * steps_per_epoch:epoch * steps_per_epoch])
    return curve


def kept_words(sentences, vocab, seq):
    """How many words of each sentence start within its first seq - 2 WordPieces."""
    from megabert.data import build_tokenizer
    from megabert.tasks.ner.features import word_pieces

    out = []
    for pieces in word_pieces(sentences, build_tokenizer("BertWordPieceLowerCase", vocab)):
        starts = itertools.accumulate([0] + [len(p) for p in pieces[:-1]])
        out.append(sum(start < seq - 2 for start in starts))
    return out


def by_length(args, dev, predicted):
    """Dev F1 over the sentences that fit in one window and over the longer ones (nan where
    there are none: the default set)."""
    fits = [wordpieces(s.words) <= args.seq - 2 for s in dev]
    return {f"f1_{name}": ner_metrics([s.tags for s, f in zip(dev, fits) if f == keep],
                                      [p for p, f in zip(predicted, fits) if f == keep])["f1"]
            if keep in fits else math.nan for name, keep in (("short", True), ("long", False))}


def hf_features(tok, sentences, label2id, seq):
    """run_ner.py's tokenize_and_align_labels: labels at each word's first sub-word; a
    sentence longer than `seq` is truncated (its later words are neither trained on nor
    predicted). Also each sentence's first sub-word positions, of the words kept."""
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
        firsts.append(positions)
    return {"input_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"],
            "attention_mask": enc["attention_mask"], "labels": labels}, firsts


def peer_optimizer(args, model, total):
    """--peer-recipe transformers: Trainer's defaults (AdamW eps 1e-8, weight decay 0, clip
    1.0) with 10% warm-up, then linear decay; megabert: finetune_ner.py's optimizer flags
    (weight decay 0.01 but on biases and LayerNorm, its eps and clipping)."""
    import transformers

    cfg = parse_finetune_args(flags(args, "/tmp", 1) + ["--output-dir", "/tmp"], task_config=NerConfig,
                              defaults=NER_DEFAULTS)
    optim = cfg.optim
    if args.peer_recipe == "transformers":
        optim = dataclasses.replace(optim, weight_decay=0.0, adam_eps=1e-8, adam_beta1=0.9, adam_beta2=0.999,
                                    clip_grad=1.0, lr_warmup_fraction=0.1)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
               "weight_decay": optim.weight_decay},
              {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps)
    if args.peer_schedule == "megabert":  # its step k (0-based) at megabert's iteration k + 1
        from megabert.optim import LRSchedule

        lr_at = LRSchedule(optim, total)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_at(k + 1) / optim.lr), optim.clip_grad
    schedule = transformers.get_linear_schedule_with_warmup(opt, int(optim.lr_warmup_fraction * total), total)
    return opt, schedule, optim.clip_grad


def transformers_curve(args, work, seed, steps_per_epoch, train, dev, labels):
    import transformers

    model = transformers.BertForTokenClassification.from_pretrained(f"{work}/init")
    tok = transformers.BertTokenizerFast(f"{work}/init/vocab.txt", do_lower_case=True)
    label2id = {t: i for i, t in enumerate(labels)}
    train_tensors, _ = hf_features(tok, train, label2id, args.seq)
    dev_tensors, dev_firsts = hf_features(tok, dev, label2id, args.seq)
    total = args.epochs * steps_per_epoch
    opt, schedule, clip = peer_optimizer(args, model, total)
    batches = feature_batches(train_tensors, global_batch=args.batch, micro_batch=args.batch, dp_rank=0, dp_size=1,
                              seed=seed)
    curve = []
    for epoch in range(args.epochs):
        model.train()
        losses = []
        for _ in range(steps_per_epoch):
            loss = model(**next(batches)).loss
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            schedule.step()
            opt.zero_grad()
            losses.append(loss.item())
        if args.final_only and epoch + 1 < args.epochs:
            continue
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(**{k: v[i:i + 256] for k, v in dev_tensors.items() if k != "labels"}).logits
                                for i in range(0, len(dev), 256)])
        kept = [[labels[int(logits[i, p].argmax())] for p in firsts] for i, firsts in enumerate(dev_firsts)]
        gold = [list(s.tags) for s in dev]
        # run_ner.py scores the words it kept (a truncated word has no label, so no gold tag
        # either); over every word of the dev file, a truncated one is predicted "O".
        predicted = [p + ["O"] * (len(g) - len(p)) for g, p in zip(gold, kept)]
        row = {**ner_metrics(gold, predicted), **by_length(args, dev, predicted)}
        row["f1_run_ner"] = ner_metrics([g[:len(p)] for g, p in zip(gold, kept)], kept)["f1"]
        row["train_loss"] = statistics.fmean(losses)
        row.update(shifted_f1(args, model, dev_tensors, dev_firsts, dev, labels))
        curve.append(row)
    return curve


def shifted_f1(args, model, tensors, firsts, dev, labels):
    """--position-shifts: the model's F1 over the dev sentences that fit one window with their
    position ids moved on by k (the [CLS] kept at 0): how much its tags hang on where a word
    sits in the window rather than on its neighbours (issue 52)."""
    fits = [i for i, s in enumerate(dev) if wordpieces(s.words) <= args.seq - 2]
    seq, top = tensors["input_ids"].shape[1], model.config.max_position_embeddings - 1
    out = {}
    for k in args.position_shifts:
        positions = torch.arange(seq).expand(len(fits), seq).clone()
        positions[:, 1:] = (positions[:, 1:] + k).clamp(max=top)  # padding past the end: masked
        with torch.no_grad():
            logits = model(**{key: v[fits] for key, v in tensors.items() if key != "labels"},
                           position_ids=positions).logits
        predicted = [[labels[int(logits[j, p].argmax())] for p in firsts[i]] for j, i in enumerate(fits)]
        out[f"f1_shift_{k}"] = ner_metrics([list(dev[i].tags) for i in fits], predicted)["f1"]
    return out


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
    p.add_argument("--dropout", type=float, default=0.1, help="the model's hidden and attention dropout")
    p.add_argument("--long-fraction", type=float, default=0.0,
                   help="share of sentences of 130-260 WordPieces (the hard set: 0.05 at --seq 128)")
    p.add_argument("--peer-recipe", choices=("transformers", "megabert"), default="transformers",
                   help="the transformers loop's optimizer: Trainer's defaults, or finetune_ner.py's flags")
    p.add_argument("--peer-schedule", choices=("transformers", "megabert"), default="transformers",
                   help="the transformers loop's learning rates: get_linear_schedule_with_warmup's (lr 0 at its first "
                        "step) or finetune_ner.py's (one step ahead: lr/warm-up at the first)")
    p.add_argument("--megabert-flag", action="append", default=[],
                   help="an extra finetune_ner.py flag (repeat; --megabert-flag=--clip-grad=0)")
    p.add_argument("--sides", default="megabert,transformers")
    p.add_argument("--final-only", action="store_true", help="score the dev set after the last epoch only")
    p.add_argument("--position-shifts", default="",
                   help="k,k,...: also score the transformers model on the dev sentences within one window with "
                        "their position ids moved on by k (how much its tags hang on absolute positions)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seeds", type=int, default=1, help="runs per side (seeds S..S+N-1: init, shuffle, dropout)")
    p.add_argument("--first-seed", type=int, default=1, help="S")
    args = p.parse_args()
    args.megabert_flag = [x for f in args.megabert_flag for x in f.split("=", 1)]
    args.position_shifts = [int(k) for k in args.position_shifts.split(",") if k]
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    work = tempfile.mkdtemp(prefix="ner_bench_")
    try:
        train, dev, words = make_data(0, args.train, args.dev, args.long_fraction)
        write_conll(f"{work}/train.txt", train)
        write_conll(f"{work}/dev.txt", dev)
        with open(f"{work}/vocab.txt", "w") as f:
            f.write("\n".join(BERT_SPECIALS + words) + "\n")
        labels = label_set(read_sentences(f"{work}/train.txt"))
        steps_per_epoch = math.ceil(len(train) / args.batch)  # a step per 32 sentences on both sides
        long = [sum(wordpieces(s.words) > args.seq - 2 for s in part) for part in (train, dev)]
        print(f"data: {len(train)} train / {len(dev)} dev sentences ({long[0]} / {long[1]} longer than {args.seq - 2} "
              f"WordPieces), labels {' '.join(labels)}; model: {args.layers} layers, hidden {args.hidden}, "
              f"{args.heads} heads, dropout {args.dropout}; lr {args.lr}, batch {args.batch}, {args.epochs} epochs of "
              f"{steps_per_epoch} steps, seq {args.seq}; peer recipe {args.peer_recipe}, schedule "
              f"{args.peer_schedule}; megabert flags "
              f"{' '.join(args.megabert_flag) or 'default'}; torch {torch.__version__}, transformers "
              f"{transformers.__version__}, {torch.get_num_threads()} threads", flush=True)
        sides = {name: [] for name in args.sides.split(",")}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            torch.manual_seed(seed)
            cfg = transformers.BertConfig(vocab_size=len(BERT_SPECIALS) + len(words), hidden_size=args.hidden,
                                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                          intermediate_size=4 * args.hidden, max_position_embeddings=max(128, args.seq),
                                          hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
                                          id2label=dict(enumerate(labels)),
                                          label2id={t: i for i, t in enumerate(labels)})
            shutil.rmtree(f"{work}/init", ignore_errors=True)
            transformers.BertForTokenClassification(cfg).save_pretrained(f"{work}/init")
            shutil.copyfile(f"{work}/vocab.txt", f"{work}/init/vocab.txt")
            runs = {"megabert": lambda: megabert_curve(args, work, seed, steps_per_epoch),
                    "transformers": lambda: transformers_curve(args, work, seed, steps_per_epoch, train, dev, labels)}
            for name in sides:
                start = time.perf_counter()
                sides[name].append(runs[name]())
                f1 = ", ".join(f"{100 * row['f1']:.2f}" for row in sides[name][-1])
                print(f"seed {seed} {name}: dev F1 by epoch {f1}; last epoch's train loss "
                      f"{sides[name][-1][-1]['train_loss']:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
        print()
        epochs = [args.epochs] if args.final_only else range(1, args.epochs + 1)
        print(f"{'epoch':>5} | " + " | ".join(f"{name + ' loss':>17} {'P':>6} {'R':>6} {'F1':>6} {'acc':>6}"
                                              for name in sides) + f"   (dev, mean of {args.seeds} seed(s))")
        for k, epoch in enumerate(epochs):
            cells = []
            for name in sides:
                rows = [curve[k] for curve in sides[name]]
                mean = {key: statistics.fmean(r[key] for r in rows) for key in ("train_loss", "precision", "recall",
                                                                                "f1", "accuracy")}
                cells.append(f"{mean['train_loss']:>17.4f} " + " ".join(
                    f"{100 * mean[key]:6.2f}" for key in ("precision", "recall", "f1", "accuracy")))
            print(f"{epoch:>5} | " + " | ".join(cells))
        for name in sides:
            f1 = [100 * curve[-1]["f1"] for curve in sides[name]]
            spread = f" (sd {statistics.stdev(f1):.2f}; {min(f1):.2f} to {max(f1):.2f})" if len(f1) > 1 else ""
            part = {k: statistics.fmean(100 * curve[-1][k] for curve in sides[name])
                    for k in ("f1_run_ner", "f1_short", "f1_long")}
            print(f"final dev F1 {name}: {statistics.fmean(f1):.2f}{spread}; seeds {', '.join(f'{x:.2f}' for x in f1)}"
                  f"; over the words run_ner.py keeps (the first window's) {part['f1_run_ner']:.2f}; sentences "
                  f"within one window {part['f1_short']:.2f}, longer ones {part['f1_long']:.2f}")
        for k in args.position_shifts if "transformers" in sides else ():
            f1 = [100 * curve[-1][f"f1_shift_{k}"] for curve in sides["transformers"]]
            print(f"transformers' model, dev sentences within one window, positions moved on by {k}: F1 "
                  f"{statistics.fmean(f1):.2f} (seeds {', '.join(f'{x:.2f}' for x in f1)})")
        print(json.dumps({name: [round(100 * curve[-1]["f1"], 2) for curve in sides[name]] for name in sides}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
