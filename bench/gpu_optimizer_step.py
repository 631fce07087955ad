"""The optimizer's part of a BERT-large step on one GPU, piece by piece (issue 41). Written
when the kernel breakdown counted 12-18 ms of "optimizer" kernels per step on an H200, megabert
and transformers alike, where fused AdamW's memory traffic is ~2 ms; most of that was a
mislabel (bench/_kernel_breakdown.py took every elementwise kernel named after a C++ lambda
for LAMB's), so this bench now gives the optimizer's true part of the step, each piece against
what its memory traffic allows.

BERT-large's parameters (megabert's model, fp32 masters) with random gradients; each piece
timed alone with CUDA events over --reps calls after a warm-up, and set against its memory
traffic at the device's measured copy bandwidth (a device-to-device copy of 1 GB, timed in the
same run: the peer):

  grad_norm        megabert's global norm (torch._foreach_norm of every gradient)
  fused AdamW      torch.optim.AdamW(fused=True).step(), unclipped
  guarded step     megabert's step as LocalStrategy runs it: clip coefficient folded into fused
                   AdamW's grad_scale, non-finite skip on the device (found_inf)
  gemm copies      --bf16's MasterWeights refresh (one multi-tensor fp32 -> bf16 copy)
  foreach AdamW    torch.optim.AdamW(foreach=True).step(): the per-op path, for comparison
  clip_grad_norm_  torch.nn.utils.clip_grad_norm_ (transformers' Trainer clips with it)
  fused AdamW, flat
                   the same fused kernel on one flat tensor of every parameter (and one of
                   every gradient): does the per-tensor chunking cost the time?
  compiled AdamW, flat
                   the AdamW update as one torch.compile'd (Triton) elementwise kernel over the
                   flat tensors, a grid over every element: what the memory allows

Then the kernels torch.profiler sees in one guarded step plus one gemm-copies refresh, by name.
Figures, never asserts.

    python bench/gpu_optimizer_step.py [--reps 10] [--preset bert-large]
"""
from __future__ import annotations

import argparse
import sys

import torch

import megabert
from megabert.arguments import parse_args
from megabert.optim import build_optimizer
from megabert.optim.clip import guarded_step
from megabert.tasks.pretraining import BertForPreTraining
from megabert.training.grads import grad_norm
from megabert.training.precision import MasterWeights


def timed(fn, reps: int) -> float:
    """Milliseconds per call, CUDA events around `reps` calls after two untimed ones."""
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """Bytes/s read + written by a device-to-device copy of 1 GiB."""
    big = torch.empty(2 ** 28, device=device)
    return 2 * big.numel() * 4 / (timed(big.clone, reps) / 1e3)


def adamw_flat(p, g, m, v, lr: float, beta1: float, beta2: float, eps: float, wd: float, c1: float, c2: float):
    """One AdamW step in place on flat fp32 tensors (c1, c2: the bias corrections)."""
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p.mul_(1 - lr * wd).addcdiv_(m, (v / c2).sqrt_().add_(eps), value=-lr / c1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--preset", default="bert-large", choices=("bert-base", "bert-large"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_optimizer_step.py needs a CUDA GPU")
    ps = megabert.init_parallel()
    cfg = parse_args(["--preset", args.preset, "--bf16", "--data-path", "unused"])  # vocab 30522, padded
    model = BertForPreTraining(cfg.model, ps, seed=1)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    gen = torch.Generator(device=ps.device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, device=p.device, generator=gen) * 1e-3
    optimizer = build_optimizer(model, cfg.optim, ps.tp_group)
    masters = MasterWeights(model).attach(optimizer)
    foreach = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
    fused = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)

    bandwidth = copy_bandwidth(ps.device, args.reps)
    fp32 = 4 * n
    flat_p = torch.cat([p.detach().reshape(-1) for p in params])
    flat_g = torch.cat([p.grad.reshape(-1) for p in params])
    flat_m, flat_v = torch.zeros_like(flat_p), torch.zeros_like(flat_p)
    leaf = torch.nn.Parameter(flat_p.clone())
    leaf.grad = flat_g
    fused_flat = torch.optim.AdamW([leaf], lr=1e-4, weight_decay=0.01, fused=True)
    compiled = torch.compile(adamw_flat)
    pieces = [
        ("grad_norm", lambda: grad_norm(params, ps), fp32),
        ("fused AdamW", fused.step, 7 * fp32),  # reads p, g, m, v; writes p, m, v
        ("guarded step", lambda: guarded_step(optimizer, params, cfg.optim.clip_grad, grad_norm(params, ps)),
         8 * fp32),
        ("gemm copies", masters.refresh, fp32 + 2 * sum(w.numel() for w in masters.masters)),
        ("foreach AdamW", foreach.step, None),
        ("clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), 3 * fp32),
        ("fused AdamW, flat", fused_flat.step, 7 * fp32),
        ("compiled AdamW, flat", lambda: compiled(flat_p, flat_g, flat_m, flat_v, 1e-4, 0.9, 0.999, 1e-8, 0.01,
                                                  0.1, 0.001), 7 * fp32),
    ]
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | {args.preset}: {n / 1e6:.1f}M "
          f"parameters in {len(params)} tensors | copy bandwidth {bandwidth / 1e9:.0f} GB/s (the peer)")
    print(f"{'piece':18} {'ms':>8} {'GB moved':>9} {'at copy bw':>11} {'share of bw':>12}")
    for name, fn, moved in pieces:
        ms = timed(fn, args.reps)
        bound = moved / bandwidth * 1e3 if moved else None
        print(f"{name:18} {ms:8.2f} {moved / 1e9 if moved else float('nan'):9.2f} "
              f"{bound if bound else float('nan'):11.2f} {bound / ms if bound else float('nan'):12.1%}")

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        guarded_step(optimizer, params, cfg.optim.clip_grad, grad_norm(params, ps))
        masters.refresh()
        torch.cuda.synchronize()
    print("kernels of one guarded step + gemm copies:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=90))


if __name__ == "__main__":
    main()
