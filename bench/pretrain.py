"""Pre-training tokens/s: pretrain_bert.py's training step with its default flags, and with
each optimisation turned off in turn, against transformers' BertForPreTraining trained the
way its users do (torch AdamW, gradient clipping at 1.0), on this machine, in one run.

Both sides get the same batches: real BERT samples (sentence-order prediction, 15% masking,
10% short sequences) drawn by megabert's dataset from a corpus built from the Python
standard library's docstrings (no download; cached in --workdir). `--corpus stdlib` keeps
each docstring a document (short documents: at seq 512 most positions are padding);
`--corpus long` joins consecutive docstrings into documents of at least 1,000 words, so
that samples fill seq 512 as Wikipedia's articles do. Steps are interleaved
(A B C ... A B C ...) so that a noisy machine slows every side alike; the figure per side is
the median step time. tokens/s counts batch x seq-length (padding included) for every side.
Nothing here passes or fails on time.

`--packing`: pretrain_bert.py's defaults on the samples padded (unpacked) against the same
samples packed (--pack-sequences, `--batch` rows of whole samples; and packed with
--no-unpad-input, the fixed-shape step CUDA runs by default), in real (non-padding)
tokens/s, the unit in which they compare: a packed row carries more samples. Interleaved as
above; per side, the real tokens of all its timed steps over their summed time.

    python bench/pretrain.py [--rounds 10] [--layers 4 --hidden 256 --heads 4 --seq 128 --batch 16]
    python bench/pretrain.py --seq 512 --batch 4 --corpus long
    python bench/pretrain.py --packing --seq 512 --batch 4 --corpus long
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

import torch

import megabert
import megabert.fused_kernels
from _timing import compare
from megabert.arguments import parse_args
from megabert.tasks.pretraining.task import build_pretraining
from megabert.training.resolve import resolve_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each optimisation turned off alone, next to the defaults: its share of the speed-up.
VARIANTS = {
    "defaults": [],
    "full MLM logits": ["--no-mlm-logits-at-masked-only"],
    "padded encoder": ["--no-unpad-input"],
    "attention fused": ["--attention-backend", "fused"],
    "attention sdpa": ["--attention-backend", "sdpa"],
    "attention torch": ["--attention-backend", "torch"],
    "layernorm torch": ["--layernorm-backend", "torch"],
    "dropout-add torch": ["--dropout-add-backend", "torch"],
}


# `--corpus long`: docstrings joined in the order the stdlib lists them (a module's after
# one another) until a document holds this many words, about 1,300 WordPiece tokens.
LONG_DOCUMENT_WORDS = 1000


def write_long_corpus(path: str, max_documents: int) -> None:
    """Documents of at least LONG_DOCUMENT_WORDS words, each a run of consecutive docstrings."""
    from megabert.corpus.demo_corpus import stdlib_documents

    written, parts, words = 0, [], 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in stdlib_documents():
            parts.append(doc)
            words += len(doc.split())
            if words >= LONG_DOCUMENT_WORDS:
                f.write(json.dumps({"text": "\n".join(parts)}) + "\n")
                written, parts, words = written + 1, [], 0
                if written == max_documents:
                    return


def prepare_data(workdir: str, vocab_size: int, corpus_kind: str = "stdlib") -> tuple[str, str]:
    """(dataset prefix, vocab file) of the corpus, built once."""
    workdir = os.path.join(workdir, corpus_kind)
    os.makedirs(workdir, exist_ok=True)
    prefix, vocab = os.path.join(workdir, "corpus_text_sentence"), os.path.join(workdir, "vocab.txt")
    if os.path.exists(prefix + ".idx"):
        return prefix, vocab
    tool = lambda name: os.path.join(ROOT, "tools", name)  # noqa: E731
    corpus = os.path.join(workdir, "corpus.jsonl")
    if corpus_kind == "long":
        write_long_corpus(corpus, max_documents=600)
        steps = []
    else:
        steps = [[tool("make_demo_corpus.py"), "--output", corpus, "--max-documents", "4000"]]
    for cmd in steps + [
            [tool("train_tokenizer.py"), "--input", corpus, "--output", vocab, "--vocab-size", str(vocab_size)],
            [tool("preprocess_data.py"), "--input", corpus, "--json-keys", "text", "--output-prefix",
             os.path.join(workdir, "corpus"), "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab,
             "--split-sentences", "--workers", "2", "--log-interval", "100000"]]:
        subprocess.run([sys.executable] + cmd, check=True, stdout=subprocess.DEVNULL)
    return prefix, vocab


def real_batches(cfg, num_batches: int) -> list[dict]:
    """`num_batches` collated micro-batches of the train split, as the DataLoader yields them."""
    from megabert.data import build_tokenizer
    from megabert.tasks.pretraining.indexed_splits import build_train_valid_test_datasets

    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.vocab_file)
    n = num_batches * cfg.train.micro_batch_size
    train, _, _ = build_train_valid_test_datasets(cfg.data, tokenizer, (n, 0, 0), cfg.train.seed,
                                                  cfg.model.bert_binary_head)
    loader = torch.utils.data.DataLoader(train, batch_size=cfg.train.micro_batch_size, shuffle=False)
    return list(itertools.islice(loader, num_batches))


def ours(argv: list[str], ps, vocab_size: int, batches: list[dict]):
    """A step of pretrain_bert.py's trainer (forward, backward, clipping, optimizer, LR)."""
    cfg = parse_args(argv)
    trainer = build_pretraining(resolve_run(cfg, ps), ps, vocab_size, lambda consumed: itertools.cycle(batches))
    trainer.strategy.model.train()
    model = trainer.strategy.model
    backends = (f"{model.ctx.attention_backend}/{model.ctx.layernorm_backend}/{model.ctx.dropout_add_backend}"
                if hasattr(model, "ctx") else "")
    return trainer.train_step, backends


