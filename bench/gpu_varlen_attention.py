"""`make bench-gpu`'s attention part: BERT-large phase 2 (seq 512), bf16, one GPU, with
padded batches as real data has them: pretrain_bert.py's training step with the varlen core
(`--attention-backend varlen`: attention over the real tokens, [T, heads, d] with cu_seqlens)
against SDPA with a padding mask (`--attention-backend sdpa`, the CUDA default: a boolean
mask keeps SDPA off its flash kernel). Both sides run the unpadded encoder (the default), so
the GEMMs are the same and the difference is attention alone. Prints sequences/s, model
TFLOP/s (Megatron's accounting of the padded shape, the same for both sides) and MFU against
the device's dense bf16 peak.

Two settings: attention dropout 0.1 (pre-training; varlen_attn has no dropout, so the varlen
side runs SDPA per length group) and 0 (fine-tuning-like; the varlen side runs FlashAttention's
varlen kernel through torch.nn.attention.varlen). The first call of each logs which ran.

    python bench/gpu_varlen_attention.py [--rounds 20] [--batch 16]
"""
from __future__ import annotations

import argparse
import itertools
import logging
import sys

import torch

import megabert
from _timing import interleaved
from megabert.arguments import parse_args
from megabert.training.metrics import bert_flops_per_sample, device_peak_tflops
from megabert.tasks.pretraining.task import build_pretraining
from megabert.training.resolve import resolve_run

VOCAB = 30522
SEQ = 512


def padded_batches(batch: int, device, count: int = 4) -> list[dict]:
    """Lengths as Megatron's sampler gives on Wikipedia-like data: 90% near the target length
    (384-512), 10% short (short_seq_prob); 15% of real tokens masked."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        short = torch.rand(batch, generator=g) < 0.1
        lengths = torch.where(short, torch.randint(16, SEQ, (batch,), generator=g),
                              torch.randint(384, SEQ + 1, (batch,), generator=g))
        am = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1000, VOCAB, (batch, SEQ), generator=g) * am
        labels = torch.where((torch.rand(batch, SEQ, generator=g) < 0.15) & (am == 1), ids, torch.full_like(ids, -100))
        out.append({"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": am,
                    "labels": labels, "next_sentence_label": torch.randint(0, 2, (batch,), generator=g)})
    return [{k: v.to(device) for k, v in b.items()} for b in out]


def ours(ps, batch: int, backend: str, dropout: float, batches: list[dict]):
    cfg = parse_args(["--preset", "bert-large", "--bf16", "--seq-length", str(SEQ), "--max-position-embeddings", "512",
                      "--micro-batch-size", str(batch), "--global-batch-size", str(batch), "--data-path", "unused",
                      "--train-iters", "1000000", "--log-interval", "1000000", "--eval-interval", "0",
                      "--attention-backend", backend, "--attention-dropout", str(dropout)])
    trainer = build_pretraining(resolve_run(cfg, ps), ps, VOCAB, lambda consumed: itertools.cycle(batches))
    trainer.strategy.model.train()

    def step():
        trainer.train_step()
        torch.cuda.synchronize()

    return step, cfg.model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_varlen_attention.py needs a CUDA GPU and a CUDA build of torch (this torch: "
                 f"{torch.__version__})")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # which varlen path ran
    ps = megabert.init_parallel()
    peak = device_peak_tflops(ps.device)
    batches = padded_batches(args.batch, ps.device)
    real = float(sum(b["attention_mask"].sum() for b in batches)) / sum(b["attention_mask"].numel() for b in batches)
    print(f"{torch.cuda.get_device_name(ps.device)} | torch {torch.__version__} | BERT-large bf16 seq {SEQ} batch "
          f"{args.batch} | real tokens {real:.1%} | dense bf16 peak {peak or 'unknown'} TFLOP/s | median of "
          f"{args.rounds} interleaved steps")
    print(f"{'dropout':8} {'attention':10} {'seq/s':>9} {'TFLOP/s':>9} {'MFU':>7} {'vs sdpa':>9}")
    for dropout in (0.1, 0.0):
        sides, model_cfg = {}, None
        for backend in ("varlen", "sdpa"):
            sides[backend], model_cfg = ours(ps, args.batch, backend, dropout, batches)
        medians = interleaved(sides, args.rounds, warmup=3)
        flops = bert_flops_per_sample(model_cfg, SEQ, masked_tokens=int(round(0.15 * SEQ)))
        for name, t in medians.items():
            tflops = flops * args.batch / t / 1e12
            mfu = f"{tflops / peak:6.1%}" if peak else "    n/a"
            print(f"{dropout:<8} {name:10} {args.batch / t:9.1f} {tflops:9.1f} {mfu:>7} {medians['sdpa'] / t:8.2f}x")
        del sides
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
