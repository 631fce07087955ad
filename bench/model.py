"""Forward+backward time of megabert's BertForPreTraining against transformers' on this
machine, same weights and batch, one process (TP=1). Prints figures and ratios; it never
passes or fails on time.

    python bench/model.py [--sizes tiny base] [--batch 8] [--seq 128] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import megabert

SIZES = {"tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
         "small": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
         "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072)}


def timed(step, repeats: int) -> float:
    step()  # warm-up: allocator, lazy init
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", nargs="+", default=["sdpa", "torch", "auto", "masked-only"])
    args = p.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    ps = megabert.init_parallel()
    device = ps.device
    print(f"device {device} | torch {torch.__version__} threads {torch.get_num_threads()} | transformers "
          f"{transformers.__version__} | batch {args.batch} x seq {args.seq} | median of {args.repeats}")
    print(f"{'size':6} {'megabert backend':18} {'megabert ms':>12} {'transformers ms':>16} {'speed-up':>9}")
    for size in args.sizes:
        cfg = transformers.BertConfig(vocab_size=30522, max_position_embeddings=512, hidden_dropout_prob=0.1,
                                      attention_probs_dropout_prob=0.1, **SIZES[size])
        hf = transformers.BertForPreTraining(cfg).to(device)
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            # "masked-only": auto backends plus MLM logits at masked positions only (a
            # megabert option transformers lacks; the loss is the same).
            ours = {b: megabert.BertForPreTraining.from_pretrained(
                d, ps, attention_backend="auto" if b == "masked-only" else b,
                layernorm_backend="auto" if b in ("auto", "masked-only") else "torch",
                mlm_logits_at_masked_only=b == "masked-only") for b in args.backends}
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=g).to(device)
        am = torch.ones_like(ids)
        am[: args.batch // 2, args.seq * 3 // 4:] = 0
        labels = torch.where(torch.rand(ids.shape, generator=g).to(device) < 0.15, ids, torch.full_like(ids, -100))
        nsl = torch.zeros(args.batch, dtype=torch.long, device=device)

        def hf_step():
            hf.zero_grad(set_to_none=True)
            hf(input_ids=ids, attention_mask=am, labels=labels, next_sentence_label=nsl).loss.backward()

        t_hf = timed(hf_step, args.repeats)
        for backend, model in ours.items():
            def our_step():
                model.zero_grad(set_to_none=True)
                model(ids, attention_mask=am, labels=labels, next_sentence_label=nsl).loss.backward()

            t = timed(our_step, args.repeats)
            resolved = model.ctx.attention_backend + "/" + model.ctx.layernorm_backend
            print(f"{size:6} {backend + ' (' + resolved + ')':18} {t * 1e3:12.1f} {t_hf * 1e3:16.1f} "
                  f"{t_hf / t:8.2f}x")


if __name__ == "__main__":
    main()
