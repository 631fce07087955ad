"""How well SQuAD fine-tuning learns: finetune_squad.py (its real main(), in this process)
against a plain transformers loop, same data, same initial weights and the same budget,
N seeds a side, interleaved. Prints dev F1 / EM per seed and the mean and standard
deviation per side. Nothing passes or fails: it measures.

Data: a synthetic SQuAD v1.1-format set (no download). Each paragraph states two facts
(of three kinds: birthplace and year, job and employer, a move) about each of --people
made-up people, in random order with a filler sentence, so a question ("Where was Kavor
Telmin born?") is answered only by matching its name and its relation to the right
sentence; answers are 1 to 2 words. --hard (issue 52's harder set) adds two filler sentences (contexts
of about 72 WordPieces with two people: at --max-seq-length 64 a question spans two
windows, and 38% of the training windows hold no answer) and questions that ask who
from a place, an organisation or a move ("Who was born in Telmin?": the answer is a name of
several WordPieces). With two people a context is about 50 WordPiece tokens
(at most 56): at --max-seq-length 64 and --doc-stride 16 some questions span two windows,
at 128 about half of every window is padding. The vocab is a WordPiece trained on the set.

Model: per seed s, a random-init transformers BertForQuestionAnswering (torch seed s;
2 layers, hidden 128, 2 heads, intermediate 512, dropout 0.1) saved as a Hugging Face
dir; both sides start from that dir (QA head included).

The transformers side is what a user of transformers would write: run_qa.py's features
(the fast tokenizer with truncation="only_second", stride and offsets; windows without the
answer point at [CLS]) and its post-processing (n-best 20, answers up to 30 tokens),
torch.optim.AdamW(model.parameters(), lr) (its defaults: weight decay 0.01 on every
parameter, eps 1e-8), get_linear_schedule_with_warmup with 10% warm-up, no clipping,
a fresh shuffle per epoch, model dropout 0.1. Both sides are scored by the official
v1.1 metric (megabert.tasks.squad.evaluate).

    nice -n 5 python bench/squad_vs_transformers.py [--seeds 8] [--questions 1200] [--epochs 8]
        [--max-seq-length 64 --doc-stride 16] [--lr 1e-3] [--batch 32] [--jobs 2] [--hard]
        [--sides transformers,megabert[,megabert-padfrozen]] [--megabert-flag=--clip-grad=0 ...]

Each run is a process of its own with one thread; --jobs runs that many at a time. A run
at the defaults is about 60 CPU-seconds. --megabert-flag passes a flag to finetune_squad.py
and the side megabert-padfrozen keeps the [PAD] embedding row still, as transformers'
padding_idx does (ablations). A --work-dir that holds a set already is reused as it is.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megabert.tasks.squad.evaluate import evaluate  # noqa: E402

SYLLABLES = ["ka", "vor", "tel", "min", "bra", "ost", "rel", "dun", "mar", "ise", "lo", "pen", "quin", "sa", "tor",
             "vel", "ya", "zen", "gri", "hal", "jor", "nu", "fi", "del", "ron", "ba", "cu", "le", "mo", "ti"]
JOBS = ["baker", "carpenter", "teacher", "sailor", "painter", "doctor", "lawyer", "farmer", "weaver", "miner",
        "engineer", "printer", "chemist", "surveyor", "glassblower", "librarian"]
ORG_KINDS = ["Institute", "Company", "Guild", "Museum", "Bank", "Observatory", "Theatre", "Railway"]
FILLER = ["The region is known for its long winters and short summers.",
          "Many of the old records were lost in a fire.",
          "Local newspapers reported on the family for several decades.",
          "Historians still disagree about some of these dates.",
          "The town council later named a street after the family."]


def _word(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def _paragraph(rng: random.Random, pid: str, people_per_paragraph: int, hard: bool = False) -> dict:
    """A context of two facts (of three kinds) about each of `people_per_paragraph` people, in random
    order with a filler sentence, and four questions on it (answers located by character).
    `hard`: three filler sentences (longer contexts) and also questions that ask for the person
    from a fact ("Who was born in Telmin?": the answer is a name of several WordPieces, found
    by matching a place or an organisation instead of a name)."""
    people, used = [], set()
    while len(people) < people_per_paragraph:
        name = f"{_word(rng, rng.randint(1, 2))} {_word(rng, 2)}"
        if name.split()[0] not in used:
            used.add(name.split()[0])
            people.append(name)
    sentences = []  # (text, [(question, answer)])
    for name in people:
        city, year = _word(rng, 2), str(rng.randint(1700, 1999))
        job, org = rng.choice(JOBS), f"{_word(rng, 2)} {rng.choice(ORG_KINDS)}"
        city2, year2 = _word(rng, 2), str(int(year) + rng.randint(18, 60))
        facts = [(f"{name} was born in {city} in {year}.",
                  [(f"Where was {name} born?", city), (f"In what year was {name} born?", year)]
                  + [(f"Who was born in {city}?", name)] * hard),
                 (f"{name.split()[0]} worked as a {job} for the {org}.",
                  [(f"What did {name} work as?", job), (f"Which organisation employed {name}?", org)]
                  + [(f"Who worked for the {org}?", name.split()[0])] * hard),
                 (f"In {year2}, {name} moved to {city2}.",
                  [(f"Where did {name} move to?", city2), (f"When did {name} move to {city2}?", year2)]
                  + [(f"Who moved to {city2} in {year2}?", name)] * hard)]
        sentences += rng.sample(facts, 2)
    rng.shuffle(sentences)
    for filler in rng.sample(FILLER, 3 if hard else 1):
        sentences.insert(rng.randint(0, len(sentences)), (filler, []))
    context, qas = "", []
    for text, questions in sentences:
        offset = len(context) + (1 if context else 0)
        context = f"{context} {text}" if context else text
        for question, answer in questions:
            qas.append((question, answer, offset + text.index(answer)))
    chosen = rng.sample(qas, 4)
    return {"context": context,
            "qas": [{"id": f"{pid}-{k}", "question": q, "answers": [{"text": a, "answer_start": s}]}
                    for k, (q, a, s) in enumerate(chosen)]}


def make_squad(path: str, questions: int, seed: int, people: int, hard: bool = False) -> None:
    rng = random.Random(seed)
    paragraphs = [_paragraph(rng, f"s{seed}p{i}", people, hard) for i in range(math.ceil(questions / 4))]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"version": "1.1", "data": [{"title": "synthetic", "paragraphs": paragraphs}]}, f)


def make_vocab(paths: list[str], out: str) -> str:
    from megabert.corpus.tokenizer_training import train_wordpiece

    texts = []
    for path in paths:
        for p in json.load(open(path))["data"][0]["paragraphs"]:
            texts += [p["context"]] + [q["question"] for q in p["qas"]]
    return train_wordpiece(texts, out, vocab_size=1000, min_frequency=1)


def make_init_dir(path: str, vocab_file: str, seed: int) -> str:
    import shutil
    import transformers

    vocab_size = sum(1 for _ in open(vocab_file, encoding="utf-8"))
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=512, max_position_embeddings=512)
    torch.manual_seed(seed)
    transformers.BertForQuestionAnswering(config).save_pretrained(path)
    shutil.copy(vocab_file, os.path.join(path, "vocab.txt"))
    return path


# ---------------------------------------------------------------- transformers side (run_qa.py)

def _examples(path: str) -> list[dict]:
    out = []
    for article in json.load(open(path))["data"]:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                out.append({"id": qa["id"], "question": qa["question"], "context": p["context"],
                            "answer": qa["answers"][0]})
    return out


def hf_features(tok, examples: list[dict], args, training: bool) -> dict:
    """run_qa.py's prepare_train_features / prepare_validation_features."""
    enc = tok([e["question"] for e in examples], [e["context"] for e in examples], truncation="only_second",
              max_length=args.max_seq_length, stride=args.doc_stride, return_overflowing_tokens=True,
              return_offsets_mapping=True, padding="max_length")
    sample_map = enc.pop("overflow_to_sample_mapping")
    starts, ends, offsets = [], [], []
    for i, offs in enumerate(enc["offset_mapping"]):
        seq_ids = enc.sequence_ids(i)
        ex = examples[sample_map[i]]
        offsets.append([o if seq_ids[k] == 1 else None for k, o in enumerate(offs)])
        if not training:
            continue
        s_char = ex["answer"]["answer_start"]
        e_char = s_char + len(ex["answer"]["text"])
        ts = 0
        while seq_ids[ts] != 1:
            ts += 1
        te = len(enc["input_ids"][i]) - 1
        while seq_ids[te] != 1:
            te -= 1
        if not (offs[ts][0] <= s_char and offs[te][1] >= e_char):
            starts.append(0)
            ends.append(0)
            continue
        while ts < len(offs) and offs[ts][0] <= s_char:
            ts += 1
        starts.append(ts - 1)
        while offs[te][1] >= e_char:
            te -= 1
        ends.append(te + 1)
    tensors = {k: torch.tensor(enc[k]) for k in ("input_ids", "token_type_ids", "attention_mask")}
    if training:
        tensors["start_positions"], tensors["end_positions"] = torch.tensor(starts), torch.tensor(ends)
    return {"tensors": tensors, "sample_map": list(sample_map), "offsets": offsets}


