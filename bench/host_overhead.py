"""Can the host keep a GPU busy? The time the host takes to issue one BERT-large training
step, apart from the device, against the time an H100 needs to run it at the MFU target.

A GPU step runs only as fast as the host queues its kernels, once nothing reads back from
the device (megabert's steps read nothing but on logging steps: tests/test_host_syncs.py).
This bench runs a model with BERT-large's structure (24 layers, 16 heads, the MLM and SOP
heads, the losses, clipping and fused AdamW: every op a BERT-large step dispatches) but
widths so small (hidden 64, ffn 256, vocab 1024, seq 128, micro-batch 4) that the CPU's
arithmetic is a small part of the step, and reports per step:

- host ms: the step's wall time on this CPU (median over interleaved rounds). An upper bound
  of the Python and dispatcher time a GPU step costs the host: the tiny tensors' arithmetic
  is still in it.
- ops: ATen ops dispatched (counted with a TorchDispatchMode, forward, backward and optimizer;
  a foreach or fused optimizer op counts once). On CUDA each op is roughly one kernel launch,
  a few microseconds of host time more each, not counted here. The CPU runs its own kernels
  (the CPU's varlen attention, unfused epilogues), so a CUDA step dispatches other ops; the
  count is the same order.

Sides, interleaved (A B C A B C ...): megabert (pretrain_bert.py's step, --bf16, default
flags), megabert-bf16res (plus --bf16-residual: its LayerNorm parameters and biases come
from MasterWeights' copies, an autograd node each), megabert-packed (--pack-sequences
--no-unpad-input: the fixed-shape packed step, the GPU's packed path),
megabert-compiled-epilogues (--dropout-add-backend compiled: each layer's bias + GELU and
dropout + residual + LayerNorm as torch.compile'd calls, whose guards and autograd wrappers
run on the host at every call; CUDA's default until the H200 showed them slower than the
chain), transformers (BertForPreTraining, sdpa, bf16 autocast, fused AdamW, clipping at
1.0, as its users run it). The budget line is BERT-large's step time on an H100
(989 dense bf16 TFLOP/s) at 45% MFU, from megabert's FLOP accounting, for the bench's GPU
shapes (phase 1: seq 128, micro-batch 64; phase 2: seq 512, micro-batch 16).

    python bench/host_overhead.py                # 10 rounds
    python bench/host_overhead.py --rounds 3     # a quick look
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megabert  # noqa: E402
from megabert.arguments import parse_args  # noqa: E402
from megabert.planning.flops import bert_flops_per_sample  # noqa: E402

from _bert_samples import bert_samples  # noqa: E402
from gpu_bert_large import megabert_step, packed_batches, padded_batches, transformers_step  # noqa: E402

H100_BF16_TFLOPS, TARGET_MFU = 989.0, 0.45
# BERT-large's structure at tiny widths: head_dim 4, every op of the real model.
SHAPE = ["--preset", "bert-large", "--hidden-size", "64", "--ffn-hidden-size", "256"]
VOCAB, SEQ, BATCH = 1024, 32, 1
SIDES = ("megabert", "megabert-bf16res", "megabert-packed", "megabert-compiled-epilogues", "transformers")


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def budget_ms(seq: int, batch: int) -> float:
    """BERT-large's step (forward + backward, MLM logits at the masked 15%) at the MFU target."""
    cfg = parse_args(["--preset", "bert-large"]).model
    flops = bert_flops_per_sample(cfg, seq, masked_tokens=round(0.15 * seq)) * batch
    return 1e3 * flops / (TARGET_MFU * H100_BF16_TFLOPS * 1e12)


def build(name: str, ps, samples: list[dict]):
    model_cfg = parse_args(SHAPE).model
    if name == "transformers":
        model_cfg = dataclasses.replace(model_cfg, vocab_size=VOCAB)
        return transformers_step(model_cfg, VOCAB, padded_batches(samples, BATCH), ps.device)
    if name == "megabert-packed":
        cfg = parse_args(SHAPE + ["--seq-length", str(SEQ), "--pack-sequences", "--data-path", "unused"])
        batches, _ = packed_batches(samples, BATCH, cfg)
        extra = ("--no-unpad-input",)
    elif name == "megabert-compiled-epilogues":  # torch.compile'd epilogue calls
        batches, extra = padded_batches(samples, BATCH), ("--dropout-add-backend", "compiled")
    elif name == "megabert-bf16res":  # the residual stream, LayerNorms and biases in bf16
        batches, extra = padded_batches(samples, BATCH), ("--bf16-residual",)
    else:
        batches, extra = padded_batches(samples, BATCH), ()
    step, _ = megabert_step(ps, SHAPE, SEQ, BATCH, batches, name == "megabert-packed", False, VOCAB, extra)
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(0)
    ps = megabert.init_parallel()
    samples = bert_samples(SEQ, 1024, vocab_size=VOCAB)
    steps = {name: build(name, ps, samples) for name in SIDES}
    ops = {}
    for name, step in steps.items():
        for _ in range(args.warmup):
            step()
        counter = OpCount()
        with counter:
            step()
        ops[name] = counter.count
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    print(f"host time per step, BERT-large's structure at hidden 64 (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds, median)")
    hf = statistics.median(times["transformers"])
    for name in SIDES:
        ms = 1e3 * statistics.median(times[name])
        print(f"  {name:27s} host {ms:7.1f} ms   ops {ops[name]:5d}   vs transformers: "
              f"{hf * 1e3 / ms:4.2f}x faster, {ops[name] / ops['transformers']:4.2f}x the ops")
    for phase, (seq, batch) in ((1, (128, 64)), (2, (512, 16))):
        print(f"  budget: BERT-large phase {phase} (seq {seq}, micro-batch {batch}) on an H100 at "
              f"{TARGET_MFU:.0%} MFU: {budget_ms(seq, batch):.1f} ms per step")


if __name__ == "__main__":
    main()
