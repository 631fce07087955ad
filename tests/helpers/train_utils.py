"""A tiny deterministic masked-LM dataset and a worker that trains on it, so the trainer
can be compared across parallel layouts without the data pipeline."""
import json
from typing import Callable

import torch

import megabert
from megabert.arguments import parse_args
from megabert.tasks.pretraining.task import build_pretraining
from megabert.training.resolve import resolve_run

VOCAB = 99
SEQ = 16
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
        "--max-position-embeddings", "32", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1",
        "--attention-backend", "torch", "--layernorm-backend", "torch", "--eval-interval", "0"]


def sample(index: int, seed: int = 7) -> dict:
    """Sample `index`: the same whoever asks for it (like the real dataset)."""
    g = torch.Generator().manual_seed(seed * 100_003 + index)
    ids = torch.randint(5, VOCAB, (SEQ,), generator=g)
    length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g))
    am = (torch.arange(SEQ) < length).long()
    labels = torch.full((SEQ,), -100)
    pos = torch.randperm(length, generator=g)[:3]
    labels[pos] = ids[pos]
    ids = ids.clone()
    ids[pos] = 4  # [MASK]
    ids[am == 0] = 0
    tt = (torch.arange(SEQ) >= length // 2).long() * am
    return {"input_ids": ids, "token_type_ids": tt, "attention_mask": am, "labels": labels,
            "next_sentence_label": torch.tensor(index % 2)}


def valid_sample(index: int) -> dict:
    """Sample `index` of the valid split: other samples than training's, with 1 to 3 masked
    labels, so that micro-batches and DP ranks hold different numbers of masked tokens (a
    token-weighted accuracy then differs from a mean of per-batch ratios)."""
    s = sample(index, seed=8)
    labelled = (s["labels"] != -100).nonzero().flatten()
    s["labels"][labelled[1 + index % 3:]] = -100
    return s


def batches(consumed: int, micro: int, dp_rank: int, dp_size: int, make: Callable[[int], dict] = sample):
    """Megatron's sampler order: each global chunk of micro x dp samples, this rank's slice."""
    start = consumed
    while True:
        chunk = range(start + dp_rank * micro, start + (dp_rank + 1) * micro)
        items = [make(i) for i in chunk]
        yield {k: torch.stack([it[k] for it in items]) for k in items[0]}
        start += micro * dp_size


def build_trainer(argv, tp=1):
    """(cfg, parallel state, Trainer) of the tiny model; with --eval-interval, a valid split."""
    cfg = parse_args(TINY + ["--tensor-model-parallel-size", str(tp)] + argv)
    ps = megabert.init_parallel(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size)
    run = resolve_run(cfg, ps)
    micro = cfg.train.micro_batch_size
    valid = (lambda: batches(0, micro, ps.dp_rank, ps.dp_size, valid_sample)) if cfg.train.eval_interval else None
    trainer = build_pretraining(run, ps, VOCAB, lambda consumed: batches(consumed, micro, ps.dp_rank, ps.dp_size),
                                valid)
    return cfg, ps, trainer


def step_loss(trainer) -> float:
    """One training step through the trainer's own path, and its logged lm_loss."""
    trainer.train_step()
    return trainer.flush_metrics()["lm_loss"]


def train_worker(rank, world, argv, tp=1):
    _, _, trainer = build_trainer(argv, tp)
    try:
        trainer.train()
    finally:
        trainer.close()


def read_metrics(path, key="lm_loss"):
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [r[key] for r in rows if key in r]