def hf_postprocess(examples, feats, start_logits, end_logits, n_best=20, max_answer_length=30) -> dict:
    """run_qa.py's postprocess_qa_predictions (v1.1): the best valid span over all windows."""
    by_example: dict[int, list[int]] = {}
    for i, e in enumerate(feats["sample_map"]):
        by_example.setdefault(e, []).append(i)
    predictions = {}
    for e, ex in enumerate(examples):
        best, best_score = "", -math.inf
        for i in by_example.get(e, []):
            offs = feats["offsets"][i]
            s_idx = np.argsort(start_logits[i])[-1:-n_best - 1:-1]
            e_idx = np.argsort(end_logits[i])[-1:-n_best - 1:-1]
            for s in s_idx:
                for t in e_idx:
                    if offs[s] is None or offs[t] is None or t < s or t - s + 1 > max_answer_length:
                        continue
                    score = start_logits[i][s] + end_logits[i][t]
                    if score > best_score:
                        best_score, best = score, ex["context"][offs[s][0]:offs[t][1]]
        predictions[ex["id"]] = best
    return predictions


def run_transformers(args, init_dir: str, seed: int) -> dict:
    import transformers

    tok = transformers.BertTokenizerFast(os.path.join(init_dir, "vocab.txt"), do_lower_case=True)
    train = hf_features(tok, _examples(args.train_file), args, training=True)["tensors"]
    dev_examples = _examples(args.dev_file)
    dev = hf_features(tok, dev_examples, args, training=False)
    torch.manual_seed(seed)
    model = transformers.BertForQuestionAnswering.from_pretrained(init_dir).train()
    n = len(train["input_ids"])
    steps_per_epoch = math.ceil(n / args.batch)
    total = steps_per_epoch * args.epochs
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = transformers.get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    g = torch.Generator().manual_seed(seed)
    for _ in range(args.epochs):
        order = torch.randperm(n, generator=g)
        for k in range(0, n, args.batch):
            index = order[k:k + args.batch]
            loss = model(**{key: t[index] for key, t in train.items()}).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    model.eval()
    starts, ends = [], []
    with torch.no_grad():
        t = dev["tensors"]
        for k in range(0, len(t["input_ids"]), 64):
            out = model(**{key: v[k:k + 64] for key, v in t.items()})
            starts.append(out.start_logits.numpy())
            ends.append(out.end_logits.numpy())
    predictions = hf_postprocess(dev_examples, dev, np.concatenate(starts), np.concatenate(ends))
    scores = evaluate(json.load(open(args.dev_file)), predictions, "1.1")
    return {"f1": scores["f1"], "em": scores["exact_match"], "steps": total, "features": n}


