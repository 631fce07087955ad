"""Pre-training tokens/s: pretrain_bert.py's training step with its default flags, and with
each optimisation turned off in turn, against transformers' BertForPreTraining trained the
way its users do (torch AdamW, gradient clipping at 1.0), on this machine, in one run.

Both sides get the same batches: real BERT samples (sentence-order prediction, 15% masking,
10% short sequences) drawn by megabert's dataset from a corpus built from the Python
standard library's docstrings (no download; cached in --workdir). Steps are interleaved
(A B C ... A B C ...) so that a noisy machine slows every side alike; the figure per side is
the median step time. tokens/s counts batch x seq-length (padding included) for every side.
Nothing here passes or fails on time.

    python bench/pretrain.py [--rounds 10] [--layers 4 --hidden 256 --heads 4 --seq 128 --batch 16]
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys

import torch

import megabert
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
    "attention sdpa": ["--attention-backend", "sdpa"],
    "attention torch": ["--attention-backend", "torch"],
    "layernorm torch": ["--layernorm-backend", "torch"],
    "dropout-add torch": ["--dropout-add-backend", "torch"],
}


def prepare_data(workdir: str, vocab_size: int) -> tuple[str, str]:
    """(dataset prefix, vocab file) of the standard-library corpus, built once."""
    os.makedirs(workdir, exist_ok=True)
    prefix, vocab = os.path.join(workdir, "corpus_text_sentence"), os.path.join(workdir, "vocab.txt")
    if os.path.exists(prefix + ".idx"):
        return prefix, vocab
    tool = lambda name: os.path.join(ROOT, "tools", name)  # noqa: E731
    corpus = os.path.join(workdir, "corpus.jsonl")
    for cmd in ([tool("make_demo_corpus.py"), "--output", corpus, "--max-documents", "4000"],
                [tool("train_tokenizer.py"), "--input", corpus, "--output", vocab, "--vocab-size", str(vocab_size)],
                [tool("preprocess_data.py"), "--input", corpus, "--json-keys", "text", "--output-prefix",
                 os.path.join(workdir, "corpus"), "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab,
                 "--split-sentences", "--workers", "2", "--log-interval", "100000"]):
        subprocess.run([sys.executable] + cmd, check=True, stdout=subprocess.DEVNULL)
    return prefix, vocab


def real_batches(cfg, num_batches: int) -> list[dict]:
    """`num_batches` collated micro-batches of the train split, as the DataLoader yields them."""
    from megabert.data import build_tokenizer
    from megabert.tasks.pretraining.datasets import build_train_valid_test_datasets

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
    p.add_argument("--rounds", type=int, default=10, help="timed steps per side (after 2 warm-up steps)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--workdir", default=os.path.join(ROOT, "bench_out", "pretrain"))
    args = p.parse_args()

    ps = megabert.init_parallel()
    prefix, vocab = prepare_data(args.workdir, args.vocab)
    shape = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads",
             str(args.heads), "--seq-length", str(args.seq), "--max-position-embeddings", "512",
             "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch), "--train-iters", "1000000",
             "--data-path", prefix, "--vocab-file", vocab, "--log-interval", "1000000", "--eval-interval", "0"]
    batches = real_batches(parse_args(shape), 8)
    real = float(sum(b["attention_mask"].sum() for b in batches)) / sum(b["attention_mask"].numel() for b in batches)

    sides = {"transformers": transformers_step(args, batches, ps.device)}
    for name in args.variants:
        sides[name] = ours(shape + VARIANTS[name], ps, args.vocab, batches)
    compare(sides, args.rounds, args.batch * args.seq,
            f"device {ps.device} | torch {torch.__version__} threads {torch.get_num_threads()} | {args.layers} layers, "
            f"hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}, fp32, AdamW | "
            f"real (non-padding) tokens {real:.1%} | median of {args.rounds} interleaved steps")

if __name__ == "__main__":
    main()
