"""`make bench-gpu`'s ModernBERT step (issue 42): ModernBERT-base pre-training (22 layers,
hidden 768, vocab 50368), bf16, seq 1024, micro-batch 16, one GPU, against transformers:

  megabert           pretrain_bert.py's training step: --preset modernbert-base --model-family
                     modernbert, its default flags (unpadded encoder, logits at the masked
                     positions, the kernel back-ends `auto` picks) plus --bf16, built through
                     parse_args, resolve_run and build_pretraining as the script builds it
  transformers-sdpa  transformers' ModernBertForMaskedLM as its users run it: the same config
                     (megabert's hf_config_from_model, sparse_prediction off as in the
                     published configs), attn_implementation="sdpa", bf16 autocast, torch's
                     fused AdamW, clipping at 1.0
  transformers-fa2   the same with attn_implementation="flash_attention_2"; a default side
                     only where transformers finds flash_attn (the header says whether it ran)

Both sides get the same micro-batches: rows of random lengths between half and all of the
sequence (the padding of bench/modernbert.py, the CPU bench), 30% of the real tokens masked
(ModernBERT's recipe, pretrain_bert.py's --mask-prob for the family). Steps are interleaved;
each ends with a device synchronisation.

Per side: sequences/s, real (non-padding) tokens/s, the rows' real-token share, model
TFLOP/s and MFU counting real tokens only (megabert's accounting, bert_flops_per_sample:
GeGLU, global layers' attention within each sample, local layers' within the 128-token window,
the MLM head at the masked positions), the ratio of real tokens/s to transformers-sdpa, and
the peak memory the side allocated (building it and its first steps); then one ratio line per
transformers side, a kernel-time breakdown per step (bench/_kernel_breakdown.py), megabert's
host synchronisations per step and the graphs torch.compile built after warm-up. Figures,
never asserts; tools/gpu/bench_figures.py's `modernbert` reads them.

    python bench/gpu_modernbert.py [--rounds 20] [--batch 16] [--sides megabert transformers-sdpa]
    python bench/gpu_modernbert.py --device cpu --tiny --rounds 2   # the same logic on a CPU (tests)
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import torch

import megabert
import _kernel_breakdown as kb
from _gpu_common import (Device, Side, batch_flops, dynamo_counts, fmt, hf_train_step, profile_side,
                         time_interleaved, warm_up)
from megabert.arguments import parse_args
from megabert.checkpoint.hf import hf_config_from_model
from megabert.presets import modernbert_base
from megabert.tasks.pretraining.task import build_pretraining
from megabert.training.metrics import device_peak_tflops
from megabert.training.resolve import resolve_run

SIDES = ("megabert", "transformers-sdpa", "transformers-fa2")
ATTENTION = {"transformers-sdpa": "sdpa", "transformers-fa2": "flash_attention_2"}
BASELINE = "transformers-sdpa"
NUM_BATCHES = 4  # distinct micro-batches each side cycles through
VOCAB = modernbert_base().vocab_size  # ModernBERT's tokenizer: 50368
TINY_VOCAB = 1024  # --tiny: a vocabulary that keeps the MLM heads as small as the rest
MASK_PROB = 0.3
EAGER_MODE = "eager"


def fa2_available() -> bool:
    """Whether transformers can run flash_attention_2 here (flash_attn importable, a CUDA GPU)."""
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def model_flags(tiny: bool) -> list[str]:
    return ["--preset", "modernbert-tiny" if tiny else "modernbert-base", "--model-family", "modernbert"]


def megabert_step(ps, tiny: bool, seq: int, batch: int, batches: list[dict], vocab: int):
    """pretrain_bert.py's train_step for these flags, its batches `batches` in turn."""
    argv = model_flags(tiny) + ["--bf16", "--seq-length", str(seq), "--micro-batch-size", str(batch),
                                "--global-batch-size", str(batch), "--data-path", "unused", "--train-iters", "1000000",
                                "--log-interval", "1000000", "--eval-interval", "0"]
    cfg = parse_args(argv)
    if cfg.data.mask_prob != MASK_PROB:
        sys.exit(f"bench/gpu_modernbert.py: pretrain_bert.py --model-family modernbert masks {cfg.data.mask_prob} of "
                 f"the tokens, the batches here {MASK_PROB}: make MASK_PROB the family's default")
    trainer = build_pretraining(resolve_run(cfg, ps), ps, vocab, lambda consumed: itertools.cycle(batches))
    trainer.strategy.model.train()
    return trainer.train_step, trainer.strategy.model