# ---------------------------------------------------------------- megabert side (finetune_squad.py)

def freeze_pad_row() -> None:
    """Ablation (side megabert-padfrozen): the [PAD] row of the word embeddings gets no
    gradient, as transformers' nn.Embedding(padding_idx=pad_token_id) has it."""
    from megabert.tasks.squad import finetuning

    load = finetuning.load_qa_model

    def load_frozen(*args):
        model = load(*args)
        weight = model.bert.embeddings.word_embeddings.weight
        weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), 0.0))
        return model

    finetuning.load_qa_model = load_frozen


def run_megabert(args, init_dir: str, seed: int, out_dir: str) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_squad", os.path.join(ROOT, "finetune_squad.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--load", init_dir, "--train-file", args.train_file, "--predict-file", args.dev_file,
            "--output-dir", out_dir, "--max-seq-length", str(args.max_seq_length), "--doc-stride",
            str(args.doc_stride), "--max-query-length", "32", "--epochs", str(args.epochs), "--lr", str(args.lr),
            "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch), "--seed", str(seed),
            "--log-interval", "1000000", *args.megabert_flag]
    with contextlib.redirect_stdout(io.StringIO()):
        rc = module.main(argv)
    if rc:
        raise SystemExit(f"finetune_squad.py failed (exit {rc}): {' '.join(argv)}")
    scores = json.load(open(os.path.join(out_dir, "eval_results.json")))
    return {"f1": scores["f1"], "em": scores["exact_match"]}


