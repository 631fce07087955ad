"""Training throughput with and without --compile: tokens/s of forward + backward +
optimizer step through the trainer pretrain_bert.py runs (one process, TP=1), and the
one-off compilation time. Prints figures and ratios; it never passes or fails on time.

Each variant is a Trainer built from pretrain_bert.py's flags (its defaults: unpadded
encoder, fused CPU kernels, MLM logits at masked positions) on the same synthetic batches.
The variants' steps interleave (A B A B ...) so that a machine whose load changes during
the run weighs on each alike; the figures are medians over the steps after the first.
"first s" is the first step, which holds the compilation of the layers (forward and
backward) for the --compile variants; the run starts from an empty TorchInductor cache
unless --warm-cache (a later run on the same machine reuses the compiled kernels). A
second table times the transformer layers alone (forward and backward of the encoder on a
fixed, padded [s, b, h] input: another graph, compiled at its first call), the part
--compile compiles: the whole step also holds the embeddings, the heads and the
optimizer, which stay eager.

    python bench/compile.py                         # 4 layers, hidden 256, seq 128, batch 16
    python bench/compile.py --variants eager compile compile-sdpa --repeats 20
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import megabert
from megabert.arguments import parse_args
from megabert.model.bert import attention_mask_to_bool
from megabert.tasks.pretraining.task import build_pretraining
from megabert.training.resolve import resolve_run  # noqa: E402

VOCAB = 30522
# Variant -> flags added to the model's; "auto" backends are the fused kernels on a CPU
# where they are built.
VARIANTS = {
    "eager": [],
    "compile": ["--compile"],
    "eager-sdpa": ["--attention-backend", "sdpa", "--layernorm-backend", "torch"],
    "compile-sdpa": ["--compile", "--attention-backend", "sdpa", "--layernorm-backend", "torch"],
    "compile-torch": ["--compile", "--attention-backend", "torch", "--layernorm-backend", "torch"],
}


def synthetic_batches(batch: int, seq: int, seed: int = 0):
    """Random tokens, 15% masked; a quarter of the rows padded from a random length on, so
    the unpadded encoder's token count changes from batch to batch as on real data."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(1000, VOCAB, (batch, seq), generator=g)
        am = torch.ones_like(ids)
        for row in range(batch // 4):
            am[row, int(torch.randint(8, seq, (1,), generator=g)):] = 0
        labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        yield {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": am, "labels": labels,
               "next_sentence_label": torch.randint(0, 2, (batch,), generator=g)}


def interleaved(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(first call's seconds, the next `repeats` calls' seconds) of each fn, calls interleaved."""
    first, times = {}, {name: [] for name in fns}
    for step in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            if step == 0:
                first[name] = elapsed
            else:
                times[name].append(elapsed)
    return first, times


def table(title: str, trainers: dict, timed: tuple[dict, dict], tokens: int) -> None:
    first, times = timed
    base_name = next(iter(times))
    base = statistics.median(times[base_name])
    print(f"\n{title}")
    print(f"{'variant':14} {'backends':12} {'median ms':>10} {'tokens/s':>9} {f'vs {base_name}':>10} "
          f"{'min-max ms':>15} {'first s':>8}")
    for name, trainer in trainers.items():
        med = statistics.median(times[name])
        ctx = trainer.strategy.model.ctx
        spread = f"{min(times[name]) * 1e3:.0f}-{max(times[name]) * 1e3:.0f}"
        print(f"{name:14} {ctx.attention_backend + '/' + ctx.layernorm_backend:12} {med * 1e3:10.1f} "
              f"{tokens / med:9.0f} {base / med:9.2f}x {spread:>15} {first[name]:8.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["eager", "compile"], choices=sorted(VARIANTS))
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10, help="timed steps per variant after the first")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--warm-cache", action="store_true", help="reuse TorchInductor's on-disk cache of compiled "
                   "kernels (default: an empty one, as the first run on a machine)")
    args = p.parse_args()
    cache = None if args.warm_cache else tempfile.TemporaryDirectory(prefix="megabert-bench-inductor-")
    if cache is not None:  # removed at exit
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    model_flags = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
                   "--num-attention-heads", str(max(1, args.hidden_size // 64)), "--seq-length", str(args.seq),
                   "--micro-batch-size", str(args.batch), "--train-iters", str(args.repeats + 1),
                   "--hidden-dropout", str(args.dropout), "--attention-dropout", str(args.dropout),
                   "--log-interval", str(10 ** 9), "--eval-interval", "0"]
    ps = megabert.init_parallel()
    trainers = {}
    for name in args.variants:
        cfg = parse_args(model_flags + VARIANTS[name])
        trainer = build_pretraining(resolve_run(cfg, ps), ps, VOCAB,
                                    lambda consumed: synthetic_batches(args.batch, args.seq))
        trainer.strategy.model.train()
        trainers[name] = trainer
    tokens = args.batch * args.seq
    print(f"device {ps.device} | torch {torch.__version__} threads {torch.get_num_threads()} | "
          f"{args.num_layers} layers, hidden {args.hidden_size}, vocab {VOCAB}, seq {args.seq}, batch {args.batch}, "
          f"dropout {args.dropout} | median of {args.repeats} interleaved steps")
    steps = {name: trainer.train_step for name, trainer in trainers.items()}
    table("forward+backward+optimizer step", trainers, interleaved(steps, args.repeats), tokens)
    batch = next(synthetic_batches(args.batch, args.seq))
    mask = attention_mask_to_bool(batch["attention_mask"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.seq, args.batch, args.hidden_size, generator=g).requires_grad_()  # [s, b, h]
    grad = torch.randn(x.shape, generator=g)

    def layers_step(encoder):
        return lambda: torch.autograd.grad(encoder(x, mask), [x] + list(encoder.parameters()), grad)

    layers = {name: layers_step(trainer.strategy.model.bert.encoder) for name, trainer in trainers.items()}
    table("transformer layers only: forward+backward", trainers, interleaved(layers, args.repeats), tokens)
    for trainer in trainers.values():
        trainer.close()
    megabert.destroy_parallel()


if __name__ == "__main__":
    main()