def transformers_step(model_cfg, attention: str, batches: list[dict], device: torch.device):
    import transformers

    transformers.logging.set_verbosity_error()
    hf = {k: v for k, v in hf_config_from_model(model_cfg).items() if k not in ("architectures", "model_type",
                                                                               "torch_dtype")}
    # Padding is id 0 in these batches (ModernBERT's tokenizer pads with 50283, outside --tiny's vocab).
    config = transformers.ModernBertConfig(**{**hf, "pad_token_id": 0}, attn_implementation=attention)
    model = transformers.ModernBertForMaskedLM(config).to(device).train()
    return hf_train_step(model, batches, device)


def mlm_batches(seq: int, batch: int, vocab: int, seed: int = 0) -> list[dict]:
    """NUM_BATCHES micro-batches [batch, seq]: rows of random lengths in [seq / 2, seq] (the
    rest padding, id 0 and attention_mask 0), MASK_PROB of the real tokens predicted (labels
    the token there, -100 elsewhere). Ids avoid the first few (special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(NUM_BATCHES):
        ids = torch.randint(5, vocab, (batch, seq), generator=gen)
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
        mask = (torch.arange(seq)[None] < lengths[:, None]).long()
        picked = (torch.rand(ids.shape, generator=gen) < MASK_PROB) & (mask == 1)
        out.append({"input_ids": ids * mask, "attention_mask": mask,
                    "labels": torch.where(picked, ids, torch.full_like(ids, -100))})
    return out


def build_sides(names, ps, dev: Device, args, seq: int, batch: int) -> tuple[list[Side], object]:
    """Each side built in turn, with the peak memory of its building and first steps (less
    what was allocated before it); and megabert's model (None when it did not run)."""
    vocab = TINY_VOCAB if args.tiny else VOCAB
    host = mlm_batches(seq, batch, vocab)
    on_device = [{k: v.to(ps.device) for k, v in b.items()} for b in host]
    # One accounting for every side: the model's FLOPs at the vocabulary the batches use (the
    # vocab build_pretraining gives the model: the tokenizer's).
    model_cfg = dataclasses.replace(parse_args(model_flags(args.tiny) + ["--data-path", "unused"]).model,
                                    vocab_size=vocab)
    flops = [batch_flops(model_cfg, b) for b in host]
    sides, built = [], None
    for name in names:
        before = dev.allocated()
        dev.reset_peak()
        if name == "megabert":
            step, built = megabert_step(ps, args.tiny, seq, batch, on_device, vocab)
        else:
            step = transformers_step(model_cfg, ATTENTION[name], on_device, ps.device)
        side = Side(name, step, [batch] * NUM_BATCHES, [int(b["attention_mask"].sum()) for b in host], flops,
                    rows=batch, seq=seq)
        warm_up(side, dev, args.warmup, before)
        sides.append(side)
    return sides, built