def transformers_step(args, batches: list[dict], device):
    """transformers' BertForPreTraining (its default attention) with torch AdamW and
    clipping at 1.0, as its Trainer runs it."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                     num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                                     max_position_embeddings=512)
    model = transformers.BertForPreTraining(config).to(device).train()
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4)
    it = itertools.cycle(batches)

    def step():
        b = next(it)
        out = model(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                    attention_mask=b["attention_mask"], labels=b["labels"],
                    next_sentence_label=b["next_sentence_label"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, f"{model.config._attn_implementation}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--corpus", choices=("stdlib", "long"), default="stdlib",
                   help="stdlib: a document per docstring (short); long: documents that fill seq 512")
    p.add_argument("--rounds", type=int, default=10, help="timed steps per side (after 2 warm-up steps)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--workdir", default=os.path.join(ROOT, "bench_out", "pretrain"))
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="instead of timing: torch.profiler over STEPS steps of each side, shares of the ops "
                        "padding costs (bernoulli_, bmm, mm+addmm, fill_+copy_)")
    p.add_argument("--packing", action="store_true",
                   help="instead of the variants: unpacked against --pack-sequences, in real tokens/s")
    args = p.parse_args()

    ps = megabert.init_parallel()
    prefix, vocab = prepare_data(args.workdir, args.vocab, args.corpus)
    shape = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads",
             str(args.heads), "--seq-length", str(args.seq), "--max-position-embeddings", "512",
             "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch), "--train-iters", "1000000",
             "--data-path", prefix, "--vocab-file", vocab, "--log-interval", "1000000", "--eval-interval", "0"]
    if args.packing:
        compare_packing(args, shape, ps)
        return
    batches = real_batches(parse_args(shape), 8)
    real = float(sum(b["attention_mask"].sum() for b in batches)) / sum(b["attention_mask"].numel() for b in batches)

    sides = {"transformers": transformers_step(args, batches, ps.device)}
    for name in args.variants:
        sides[name] = ours(shape + VARIANTS[name], ps, args.vocab, batches)
    header = (f"device {ps.device} ({megabert.fused_kernels.describe(ps.device.type)}) | torch {torch.__version__} "
              f"threads {torch.get_num_threads()} | {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
              f"seq {args.seq}, batch {args.batch}, fp32, AdamW | {args.corpus} corpus, real (non-padding) tokens "
              f"{real:.1%} | load average {os.getloadavg()[0]:.1f}")
    if args.profile:
        profile_shares(sides, args.profile, header)
    else:
        compare(sides, args.rounds, args.batch * args.seq, f"{header} | median of {args.rounds} interleaved steps")


def compare_packing(args, shape: list[str], ps, num_samples: int = 256) -> None:
    """Unpacked against packed on the same `num_samples` samples, in real tokens/s."""
    import time

    import numpy as np

    from megabert.data import build_tokenizer
    from megabert.data.packing import PACKED_COUNTS, pack_window, packed_micro_batches
    from megabert.tasks.pretraining.batches import packing_spec
    from megabert.tasks.pretraining.indexed_splits import build_train_valid_test_datasets

    cfg = parse_args(shape)
    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.vocab_file)
    train, _, _ = build_train_valid_test_datasets(cfg.data, tokenizer, (num_samples, 0, 0), cfg.train.seed, True)
    samples = [train[i] for i in range(num_samples)]
    unpacked = [{k: torch.from_numpy(np.stack([s[k] for s in samples[i:i + args.batch]])) for k in samples[0]}
                for i in range(0, num_samples - args.batch + 1, args.batch)]
    packed_cfg = parse_args(shape + ["--pack-sequences", "--packing-window", str(num_samples)])
    spec = packing_spec(packed_cfg.data, packed_cfg.train.seed)
    packed = list(packed_micro_batches([pack_window(samples, 0, spec)], spec, 0, args.batch, 0, 1))
    # packed-fixed: the fixed-shape packed step, CUDA's default (megabert.model.packed.fixed_shape_packing)
    sides = {"unpacked": (unpacked, []), "packed": (packed, ["--pack-sequences"]),
             "packed-fixed": (packed, ["--pack-sequences", "--no-unpad-input"])}
    steps, real = {}, {}
    for name, (batches, flags) in sides.items():
        step, _ = ours(shape + flags, ps, args.vocab, [{k: v for k, v in b.items() if k != PACKED_COUNTS}
                                                       for b in batches])
        steps[name], real[name] = step, itertools.cycle([int(b["attention_mask"].sum()) for b in batches])
    for step in steps.values():
        step(), step()  # warm-up
    # the iterators advanced twice with the steps: keep the token counts in step with them
    for name in real:
        next(real[name]), next(real[name])
    seconds, tokens = {n: 0.0 for n in steps}, {n: 0 for n in steps}
    for r in range(args.rounds):
        names = list(steps)
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            steps[name]()
            seconds[name] += time.perf_counter() - t0
            tokens[name] += next(real[name])
    share = {n: sum(int(b["attention_mask"].sum()) for b in sides[n][0])
             / sum(b["attention_mask"].numel() for b in sides[n][0]) for n in sides}
    print(f"device {ps.device} ({megabert.fused_kernels.describe(ps.device.type)}) | torch {torch.__version__} "
          f"threads {torch.get_num_threads()} | {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
          f"seq {args.seq}, {args.batch} rows a step, fp32, AdamW, pretrain_bert.py defaults | {args.corpus} corpus, "
          f"{num_samples} samples: {len(unpacked)} padded batches, {len(packed)} packed | load average "
          f"{os.getloadavg()[0]:.1f} | {args.rounds} interleaved steps per side")
    print(f"{'side':12} {'real token share':>17} {'samples/row':>12} {'step ms':>9} {'real tokens/s':>14} "
          f"{'vs unpacked':>12}")
    rate = {n: tokens[n] / seconds[n] for n in steps}
    for n in steps:
        rows = len(sides[n][0]) * args.batch
        per_row = sum(int(b[PACKED_COUNTS][0]) for b in packed) / rows if n.startswith("packed") else 1.0
        print(f"{n:12} {share[n]:17.1%} {per_row:12.2f} "
              f"{seconds[n] / args.rounds * 1e3:9.1f} {rate[n]:14.0f} {rate[n] / rate['unpacked']:11.2f}x")


# The ops that padding inflates (issue 31): attention dropout's mask, the attention bmm's,
# the token-wise GEMMs, and the zero-fill and copies of padding and unpadding.
PROFILED = {"bernoulli_": ("aten::bernoulli_",), "bmm": ("aten::bmm",), "mm+addmm": ("aten::mm", "aten::addmm"),
            "fill_+copy_": ("aten::fill_", "aten::copy_")}


def profile_shares(sides: dict, steps: int, header: str) -> None:
    """Per side: each PROFILED op's self CPU time as a share of the profiled steps' wall time
    (one side after another, each under its own profiler)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    print(f"{header} | torch.profiler over {steps} steps, self CPU time / wall time")
    print(f"{'side':18} {'step ms':>9} " + " ".join(f"{name:>12}" for name in PROFILED))
    for name, (step, _) in sides.items():
        step(), step()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            wall_us = (time.perf_counter() - start) * 1e6
        self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        cells = [sum(self_us.get(op, 0.0) for op in ops) / wall_us for ops in PROFILED.values()]
        print(f"{name:18} {wall_us / steps / 1e3:9.1f} " + " ".join(f"{c:12.1%}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
