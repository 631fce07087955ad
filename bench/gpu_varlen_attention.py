"""`make bench-gpu`'s attention part: BERT-large phase 2 (seq 512; `--seq 128 --batch 64` for
phase 1), bf16, one GPU: pretrain_bert.py's training step with the varlen core
(`--attention-backend varlen`, the CUDA default where FlashAttention runs: attention over the
real tokens, [T, heads, d] with cu_seqlens) against SDPA with a padding mask
(`--attention-backend sdpa`). Both sides run the unpadded encoder (the default), so
the GEMMs are the same and the difference is attention alone. Prints sequences/s, model
TFLOP/s (Megatron's accounting of the padded shape, the same for both sides) and MFU against
the device's dense bf16 peak.

Two data sets, padded (Wikipedia-like lengths) and full (every sequence full length, as
packed shards), each with attention dropout 0.1 (pre-training) and 0 (fine-tuning-like); the varlen
side runs FlashAttention's varlen kernel in all four, its dropout inside the kernel. The
first call logs which kernel ran.

    python bench/gpu_varlen_attention.py [--rounds 20] [--batch 16] [--seq 512]
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
from megabert.planning.flops import bert_flops_per_sample
from megabert.training.metrics import device_peak_tflops
from megabert.tasks.pretraining.task import build_pretraining
from megabert.training.resolve import resolve_run

VOCAB = 30522


def padded_batches(batch: int, seq: int, device, count: int = 4, full: bool = False) -> list[dict]:
    """Lengths as Megatron's sampler gives on Wikipedia-like data: 90% near the target length
    (3/4 of it to all of it), 10% short (short_seq_prob); 15% of real tokens masked. `full`:
    every sequence `seq` tokens, as NVIDIA's packed shards have them."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        short = torch.rand(batch, generator=g) < 0.1
        lengths = torch.where(short, torch.randint(16, seq, (batch,), generator=g),
                              torch.randint(seq * 3 // 4, seq + 1, (batch,), generator=g))
        if full:
            lengths = torch.full_like(lengths, seq)
        am = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1000, VOCAB, (batch, seq), generator=g) * am
        labels = torch.where((torch.rand(batch, seq, generator=g) < 0.15) & (am == 1), ids, torch.full_like(ids, -100))
        out.append({"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": am,
                    "labels": labels, "next_sentence_label": torch.randint(0, 2, (batch,), generator=g)})
    return [{k: v.to(device) for k, v in b.items()} for b in out]


def ours(ps, seq: int, batch: int, backend: str, dropout: float, batches: list[dict]):
    cfg = parse_args(["--preset", "bert-large", "--bf16", "--seq-length", str(seq), "--max-position-embeddings", "512",
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
    p.add_argument("--seq", type=int, default=512, help="sequence length (phase 1: 128, batch 64)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_varlen_attention.py needs a CUDA GPU and a CUDA build of torch (this torch: "
                 f"{torch.__version__})")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # which varlen path ran
    ps = megabert.init_parallel()
    peak = device_peak_tflops(ps.device)
    print(f"{torch.cuda.get_device_name(ps.device)} | torch {torch.__version__} | BERT-large bf16 seq {args.seq} batch "
          f"{args.batch} | dense bf16 peak {peak or 'unknown'} TFLOP/s | median of {args.rounds} interleaved steps")
    print(f"{'data':22} {'dropout':8} {'attention':10} {'seq/s':>9} {'TFLOP/s':>9} {'MFU':>7} {'vs sdpa':>9}")
    for full in (False, True):
        batches = padded_batches(args.batch, args.seq, ps.device, full=full)
        real = float(sum(b["attention_mask"].sum() for b in batches)) / sum(b["attention_mask"].numel()
                                                                           for b in batches)
        data = f"{'full' if full else 'padded'}, {real:.1%} real"
        for dropout in (0.1, 0.0):
            sides, model_cfg = {}, None
            for backend in ("varlen", "sdpa"):
                sides[backend], model_cfg = ours(ps, args.seq, args.batch, backend, dropout, batches)
            medians = interleaved(sides, args.rounds, warmup=3)
            flops = bert_flops_per_sample(model_cfg, args.seq, masked_tokens=int(round(0.15 * args.seq)))
            for name, t in medians.items():
                tflops = flops * args.batch / t / 1e12
                mfu = f"{tflops / peak:6.1%}" if peak else "    n/a"
                print(f"{data:22} {dropout:<8} {name:10} {args.batch / t:9.1f} {tflops:9.1f} {mfu:>7} "
                      f"{medians['sdpa'] / t:8.2f}x")
            del sides
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
