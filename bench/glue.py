"""GLUE fine-tuning steps/s at seq 128: finetune_glue.py's training step (its Trainer,
optimizer and default flags, the unpadded encoder) against transformers'
BertForSequenceClassification with torch AdamW and clipping at 1.0 (run_glue.py's
Trainer step), same batches, steps interleaved; transformers-dyn is the same with each batch
padded to its longest row only (run_glue.py --pad_to_max_length False, a dynamic-padding
collator). Nothing passes or fails on time.

Batches: sentence pairs of 20 to 80 real tokens padded to --max-seq-length 128, as
run_glue.py pads them by default (--pad_to_max_length); MRPC's pairs average ~50 tokens,
SST-2's sentences ~25.

    python bench/glue.py [--rounds 8] [--layers 4 --hidden 256 --heads 4 --seq 128 --batch 32]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os

import torch

import megabert
from _timing import interleaved, print_table
from megabert.arguments import parse_finetune_args
from megabert.config import ModelConfig
from megabert.tasks.glue.config import GLUE_DEFAULTS, GlueConfig
from megabert.tasks.glue.finetuning import glue_task
from megabert.training.build import build_trainer
from megabert.training.resolve import resolve_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def glue_batches(args, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        lengths = torch.randint(20, 81, (args.batch,), generator=g)
        am = (torch.arange(args.seq)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1000, args.vocab, (args.batch, args.seq), generator=g) * am
        tt = (torch.arange(args.seq)[None, :] >= lengths[:, None] // 2).long() * am  # sentence B: the second half
        out.append({"input_ids": ids, "token_type_ids": tt, "attention_mask": am,
                    "labels": torch.randint(0, 2, (args.batch,), generator=g)})
    return out


def ours(args, ps, batches):
    cfg = parse_finetune_args(["--task-name", "mrpc", "--load", "unused", "--vocab-file", "unused", "--data-dir",
                               "unused", "--output-dir", "unused", "--max-seq-length", str(args.seq),
                               "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch),
                               "--log-interval", "1000000"], task_config=GlueConfig, defaults=GLUE_DEFAULTS)
    # As load_glue_model builds it: two labels, the unpadded encoder.
    model_cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            vocab_size=args.vocab, max_position_embeddings=512, num_labels=2, unpad_input=True)
    model = megabert.BertForSequenceClassification(model_cfg, ps)
    run = resolve_run(cfg, ps, model=model_cfg)
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, train_iters=1_000_000))
    trainer = build_trainer(model, ps, run, glue_task(), lambda consumed: itertools.cycle(batches))
    trainer.strategy.model.train()
    return trainer.train_step, f"{model.ctx.attention_backend}/{model.ctx.layernorm_backend}"


def trimmed(batches: list[dict]) -> list[dict]:
    """The same batches padded to their longest row only (run_glue.py --pad_to_max_length False)."""
    out = []
    for b in batches:
        n = int(b["attention_mask"].sum(1).max())
        out.append({k: (v[:, :n] if v.dim() == 2 else v) for k, v in b.items()})
    return out


def transformers_step(args, batches, device):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                     num_attention_heads=args.heads, intermediate_size=4 * args.hidden, num_labels=2)
    model = transformers.BertForSequenceClassification(config).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
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
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    ps = megabert.init_parallel()
    batches = glue_batches(args, 4)
    sides = {"transformers": transformers_step(args, batches, ps.device),
             "transformers-dyn": transformers_step(args, trimmed(batches), ps.device),
             "finetune_glue.py": ours(args, ps, batches)}
    medians = interleaved({name: step for name, (step, _) in sides.items()}, args.rounds)
    print(f"device {ps.device} | torch {torch.__version__} threads {torch.get_num_threads()} | GLUE fine-tuning "
          f"(sentence pairs, 2 labels), {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch "
          f"{args.batch}, fp32 | median of {args.rounds} interleaved steps")
    print_table(medians, {name: label for name, (_, label) in sides.items()}, args.batch * args.seq, "transformers")
    ours_sps = 1 / medians["finetune_glue.py"]
    print(f"steps/s: finetune_glue.py {ours_sps:.2f}, transformers {1 / medians['transformers']:.2f} (ratio "
          f"{ours_sps * medians['transformers']:.2f}x), transformers padded to each batch's longest "
          f"{1 / medians['transformers-dyn']:.2f} (ratio {ours_sps * medians['transformers-dyn']:.2f}x)")


if __name__ == "__main__":
    main()