def summary(name: str, runs: list[dict]) -> str:
    f1 = [r["f1"] for r in runs]
    em = [r["em"] for r in runs]
    sd = statistics.stdev(f1) if len(f1) > 1 else 0.0
    return (f"{name:<13} F1 mean {statistics.mean(f1):6.2f} sd {sd:5.2f} (min {min(f1):.1f} max {max(f1):.1f}, "
            f"sem {sd / math.sqrt(len(f1)):.2f}) | EM mean {statistics.mean(em):6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--questions", type=int, default=1200, help="training questions (dev: a quarter as many)")
    p.add_argument("--people", type=int, default=2, help="people per paragraph (the distractors of a question)")
    p.add_argument("--hard", action="store_true", help="the harder set: longer contexts (three filler sentences) "
                   "and questions that ask who (issue 52; with --people 4 contexts of about 150 WordPieces)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-seq-length", type=int, default=64)
    p.add_argument("--doc-stride", type=int, default=16)
    p.add_argument("--sides", default="transformers,megabert")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process with one thread")
    p.add_argument("--megabert-flag", action="append", default=[],
                   help="an extra finetune_squad.py flag (repeat; --megabert-flag=--clip-grad=0)")
    p.add_argument("--work-dir", default=None, help="default a temporary dir")
    p.add_argument("--one-run", default=None, help=argparse.SUPPRESS)  # SEED:SIDE, run by run_processes
    args = p.parse_args()
    args.megabert_flag = [x for f in args.megabert_flag for x in f.split("=", 1)]
    if args.one_run:
        seed, side = args.one_run.split(":")
        args.train_file = os.path.join(args.work_dir, "train.json")
        args.dev_file = os.path.join(args.work_dir, "dev.json")
        print(json.dumps(one_run(args, args.work_dir, int(seed), side)))
        return
    torch.set_num_threads(1)
    import logging
    import transformers
    transformers.logging.set_verbosity_error()
    logging.getLogger("megabert").setLevel(logging.WARNING)

    work = args.work_dir or tempfile.mkdtemp(prefix="squad_vs_tf_")
    os.makedirs(work, exist_ok=True)
    args.train_file, args.dev_file = os.path.join(work, "train.json"), os.path.join(work, "dev.json")
    vocab = os.path.join(work, "vocab.txt")
    # A --work-dir that already holds the data, vocab and initial models is reused as it is
    # (the WordPiece trainer breaks ties differently from run to run): ablations compare
    # against the same starting points.
    if not os.path.exists(vocab):
        make_squad(args.train_file, args.questions, seed=1000, people=args.people, hard=args.hard)
        make_squad(args.dev_file, args.questions // 4, seed=2000, people=args.people, hard=args.hard)
        make_vocab([args.train_file, args.dev_file], vocab)
    sides = args.sides.split(",")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, 1 thread per run, {args.jobs} runs at "
          f"a time | {args.questions} train / {args.questions // 4} dev questions, seq {args.max_seq_length}, stride "
          f"{args.doc_stride}, {args.epochs} epochs, lr {args.lr}, batch {args.batch} | megabert flags: "
          f"{' '.join(args.megabert_flag) or 'default'}", flush=True)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    for seed in seeds:
        if not os.path.isdir(os.path.join(work, f"init{seed}")):
            make_init_dir(os.path.join(work, f"init{seed}"), vocab, seed)
    # Seed by seed, the sides alternating which goes first; each run in a fresh process.
    runs = [(seed, side) for seed in seeds for side in (sides if seed % 2 else sides[::-1])]
    results: dict[str, dict[int, dict]] = {s: {} for s in sides}
    for (seed, side), r in run_processes(runs, args.jobs, work):
        results[side][seed] = r
        print(f"seed {seed} {side:<13} F1 {r['f1']:6.2f} EM {r['em']:6.2f} ({r['seconds']:.0f} s)", flush=True)
    print("seed  " + "  ".join(f"{s:>13}" for s in sides))
    for seed in seeds:
        print(f"{seed:<5} " + "  ".join(f"{results[s][seed]['f1']:13.2f}" for s in sides))
    for side in sides:
        print(summary(side, [results[side][seed] for seed in seeds]))
    print(json.dumps({s: [round(results[s][seed]["f1"], 2) for seed in seeds] for s in sides}))


def run_processes(runs: list[tuple[int, str]], jobs: int, work: str):
    """Yields ((seed, side), result) as runs end, `jobs` at a time, each run this script
    again with --one-run in a process of its own (the same arguments otherwise)."""
    pending, running = list(runs), {}
    while pending or running:
        while pending and len(running) < jobs:
            seed, side = pending.pop(0)
            # The last --work-dir wins: the one this run resolved.
            cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--work-dir", work, "--one-run",
                   f"{seed}:{side}"]
            with open(os.path.join(work, f"{side}{seed}.log"), "w") as log:
                running[(seed, side)] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        time.sleep(1)
        for key, proc in list(running.items()):
            if proc.poll() is None:
                continue
            out = proc.stdout.read()
            del running[key]
            if proc.returncode:
                print(f"run {key} failed (exit {proc.returncode}): see {work}/{key[1]}{key[0]}.log", flush=True)
                continue
            yield key, json.loads(out.strip().splitlines()[-1])


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
        if side == "megabert-padfrozen":
            freeze_pad_row()
        r = run_megabert(args, init_dir, seed, tempfile.mkdtemp(prefix=f"{side}{seed}_", dir=work))
    r["seconds"] = time.perf_counter() - t0
    return r


if __name__ == "__main__":
    main()
