"""`make bench-gpu`'s throughput part (issue 41): BERT-large pre-training, phase 1 (seq 128,
micro-batch 64) and phase 2 (seq 512, micro-batch 16), bf16, one GPU, three sides:

  megabert          pretrain_bert.py's training step, default flags plus --bf16, samples padded
                    one to a row
  megabert-packed   the same plus --pack-sequences: rows of whole samples (first-fit decreasing
                    over one --packing-window of 1024 samples, as pretrain_bert.py packs), the
                    same number of rows per micro-batch
  megabert-packed-graphs
                    megabert-packed plus --cuda-graphs: each micro-batch's forward, loss and
                    backward replayed as one CUDA graph (GPU only)
  megabert-packed-bf16res, megabert-packed-graphs-bf16res
                    megabert-packed (-graphs) plus --bf16-residual: the residual stream, the
                    LayerNorms and the biases in bf16 (GPU only)
  megabert-compiled-epilogues
                    megabert with --dropout-add-backend compiled: the layers' epilogues (bias +
                    GELU, dropout + residual add + LayerNorm) as torch.compile'd fused functions
                    instead of PyTorch's op chain, CUDA's default since it measured faster
                    (issue 41: 744.6 against 510.5 seq/s in phase 1 on an H200)
  transformers      BertForPreTraining as its users run it: sdpa, bf16 autocast, torch's fused
                    AdamW, clipping at 1.0; the padded rows of the megabert side

Samples come from megabert's own generator (short_seq_prob 0.1, SOP pairs, 15% masking) on a
synthetic corpus whose lengths model Wikipedia's (bench/_bert_samples.py says where they come
from). Steps are interleaved; each step ends with a device synchronisation.

Per phase and side it prints sequences/s, real (non-padding) tokens/s, the rows' real-token
share and samples per row, model TFLOP/s and MFU counting real tokens only (Megatron's
accounting per sample, attention within each sample, MLM logits at the masked positions: a
padded slot is not work), the ratio of real tokens/s to transformers, and the peak memory the
side allocated (building it and its first steps); then the targets of issue 41 beside the
figures; a kernel-time breakdown per step from torch.profiler (GEMM, attention,
norm/elementwise, optimizer, other, and the idle time: step wall less the union of kernel busy
time; bench/_kernel_breakdown.py); the host's issue time per step (until the step returned,
before the device's synchronisation: near the wall where the host paces the GPU); the host
synchronisations per step (CUDA's sync debug mode,
counted as warnings) and the graphs torch.compile built after warm-up. The breakdown's "tail"
line times issue 41's items per step: casts/copies (bf16 casts of weights), LayerNorm, GELU,
dropout, the compiled epilogues' Triton kernels and the optimizer (the clip folded into it).
Figures, never asserts.

    python bench/gpu_bert_large.py [--rounds 20] [--sides megabert megabert-packed transformers]
    python bench/gpu_bert_large.py --sides megabert-packed --compile   # the compiled packed step
    python bench/gpu_bert_large.py --device cpu --tiny --rounds 2      # the same logic on a CPU (tests)
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import sys
from typing import Optional

import numpy as np
import torch

import megabert
import _kernel_breakdown as kb
from _bert_samples import VOCAB, bert_samples
from _gpu_common import (Device, Side, batch_flops, dynamo_counts, fmt, hf_train_step, profile_side,
                         time_interleaved, warm_up)
from megabert.arguments import parse_args
from megabert.data.packing import PACKED_COUNTS, pack_window, packed_micro_batches
from megabert.tasks.pretraining.batches import packing_spec
from megabert.tasks.pretraining.task import build_pretraining
from megabert.training.metrics import device_peak_tflops
from megabert.training.resolve import resolve_run
from megabert.training.cuda_graphs import WARMUP_STEPS as GRAPH_WARMUP_STEPS

TARGET_MFU, TARGET_VS_TRANSFORMERS, MOONSHOT_MFU = 0.45, 1.8, 0.55
SIDES = ("megabert", "megabert-packed", "megabert-packed-graphs", "megabert-packed-bf16res",
         "megabert-packed-graphs-bf16res", "megabert-compiled-epilogues", "transformers")
# --cuda-graphs needs a GPU; --bf16-residual is a GPU measure (tests/test_bf16_residual.py has its CPU side).
CUDA_ONLY = ("megabert-packed-graphs", "megabert-packed-bf16res", "megabert-packed-graphs-bf16res")
# Each megabert side's flags beyond the default ones and --bf16 (packing: the "-packed" in its name).
SIDE_FLAGS = {"megabert-compiled-epilogues": ("--dropout-add-backend", "compiled"),
              "megabert-packed-graphs": ("--cuda-graphs",),
              "megabert-packed-bf16res": ("--bf16-residual",),
              "megabert-packed-graphs-bf16res": ("--cuda-graphs", "--bf16-residual")}
PACKING_WINDOW = 1024  # pretrain_bert.py's --packing-window default
NUM_BATCHES = 4  # distinct micro-batches each side cycles through
# Without --compile only the layers' fused epilogues compile, on CUDA (megabert.ops.epilogues).
EAGER_MODE = "eager"


TINY_VOCAB = 1024  # --tiny: a vocabulary that keeps the MLM heads as small as the rest


def vocab_size(tiny: bool) -> int:
    return TINY_VOCAB if tiny else VOCAB


def model_flags(tiny: bool) -> list[str]:
    return ["--preset", "bert-tiny" if tiny else "bert-large"]


def megabert_step(ps, flags: list[str], seq: int, batch: int, batches: list[dict], packed: bool, compile_: bool,
                  vocab: int, extra: tuple[str, ...] = ()):
    argv = flags + list(extra) + ["--bf16", "--seq-length", str(seq), "--max-position-embeddings", "512",
                    "--micro-batch-size", str(batch), "--global-batch-size", str(batch), "--data-path", "unused",
                    "--train-iters", "1000000", "--log-interval", "1000000", "--eval-interval", "0"]
    argv += (["--pack-sequences"] if packed else []) + (["--compile"] if compile_ else [])
    cfg = parse_args(argv)
    trainer = build_pretraining(resolve_run(cfg, ps), ps, vocab, lambda consumed: itertools.cycle(batches))
    trainer.strategy.model.train()
    return trainer.train_step, cfg


def transformers_step(model_cfg, vocab: int, batches: list[dict], device: torch.device):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=model_cfg.hidden_size,
                                     num_hidden_layers=model_cfg.num_layers,
                                     num_attention_heads=model_cfg.num_attention_heads,
                                     intermediate_size=model_cfg.ffn_hidden_size, max_position_embeddings=512,
                                     attn_implementation="sdpa")
    model = transformers.BertForPreTraining(config).to(device).train()
    return hf_train_step(model, batches, device)


def padded_batches(samples: list[dict], batch: int) -> list[dict]:
    return [{k: torch.from_numpy(np.stack([s[k] for s in samples[i * batch:(i + 1) * batch]])) for k in samples[0]}
            for i in range(NUM_BATCHES)]


def packed_batches(samples: list[dict], batch: int, cfg) -> tuple[list[dict], list[int]]:
    """NUM_BATCHES micro-batches of `batch` packed rows from one window of `samples`, and the
    samples each holds."""
    spec = dataclasses.replace(packing_spec(cfg.data, cfg.train.seed), window=len(samples))
    rows = packed_micro_batches([pack_window(samples, 0, spec)], spec, 0, batch, 0, 1)
    out = list(itertools.islice(rows, NUM_BATCHES))
    if len(out) < NUM_BATCHES:
        sys.exit(f"bench/gpu_bert_large.py: {len(samples)} samples made {len(out)} packed micro-batches of {batch} "
                 f"rows, fewer than {NUM_BATCHES}; raise --packing-window")
    return [{k: v for k, v in b.items() if k != PACKED_COUNTS} for b in out], [int(b[PACKED_COUNTS][0]) for b in out]


def build_sides(names, ps, dev: Device, args, seq: int, batch: int, samples: list[dict]) -> list[Side]:
    """Each side built in turn, with the peak memory of its building and first steps (less
    what was allocated before it)."""
    padded = padded_batches(samples, batch)
    # One accounting for every side: the model's FLOPs at the vocabulary the samples use.
    model_cfg = dataclasses.replace(parse_args(model_flags(args.tiny)).model, vocab_size=vocab_size(args.tiny))
    sides = []
    for name in names:
        before = dev.allocated()
        dev.reset_peak()
        packed = name.startswith("megabert-packed")
        if packed:  # packed as pretrain_bert.py --pack-sequences packs (its flags' spec)
            host, counts = packed_batches(samples, batch, parse_args(
                model_flags(args.tiny) + ["--seq-length", str(seq), "--pack-sequences", "--data-path", "unused"]))
        else:
            host, counts = padded, [batch] * NUM_BATCHES
        on_device = [{k: v.to(ps.device) for k, v in b.items()} for b in host]
        extra = SIDE_FLAGS.get(name, ())
        if name == "transformers":
            step = transformers_step(model_cfg, vocab_size(args.tiny), on_device, ps.device)
        else:
            # pretrain_bert.py's path: host batches (pinned, as its DataLoader pins them) that the
            # trainer's pipeline completes on the host (MLM positions) and copies to the GPU.
            pinned = [{k: v.pin_memory() for k, v in b.items()} for b in host] if ps.device.type == "cuda" else host
            step, _ = megabert_step(ps, model_flags(args.tiny), seq, batch, pinned, packed, args.compile,
                                    vocab_size(args.tiny), extra)
        side = Side(name, step, counts, [int(b["attention_mask"].sum()) for b in host],
                    [batch_flops(model_cfg, b) for b in host], rows=batch, seq=seq)
        # --cuda-graphs: its eager steps and the capture before the timed ones.
        warm_up(side, dev, args.warmup + (GRAPH_WARMUP_STEPS + 1 if "--cuda-graphs" in extra else 0), before)
        sides.append(side)
    return sides


def report(phase: str, sides: list[Side], peak_tflops: Optional[float]) -> None:
    """The figures table of one phase, then the targets of issue 41 beside each megabert side."""
    base = next((s for s in sides if s.name == "transformers"), None)
    targets = []
    for s in sides:
        tflops = s.per_s(s.flops) / 1e12
        mfu = tflops / peak_tflops if peak_tflops else None
        ratio = f"{s.per_s(s.real_tokens) / base.per_s(base.real_tokens):.2f}x" if base else "n/a"
        peak_gb = None if s.peak_bytes is None else s.peak_bytes / 1e9
        print(f"{phase:6} {s.name:26} {s.per_s(s.samples):9.1f} {s.per_s(s.real_tokens):11.0f} "
              f"{s.real_share():10.1%} {s.samples_per_row():11.2f} {tflops:9.1f} {fmt(mfu, '.1%'):>7} {ratio:>16} "
              f"{fmt(peak_gb, '.2f'):>8}")
        if s.name != "transformers":
            targets.append(f"  target {phase} {s.name}: MFU {fmt(mfu, '.1%')} against {TARGET_MFU:.0%} (moonshot "
                           f"{MOONSHOT_MFU:.0%}), {ratio} against {TARGET_VS_TRANSFORMERS}x transformers")
    print("\n".join(targets))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the same logic on a CPU (with --tiny: what tests/test_gpu_tooling.py runs)")
    p.add_argument("--tiny", action="store_true",
                   help=f"bert-tiny, a vocabulary of {TINY_VOCAB}, micro-batches 4 and 1, a window of 64 samples")
    p.add_argument("--sides", nargs="+", choices=SIDES, help="default: all (on a CPU those that run there)")
    p.add_argument("--compile", action="store_true", help="the megabert sides with --compile")
    p.add_argument("--rounds", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    p.add_argument("--phases", nargs="+", choices=("1", "2"), default=["1", "2"])
    p.add_argument("--phase1-batch", type=int)
    p.add_argument("--phase2-batch", type=int)
    p.add_argument("--packing-window", type=int)
    p.add_argument("--profile-steps", type=int, default=3, help="steps per side in the kernel breakdown (0: none)")
    p.add_argument("--sync-steps", type=int, default=5, help="steps per side over which host syncs are counted")
    args = p.parse_args()
    args.sides = args.sides or [s for s in SIDES if args.device == "cuda" or s not in CUDA_ONLY]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_bert_large.py needs a CUDA GPU and a CUDA build of torch (this torch: "
                 f"{torch.__version__}); on a CPU run `make bench`, or --device cpu --tiny to try this script's logic")
    ps = megabert.init_parallel()
    if ps.device.type != args.device:
        sys.exit(f"bench/gpu_bert_large.py --device {args.device}: megabert runs on {ps.device.type} here "
                 f"(hide the GPU with CUDA_VISIBLE_DEVICES= for --device cpu)")
    dev = Device(ps.device)
    window = args.packing_window or (64 if args.tiny else PACKING_WINDOW)
    phases = (("1", 128, args.phase1_batch or (4 if args.tiny else 64)),
              ("2", 512, args.phase2_batch or (1 if args.tiny else 16)))
    peak = device_peak_tflops(ps.device)
    name = torch.cuda.get_device_name(ps.device) if dev.cuda else "cpu"
    print(f"{name} | torch {torch.__version__} | {'bert-tiny' if args.tiny else 'BERT-large'} bf16 | dense bf16 peak "
          f"{peak or 'unknown'} TFLOP/s | {args.rounds} interleaved steps per side after {args.warmup} | "
          f"megabert{' --compile' if args.compile else ''} | samples: megabert's generator, short_seq_prob 0.1, SOP, "
          f"packing window {window}")
    print(f"targets (issue 41): MFU >= {TARGET_MFU:.0%} in both phases, >= {TARGET_VS_TRANSFORMERS}x transformers in "
          f"real tokens/s; moonshot {MOONSHOT_MFU:.0%} MFU")
    for phase, seq, batch in (p for p in phases if p[0] in args.phases):
        samples = bert_samples(seq, max(window, NUM_BATCHES * batch), vocab_size=vocab_size(args.tiny))
        print(f"\nphase {phase}: seq {seq}, micro-batch {batch} rows")
        print(f"{'phase':6} {'side':26} {'seq/s':>9} {'real tok/s':>11} {'real share':>10} {'samples/row':>11} "
              f"{'TFLOP/s':>9} {'MFU':>7} {'vs transformers':>16} {'peak GB':>8}")
        sides = build_sides(args.sides, ps, dev, args, seq, batch, samples)
        graphs0, breaks0 = dynamo_counts()
        time_interleaved(sides, dev, args.rounds)
        report(phase, sides, peak)
        for side in sides:
            issue, wall = 1e3 * sum(side.issue_times) / len(side.times), 1e3 * side.seconds() / len(side.times)
            print(f"host issue {phase} {side.name}: {issue:.1f} ms of {wall:.1f} ms a step ({issue / wall:.0%})")
        if args.profile_steps:
            print(f"kernel time per step, ms and share of the step's wall time (torch.profiler, "
                  f"{args.profile_steps} steps; idle = wall - union of kernel busy time)")
            print(kb.header())
            for side in sides:
                b = profile_side(side, dev, args.profile_steps)
                print(kb.row(phase, side.name, b))
                print(kb.items_line(b))
                if (line := kb.other_line(b)) is not None:
                    print(line)
        for side in sides:
            if side.name != "transformers":
                syncs = dev.count_host_syncs(side.run, args.sync_steps)
                print(f"host syncs {phase} {side.name}: " + ("n/a (no CUDA device)" if syncs is None else
                      f"{syncs / args.sync_steps:.1f} per step ({syncs} in {args.sync_steps} steps after warm-up)"))
        graphs, breaks = dynamo_counts()
        print(f"recompiles {phase}: {graphs - graphs0} graphs compiled and {breaks - breaks0} graph breaks after "
              f"warm-up ({'--compile' if args.compile else EAGER_MODE})")
        del sides
        gc.collect()  # the trainers hold their models in reference cycles: free them before the next phase
        if dev.cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
