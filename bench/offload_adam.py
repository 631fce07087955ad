"""ZeRO-Offload's CPU step: torch's fused AdamW (what megabert steps the offloaded partitions
with) against DeepSpeedCPUAdam (DeepSpeed's vectorised CPU Adam, a JIT-built op), interleaved.

Each side steps its own copy of the same fp32 parameters and gradients: BERT-base's and
BERT-large's parameter counts as one flat partition (ZeRO's layout on one rank), AdamW with
weight decay. The figure per side is the median step time; "x" is DeepSpeedCPUAdam's time
over torch's (above 1, torch is faster). The first DeepSpeedCPUAdam of a machine compiles
the op (a minute or more, cached afterwards); that build is not timed. Nothing here passes
or fails on time; the last line gives the largest difference between the two sides'
parameters after the timed steps (the same update, rounded differently).

    python bench/offload_adam.py                 # the threads torch uses
    python bench/offload_adam.py --threads 2 --rounds 9
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import megabert.fused_kernels as fk

SIZES = {"bert-base": 110_000_000, "bert-large": 335_000_000}


def _partition(numel: int, seed: int) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(numel, generator=g))
    p.grad = torch.randn(numel, generator=g).mul_(1e-3)
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=7, help="timed steps per side (after one untimed)")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # imports DeepSpeed: after the thread count

    print(f"CPU {fk.cpu_isa() if fk.is_available() else 'unknown ISA'} | torch {torch.__version__} | "
          f"{args.threads} threads | fp32 AdamW (lr 1e-4, weight decay 0.01) | median of {args.rounds} "
          f"interleaved steps")
    print(f"{'partition':<12}{'params':>8}{'torch fused ms':>16}{'DeepSpeedCPUAdam ms':>21}{'x':>8}")
    for name in args.sizes:
        numel = SIZES[name]
        ours, theirs = _partition(numel, 0), _partition(numel, 0)
        sides = {"torch": torch.optim.AdamW([ours], lr=1e-4, weight_decay=0.01, fused=True),
                 "deepspeed": DeepSpeedCPUAdam([theirs], lr=1e-4, weight_decay=0.01, adamw_mode=True)}
        for opt in sides.values():
            opt.step()  # state allocation (and DeepSpeed's JIT build) untimed
        times = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, opt in sides.items():
                t0 = time.perf_counter()
                opt.step()
                times[side].append(time.perf_counter() - t0)
        t, d = (statistics.median(times[s]) * 1e3 for s in ("torch", "deepspeed"))
        diff = (ours.detach() - theirs.detach()).abs().max().item()
        print(f"{name:<12}{numel / 1e6:>7.0f}M{t:>16.1f}{d:>21.1f}{d / t:>7.2f}x   max |diff| {diff:.1e}")
        del ours, theirs, sides
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
