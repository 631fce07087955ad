"""SQuAD fine-tuning tokens/s at seq 384: finetune_squad.py's training step (its Trainer,
optimizer and default flags) against transformers' BertForQuestionAnswering with torch
AdamW and clipping at 1.0, same batches, steps interleaved. Nothing passes or fails on time.

Batches: question + context windows of 200 to 384 real tokens (SQuAD v1.1 at
--max-seq-length 384, --doc-stride 128 pads most windows), answer spans inside them.

    python bench/squad.py [--rounds 6] [--layers 4 --hidden 256 --heads 4 --seq 384 --batch 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os

import torch

import megabert
from _timing import compare
from megabert.arguments import parse_finetune_args
from megabert.config import ModelConfig
from megabert.training.build import build_trainer
from megabert.training.resolve import resolve_run
from megabert.tasks.squad.config import SquadConfig
from megabert.tasks.squad.finetuning import qa_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def squad_batches(args, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        lengths = torch.randint(200, args.seq + 1, (args.batch,), generator=g)
        am = (torch.arange(args.seq)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1000, args.vocab, (args.batch, args.seq), generator=g) * am
        tt = (torch.arange(args.seq)[None, :] >= 40).long() * am  # a 40-token question first
        start = torch.stack([torch.randint(40, int(n) - 10, (1,), generator=g)[0] for n in lengths])
        out.append({"input_ids": ids, "token_type_ids": tt, "attention_mask": am, "start_positions": start,
                    "end_positions": start + 5})
    return out


def ours(args, ps, batches):
    cfg = parse_finetune_args(["--load", "unused", "--vocab-file", "unused", "--train-file", "unused",
                               "--max-seq-length", str(args.seq), "--micro-batch-size", str(args.batch),
                               "--global-batch-size", str(args.batch), "--log-interval", "1000000"],
                              task_config=SquadConfig)
    model_cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            vocab_size=args.vocab, max_position_embeddings=512)
    model = megabert.BertForQuestionAnswering(model_cfg, ps)
    run = resolve_run(cfg, ps, model=model_cfg)
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, train_iters=1_000_000))
    trainer = build_trainer(model, ps, run, qa_task(), lambda consumed: itertools.cycle(batches))
    trainer.strategy.model.train()
    return trainer.train_step, f"{model.ctx.attention_backend}/{model.ctx.layernorm_backend}"


def transformers_step(args, batches, device):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                     num_attention_heads=args.heads, intermediate_size=4 * args.hidden)
    model = transformers.BertForQuestionAnswering(config).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5, weight_decay=0.01)
    it = itertools.cycle(batches)

    def step():
        model(**next(it)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model.config._attn_implementation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--seq", type=int, default=384)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    ps = megabert.init_parallel()
    batches = squad_batches(args, 4)
    sides = {"transformers": transformers_step(args, batches, ps.device), "finetune_squad.py": ours(args, ps, batches)}
    compare(sides, args.rounds, args.batch * args.seq,
            f"device {ps.device} | torch {torch.__version__} threads {torch.get_num_threads()} | SQuAD fine-tuning, "
            f"{args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, fp32 | median of "
            f"{args.rounds} interleaved steps")

if __name__ == "__main__":
    main()