def report(seq: int, sides: list[Side], peak_tflops) -> None:
    """The figures table, then one ratio line per transformers side."""
    base = next((s for s in sides if s.name == BASELINE), None)
    ours = next((s for s in sides if s.name == "megabert"), None)
    for s in sides:
        tflops = s.per_s(s.flops) / 1e12
        mfu = tflops / peak_tflops if peak_tflops else None
        ratio = f"{s.per_s(s.real_tokens) / base.per_s(base.real_tokens):.2f}x" if base else "n/a"
        peak_gb = None if s.peak_bytes is None else s.peak_bytes / 1e9
        print(f"{seq:<6} {s.name:26} {s.per_s(s.samples):9.1f} {s.per_s(s.real_tokens):11.0f} "
              f"{s.real_share():10.1%} {tflops:9.1f} {fmt(mfu, '.1%'):>7} {ratio:>18} {fmt(peak_gb, '.2f'):>8}")
    for s in sides:
        if ours is not None and s.name != "megabert":
            print(f"ratio {seq} megabert/{s.name}: {ours.per_s(ours.real_tokens) / s.per_s(s.real_tokens):.2f}x "
                  f"real tokens/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the same logic on a CPU (with --tiny: what tests/test_gpu_tooling.py runs)")
    p.add_argument("--tiny", action="store_true",
                   help=f"modernbert-tiny (4 layers, hidden 256), a vocabulary of {TINY_VOCAB}, seq 256 (two local "
                        f"windows), micro-batch 2")
    p.add_argument("--sides", nargs="+", choices=SIDES,
                   help="default: megabert, transformers-sdpa, and transformers-fa2 where flash_attn is importable")
    p.add_argument("--seq", type=int, help="sequence length (default 1024; --tiny 256)")
    p.add_argument("--batch", type=int, help="micro-batch rows (default 16, what an 80 GB GPU holds for "
                                             "transformers' full-vocabulary logits; --tiny 2)")
    p.add_argument("--rounds", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    p.add_argument("--profile-steps", type=int, default=2, help="steps per side in the kernel breakdown (0: none)")
    p.add_argument("--sync-steps", type=int, default=5, help="steps of megabert over which host syncs are counted")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_modernbert.py needs a CUDA GPU and a CUDA build of torch (this torch: "
                 f"{torch.__version__}); on a CPU run bench/modernbert.py, or --device cpu --tiny to try this "
                 f"script's logic")
    fa2 = fa2_available()
    names = args.sides or [s for s in SIDES if s != "transformers-fa2" or fa2]
    if "transformers-fa2" in names and not fa2:
        sys.exit("bench/gpu_modernbert.py --sides transformers-fa2: transformers finds no flash_attn here "
                 "(transformers.utils.is_flash_attn_2_available() is False); install flash-attn or drop the side")
    ps = megabert.init_parallel()
    if ps.device.type != args.device:
        sys.exit(f"bench/gpu_modernbert.py --device {args.device}: megabert runs on {ps.device.type} here "
                 f"(hide the GPU with CUDA_VISIBLE_DEVICES= for --device cpu)")
    dev = Device(ps.device)
    seq, batch = args.seq or (256 if args.tiny else 1024), args.batch or (2 if args.tiny else 16)
    peak = device_peak_tflops(ps.device)
    gpu = torch.cuda.get_device_name(ps.device) if dev.cuda else "cpu"
    print(f"{gpu} | torch {torch.__version__} | {'modernbert-tiny' if args.tiny else 'ModernBERT-base'} bf16 | "
          f"seq {seq}, micro-batch {batch} rows, {MASK_PROB:.0%} masking | dense bf16 peak {peak or 'unknown'} "
          f"TFLOP/s | {args.rounds} interleaved steps per side after {args.warmup}")
    import transformers

    ran = [ATTENTION[n] for n in names if n in ATTENTION]
    print(f"transformers attention: {', '.join(ran) or 'none'} ran; flash_attention_2 "
          f"{'available' if fa2 else 'not available (flash_attn not importable)'} | transformers "
          f"{transformers.__version__}")
    sides, model = build_sides(names, ps, dev, args, seq, batch)
    if model is not None:  # the back-ends `auto` resolved to on this device
        ctx, cfg = model.ctx, model.config
        print(f"megabert: attention {ctx.attention_backend}, layernorm {ctx.layernorm_backend}, dropout-add "
              f"{ctx.dropout_add_backend}, unpadded {cfg.unpad_input}, logits at the masked positions "
              f"{cfg.mlm_logits_at_masked_only}")
    print(f"{'seq':6} {'side':26} {'seq/s':>9} {'real tok/s':>11} {'real share':>10} {'TFLOP/s':>9} {'MFU':>7} "
          f"{'vs transformers-sdpa':>18} {'peak GB':>8}")
    graphs0, breaks0 = dynamo_counts()
    time_interleaved(sides, dev, args.rounds)
    report(seq, sides, peak)
    if args.profile_steps:
        print(f"kernel time per step, ms and share of the step's wall time (torch.profiler, {args.profile_steps} "
              f"steps; idle = wall - union of kernel busy time)")
        print(f"{'seq':6}" + kb.header()[6:])
        for side in sides:
            b = profile_side(side, dev, args.profile_steps)
            print(kb.row(str(seq), side.name, b))
            if (line := kb.other_line(b)) is not None:
                print(line)
    for side in sides:
        if side.name == "megabert":
            syncs = dev.count_host_syncs(side.run, args.sync_steps)
            print(f"host syncs {seq} megabert: " + ("n/a (no CUDA device)" if syncs is None else
                  f"{syncs / args.sync_steps:.1f} per step ({syncs} in {args.sync_steps} steps after warm-up)"))
    graphs, breaks = dynamo_counts()
    print(f"recompiles {seq}: {graphs - graphs0} graphs compiled and {breaks - breaks0} graph breaks after warm-up "
          f"({EAGER_MODE})")


if __name__ == "__main__":
    main()
