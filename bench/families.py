"""Every encoder family's training tokens/s on the CPU: megabert's masked LM of the family
(megabert.AutoModelForMaskedLM) as pretrain_bert.py runs it (default flags: the unpadded
encoder, logits at the masked positions only, the back-ends `auto` picks) against transformers'
AutoModelForMaskedLM of the same directory (sdpa), same weights, same batch, same optimizer
(torch's fused AdamW, clipping at 1.0), both sides' steps interleaved (bench/_timing.py).
One table per family, then a summary; tokens/s counts batch x seq-length. The batch: rows of
random lengths between half and all of --seq, --mask-prob of the real tokens masked.
Nothing here passes or fails on time.

    python bench/families.py [--families eurobert gte nomic_bert ultrabert bert modernbert]
                             [--layers 4 --hidden 256 --heads 4 --seq 512 --batch 2 --rounds 5]
"""
from __future__ import annotations

import argparse
import tempfile

import torch

import megabert
from _timing import interleaved, print_table
from modernbert import step_of

FAMILIES = ("bert", "modernbert", "eurobert", "gte", "nomic_bert", "ultrabert")


def family_dir(family: str, args, path: str) -> str:
    """A randomly initialised transformers masked LM of `family` at the bench's size, saved to `path`."""
    import transformers

    h, n, layers = args.hidden, args.heads, args.layers
    common = dict(vocab_size=args.vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=n,
                  max_position_embeddings=max(args.seq, 512), pad_token_id=0)
    configs = {
        "bert": (transformers.BertConfig, transformers.BertForMaskedLM, dict(intermediate_size=4 * h)),
        "modernbert": (transformers.ModernBertConfig, transformers.ModernBertForMaskedLM,
                       dict(intermediate_size=3 * h // 2)),
        "eurobert": (transformers.EuroBertConfig, transformers.EuroBertForMaskedLM,
                     dict(intermediate_size=4 * h, num_key_value_heads=max(1, n // 2))),
        "gte": (transformers.GteConfig, transformers.GteForMaskedLM, dict(intermediate_size=4 * h, type_vocab_size=1)),
        "nomic_bert": (transformers.NomicBertConfig, transformers.NomicBertForMaskedLM,
                       dict(intermediate_size=4 * h)),
        "ultrabert": (transformers.UltrabertConfig, transformers.UltrabertForMaskedLM,
                      dict(intermediate_size=4 * h, num_key_value_heads=max(1, n // 2), sliding_window=64,
                           prediction_head_size=h)),
    }
    config_class, model_class, extra = configs[family]
    torch.manual_seed(0)
    model_class(config_class(**common, **extra)).save_pretrained(path)
    return path


def batch(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, args.vocab, (args.batch, args.seq), generator=gen)
    lengths = torch.randint(args.seq // 2, args.seq + 1, (args.batch,), generator=gen)
    am = (torch.arange(args.seq)[None] < lengths[:, None]).long()
    masked = (torch.rand(ids.shape, generator=gen) < args.mask_prob) & (am == 1)
    return {"input_ids": ids * am, "attention_mask": am, "labels": torch.where(masked, ids, torch.full_like(ids, -100))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--mask-prob", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    import transformers

    ps = megabert.init_parallel()
    b = batch(args)
    summary = {}
    for family in args.families:
        with tempfile.TemporaryDirectory() as d:
            family_dir(family, args, d)
            # pretrain_bert.py's defaults (megabert.arguments.PRETRAIN_DEFAULTS), the library's otherwise
            ours = megabert.AutoModelForMaskedLM.from_pretrained(d, ps, unpad_input=True, mlm_logits_at_masked_only=True,
                                                                 hidden_dropout=0.0, attention_dropout=0.0)
            theirs = transformers.AutoModelForMaskedLM.from_pretrained(d, attn_implementation="sdpa")
        theirs.config.hidden_dropout_prob = 0.0
        medians = interleaved({"megabert": step_of(ours, b, lambda m, x: m(**x).loss),
                               "transformers": step_of(theirs, b, lambda m, x: m(**x).loss)}, args.rounds)
        print(f"\n{family}: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
              f"{torch.get_num_threads()} threads: training step (forward, backward, AdamW)")
        print_table(medians, {"megabert": f"attention {ours.ctx.attention_backend}", "transformers": "sdpa"},
                    args.batch * args.seq, "transformers")
        summary[family] = medians["transformers"] / medians["megabert"]
    print("\nmegabert / transformers tokens/s: " + ", ".join(f"{f} {r:.2f}x" for f, r in summary.items()))


if __name__ == "__main__":
    main()
