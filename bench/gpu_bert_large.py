"""`make bench-gpu`'s throughput part: BERT-large pre-training, phase 1 (seq 128) and
phase 2 (seq 512), bf16, one GPU: pretrain_bert.py's training step (default flags plus
--bf16) against transformers' BertForPreTraining (sdpa, bf16 autocast, torch's fused AdamW,
clipping at 1.0) on the same device, steps interleaved. Prints sequences/s, model TFLOP/s
(Megatron's accounting, as the training log), MFU against the device's dense bf16 peak, and
the ratio to transformers.

Batches are full-length (NVIDIA's phase 1/2 data packs sentences to the length; 15%
masked), so unpadding buys nothing here: these figures are the dense step.

    python bench/gpu_bert_large.py [--rounds 20] [--phase1-batch 64] [--phase2-batch 16] [--profile N]

--profile N: after the timing, each side's N heaviest operators over 3 profiled steps
(torch.profiler, self CUDA time per step; the CPU time beside it shows where the host is
the bottleneck).
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

import megabert
from _timing import interleaved
from megabert.arguments import parse_args
from megabert.training.metrics import bert_flops_per_sample, device_peak_tflops
from megabert.tasks.pretraining.task import build_pretraining
from megabert.training.resolve import resolve_run

VOCAB = 30522


def full_batches(batch: int, seq: int, device, count: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(1000, VOCAB, (batch, seq), generator=g)
        labels = torch.where(torch.rand(batch, seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        out.append({"input_ids": ids, "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(batch, seq),
                    "attention_mask": torch.ones(batch, seq, dtype=torch.long), "labels": labels,
                    "next_sentence_label": torch.randint(0, 2, (batch,), generator=g)})
    return [{k: v.to(device) for k, v in b.items()} for b in out]


def ours(ps, seq: int, batch: int, batches: list[dict]):
    cfg = parse_args(["--preset", "bert-large", "--bf16", "--seq-length", str(seq), "--max-position-embeddings", "512",
                      "--micro-batch-size", str(batch), "--global-batch-size", str(batch), "--data-path", "unused",
                      "--train-iters", "1000000", "--log-interval", "1000000", "--eval-interval", "0"])
    trainer = build_pretraining(resolve_run(cfg, ps), ps, VOCAB, lambda consumed: itertools.cycle(batches))
    trainer.strategy.model.train()
    return trainer.train_step, cfg.model


def transformers_step(seq: int, batches: list[dict], device):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                     intermediate_size=4096, max_position_embeddings=512, attn_implementation="sdpa")
    model = transformers.BertForPreTraining(config).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    it = itertools.cycle(batches)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**next(it)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def profile(name: str, step, top: int) -> None:
    """The `top` operators by self CUDA time over 3 steps, per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
    # Operators (host events) only: their self device time is that of the kernels they
    # launched, so the kernels themselves are not counted a second time.
    ops = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in ops) / 3 / 1e3
    print(f"  {name}: kernels {total:.2f} ms per step; top {top} operators (ms per step, share, calls per step)")
    for e in sorted(ops, key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        ms = e.self_device_time_total / 3 / 1e3
        print(f"    {ms:8.3f} {ms / total:6.1%} {e.count // 3:5d}  {e.key[:90]}")


def synced(step):
    def run():
        step()
        torch.cuda.synchronize()
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--phase1-batch", type=int, default=64)
    p.add_argument("--phase2-batch", type=int, default=16)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print each side's N heaviest operators (torch.profiler) after the timing")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_bert_large.py needs a CUDA GPU and a CUDA build of torch (this torch: "
                 f"{torch.__version__}); on a CPU run `make bench`")
    ps = megabert.init_parallel()
    peak = device_peak_tflops(ps.device)
    print(f"{torch.cuda.get_device_name(ps.device)} | torch {torch.__version__} | BERT-large bf16 | dense bf16 peak "
          f"{peak or 'unknown'} TFLOP/s | median of {args.rounds} interleaved steps")
    print(f"{'phase':8} {'side':14} {'seq/s':>9} {'TFLOP/s':>9} {'MFU':>7} {'vs transformers':>16}")
    for phase, seq, batch in (("1", 128, args.phase1_batch), ("2", 512, args.phase2_batch)):
        batches = full_batches(batch, seq, ps.device)
        step, model_cfg = ours(ps, seq, batch, batches)
        steps = {"megabert": synced(step), "transformers": synced(transformers_step(seq, batches, ps.device))}
        medians = interleaved(steps, args.rounds, warmup=3)
        # Both models compute the same FLOPs per sample except transformers' full-vocab
        # MLM logits; count ours (masked-only), so MFU is of useful work for both.
        flops = bert_flops_per_sample(model_cfg, seq, masked_tokens=int(round(0.15 * seq)))
        for name, t in medians.items():
            tflops = flops * batch / t / 1e12
            mfu = f"{tflops / peak:6.1%}" if peak else "    n/a"
            print(f"{phase:8} {name:14} {batch / t:9.1f} {tflops:9.1f} {mfu:>7} "
                  f"{medians['transformers'] / t:15.2f}x")
        if args.profile:
            for name, side in steps.items():
                profile(f"phase {phase} {name}", side, args.profile)
        del steps, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
