"""ModernBERT training tokens/s on the CPU: megabert's ModernBertForMaskedLM as pretrain_bert.py
runs it (unpadded encoder, logits at the masked positions only, the kernel back-ends `auto`
picks: on AVX2/AVX-512 the varlen attention kernel, whose local layers skip the key tiles
outside their 128-token window) against transformers' ModernBertForMaskedLM as its users run
it on a CPU (sdpa attention), same weights, same batches, same optimizer (torch's fused AdamW:
what megabert's build_optimizer and transformers' Trainer (torch >= 2.8) both default to;
gradient clipping at 1.0), in one run. Steps are interleaved so that a noisy
machine slows both sides alike (bench/_timing.py); tokens/s counts batch x seq-length.
The batch: rows of random lengths between half and all of --seq, 30% of the real tokens
masked (ModernBERT's recipe). Nothing here passes or fails on time.

    python bench/modernbert.py [--rounds 5] [--layers 4 --hidden 256 --heads 4 --seq 1024 --batch 2]
    python bench/modernbert.py --seq 8192 --batch 1
"""
from __future__ import annotations

import argparse
import tempfile

import torch

import megabert
from _timing import compare


def batch(args, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (args.batch, args.seq), generator=gen)
    lengths = torch.randint(args.seq // 2, args.seq + 1, (args.batch,), generator=gen)
    am = (torch.arange(args.seq)[None] < lengths[:, None]).long()
    labels = torch.where((torch.rand(ids.shape, generator=gen) < 0.3) & (am == 1), ids, torch.full_like(ids, -100))
    return {"input_ids": ids * am, "attention_mask": am, "labels": labels}


def step_of(model, b: dict, forward):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        opt.zero_grad(set_to_none=True)
        forward(model, b).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    import transformers

    cfg = megabert.modernbert_tiny(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                                   unpad_input=True, mlm_logits_at_masked_only=True)
    ours = megabert.ModernBertForMaskedLM(cfg, megabert.init_parallel())
    with tempfile.TemporaryDirectory() as d:
        ours.save_hf(d)
        theirs = transformers.ModernBertForMaskedLM.from_pretrained(d, attn_implementation="sdpa")
    b = batch(args, cfg.vocab_size)
    sides = {
        "megabert": (step_of(ours, b, lambda m, x: m(**x).loss), f"attention {ours.ctx.attention_backend}"),
        "transformers": (step_of(theirs, b, lambda m, x: m(**x).loss), "sdpa"),
    }
    compare(sides, args.rounds, args.batch * args.seq,
            f"ModernBERT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
            f"{torch.get_num_threads()} threads: training step (forward, backward, AdamW)")


if __name__ == "__main__":
    main()
