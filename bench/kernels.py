"""Forward + backward time of megabert's fused kernels (softmax, norms, GLU, dropout + add, attention) against PyTorch.

Prints figures and never asserts on them. For each BERT-like shape: our kernel through
`megabert.ops` (autograd included), the unfused reference (`megabert.ops.reference`,
what `--attention-backend torch` / `--layernorm-backend torch` run) and, for the
softmax, plain `torch.softmax` on `masked_fill`; for dropout + residual add (CPU only, p 0.1,
what `--dropout-add-backend fused` / `torch` run) `residual + F.dropout(x, p)`; for attention
(CPU only, dropout 0.1) the varlen kernel on the real tokens against the padded reference
(`--attention-backend torch`) and the padded fused softmax (`--attention-backend fused`) on
[b, heads, s, s]; for RMSNorm and the gated MLP's act(input) * gate (CPU only: SwiGLU,
GeGLU) PyTorch's op chains (`megabert.ops.reference`, what `--layernorm-backend torch` /
`--dropout-add-backend torch` run); for RoPE with the attention's (grouped-query) head layout
PyTorch's repeat, cat and rotation (`--dropout-add-backend torch`). "x" is their time over
ours: above 1, the fused kernel is faster. On a GPU it also prints the achieved bandwidth of our
forward and backward kernels against the device's peak DRAM bandwidth.

    python bench/kernels.py                      # CPU, all threads torch uses
    python bench/kernels.py --device cuda --dtype bfloat16 float16
    python bench/kernels.py --ops dropadd --dtype float32
    MEGABERT_CPU_ISA=default python bench/kernels.py --ops attention   # another ISA's kernels
    python bench/kernels.py --ops rmsnorm swiglu geglu --threads 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import megabert.fused_kernels as fk
from megabert import ops
from megabert.ops.reference import (gated_activation_reference, layer_norm_reference, rms_norm_reference,
                                    scaled_masked_softmax_reference)

# [b, heads, sq, sk]: BERT-base at seq 128 and BERT-large at seq 512, micro-batch 8.
SOFTMAX_SHAPES = [(8, 12, 128, 128), (8, 16, 512, 512)]
# [s * b, h]: the same two models' LayerNorm inputs.
LAYER_NORM_SHAPES = [(128 * 8, 768), (512 * 8, 1024)]
# [s * b, h] of RMSNorm: the LayerNorm shapes, then bench/families.py's (4 layers, hidden 256, seq 512,
# ~764 real tokens a micro-batch unpadded).
RMS_NORM_SHAPES = LAYER_NORM_SHAPES + [(764, 256)]
# [tokens, 2f] of the gated MLP's up-projection output: bench/families.py's (ffn 1024), then
# BERT-base's width (f 3072) at seq 128, micro-batch 8.
GLU_SHAPES = [(764, 2048), (128 * 8, 2 * 3072)]
# [tokens, heads, kv heads, head_dim] of RoPE with the attention's head layout: bench/families.py's
# MHA families (4 heads of 64, ~764 real tokens a micro-batch), EuroBERT's grouped-query 4/2 there,
# then BERT-base's heads at seq 512, micro-batch 8.
ROPE_SHAPES = [(764, 4, 4, 64), (764, 4, 2, 64), (512 * 8, 12, 12, 64)]
# [tokens, h] of the layers' hidden dropout + residual add: bench/pretrain.py's default
# model (seq 128, batch 16, ~60% real tokens unpadded, h 256), then the two above.
DROPOUT_ADD_SHAPES = [(1237, 256), (128 * 8, 768), (512 * 8, 1024)]
# [b, heads, s, head_dim, real-token share] of attention: bench/pretrain.py's model at seq 128
# (stdlib corpus) and seq 512 (long corpus), then BERT-large at seq 512 (micro-batch 8, 90% real).
ATTENTION_SHAPES = [(16, 4, 128, 64, 0.6), (4, 4, 512, 64, 0.95), (8, 16, 512, 64, 0.9)]


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds one call of fn takes (CUDA: between events on the current stream)."""
    if device.type == "cuda":
        def cuda_time(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return cuda_time

    def cpu_time(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return cpu_time


def median_times(fns: dict[str, Callable[[], object]], device: torch.device, reps: int,
                 min_seconds: float = 1.0) -> dict[str, float]:
    """Median seconds per call of each fn over at least `reps` calls and `min_seconds`.
    The calls interleave so that a machine whose load changes during the run (a shared
    CI box) weighs on every fn alike."""
    timer = _timer(device)
    for fn in fns.values():  # warm-up: allocator, thread pool, lazy CUDA init
        fn(), fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    while len(samples[next(iter(fns))]) < reps or (time.perf_counter() - start < min_seconds
                                                   and len(samples[next(iter(fns))]) < 100 * reps):
        for name, fn in fns.items():
            samples[name].append(timer(fn))
    return {name: statistics.median(ts) for name, ts in samples.items()}


def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], grad: torch.Tensor, *args):
    """A closure that runs fn forward and backward to every input (no .grad accumulation)."""
    def run():
        out = fn(*inputs, *args)
        return torch.autograd.grad(out, inputs, grad)
    return run


def softmax_case(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    b, _, _, sk = shape
    scores = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    lengths = torch.randint(sk // 2, sk + 1, (b,), generator=gen)
    mask = (torch.arange(sk)[None, :] >= lengths[:, None])[:, None, None, :].to(device)  # [b, 1, 1, sk] padding
    grad = torch.randn(shape, generator=gen).to(device, dtype)
    scale = shape[-1] ** -0.5

    def masked_fill_softmax(x, m, s):
        return torch.softmax((x * s).masked_fill(m, float("-inf")), dim=-1)

    fns = {"ours": fwd_bwd(ops.scaled_masked_softmax, (scores,), grad, mask, scale),
           "reference": fwd_bwd(scaled_masked_softmax_reference, (scores,), grad, mask, scale),
           "softmax(masked_fill)": fwd_bwd(masked_fill_softmax, (scores,), grad, mask, scale)}
    return fns, (scores, mask, scale, grad)


def layer_norm_case(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    h = shape[-1]
    x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).to(device, dtype).requires_grad_()
    bias = (0.1 * torch.randn(h, generator=gen)).to(device, dtype).requires_grad_()
    grad = torch.randn(shape, generator=gen).to(device, dtype)
    fns = {"ours": fwd_bwd(ops.layer_norm, (x, weight, bias), grad, 1e-12),
           "reference": fwd_bwd(layer_norm_reference, (x, weight, bias), grad, 1e-12)}
    return fns, (x, weight, bias, grad)


def rms_norm_case(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, dtype).requires_grad_()
    grad = torch.randn(shape, generator=gen).to(device, dtype)
    fns = {"ours": fwd_bwd(ops.rms_norm, (x, weight), grad, 1e-6),
           "reference": fwd_bwd(rms_norm_reference, (x, weight), grad, 1e-6)}
    return fns, (x, weight, grad)


def gated_case(activation: str):
    def case(shape, dtype, device):
        gen = torch.Generator().manual_seed(0)
        u = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
        grad = torch.randn(shape[0], shape[1] // 2, generator=gen).to(device, dtype)
        fns = {"ours": fwd_bwd(ops.gated_activation, (u,), grad, activation, False),
               "reference": fwd_bwd(gated_activation_reference, (u,), grad, activation, False)}
        return fns, (u, grad)
    return case


def rope_case(shape, dtype, device):
    """The attention's input from the QKV GEMM's output (MHA) or the Q and KV GEMMs' (GQA): the
    kernel against PyTorch's repeat_interleave, cat and rotation (--dropout-add-backend torch)."""
    from megabert.model.rope import attention_input, cos_sin

    tokens, heads, kv_heads, d = shape
    gen = torch.Generator().manual_seed(0)
    cos, sin = (t.unsqueeze(-2).to(device) for t in cos_sin(torch.arange(tokens) % 512, d, 10000.0, dtype))
    grad = torch.randn(tokens, 3, heads, d, generator=gen).to(device, dtype)
    if kv_heads == heads:
        inputs = (torch.randn(tokens, 3, heads, d, generator=gen).to(device, dtype).requires_grad_(),)
    else:
        inputs = (torch.randn(tokens, heads, d, generator=gen).to(device, dtype).requires_grad_(),
                  torch.randn(tokens, 2, kv_heads, d, generator=gen).to(device, dtype).requires_grad_())

    def run(backend):
        return fwd_bwd(lambda *x: attention_input(x[0], x[1] if len(x) > 1 else None, cos, sin, backend), inputs,
                       grad)

    return {"ours": run("fused"), "reference": run("torch")}, inputs


def dropout_add_case(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    residual = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(shape, generator=gen).to(device, dtype)

    def unfused(x, residual):
        return residual + F.dropout(x, 0.1, True)

    fns = {"ours": fwd_bwd(ops.dropout_add, (x, residual), grad, 0.1, True),
           "reference": fwd_bwd(unfused, (x, residual), grad)}
    return fns, (x, residual, grad)


def attention_case(shape, dtype, device):
    b, heads, s, d, real = shape
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(int(2 * real * s) - s, s + 1, (b,), generator=gen).clamp(1, s)
    mask = torch.arange(s)[None, :] >= lengths[:, None]  # [b, s], True = padding
    qkv = torch.randn(b, s, 3, heads, d, generator=gen).to(device, dtype)
    q, k, v = (t.permute(0, 2, 1, 3).contiguous().requires_grad_() for t in qkv.unbind(2))  # [b, heads, s, d]
    grad = torch.randn(b, heads, s, d, generator=gen).to(device, dtype)
    real_qkv = qkv[~mask].contiguous().requires_grad_()  # [T, 3, heads, d]
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    real_grad = grad.permute(0, 2, 1, 3)[~mask].contiguous()

    def padded(backend):
        def core(q, k, v):
            return ops.core_attention(q, k, v, mask[:, None, None, :], backend=backend, dropout_p=0.1)
        return fwd_bwd(core, (q, k, v), grad)

    def varlen(x):
        return ops.varlen_attention(x, cu, cu.tolist, dropout_p=0.1)

    fns = {"ours": fwd_bwd(varlen, (real_qkv,), real_grad), "reference": padded("torch"),
           "fused softmax": padded("fused")}
    return fns, ()


def kernel_bandwidth(op: str, tensors, device: torch.device, reps: int) -> str:
    """Achieved GB/s of our forward and backward kernels alone (the bytes each must move
    at the least) and their share of the device's peak DRAM bandwidth."""
    kernels = fk.kernels_for(device.type)
    if op != "softmax":  # the one CUDA kernel
        raise ValueError(f"no CUDA kernel for {op}")
    scores, mask, scale, grad = (t.detach() if isinstance(t, torch.Tensor) else t for t in tensors)
    mask = mask.expand(scores.shape)
    probs = kernels.scaled_masked_softmax_forward(scores, mask, scale)
    nbytes = scores.numel() * scores.element_size()
    fns = {"fwd": lambda: kernels.scaled_masked_softmax_forward(scores, mask, scale),
           "bwd": lambda: kernels.scaled_masked_softmax_backward(grad, probs, scale)}
    moved = {"fwd": 2 * nbytes, "bwd": 3 * nbytes}  # x -> y; grad_y, y -> grad_x (the mask is tiny)
    times = median_times(fns, device, reps)
    peak = kernels.memory_bandwidth_gbs(device.index or 0)
    parts = []
    for name, seconds in times.items():
        gbs = moved[name] / seconds / 1e9
        parts.append(f"{name} {gbs:7.0f} GB/s ({100 * gbs / peak:3.0f}%)")
    return "  ".join(parts) + f"  of {peak:.0f} GB/s peak"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--ops", nargs="+", default=["softmax", "layernorm", "rmsnorm", "swiglu", "geglu", "rope",
                                                     "dropadd", "attention"],
                        choices=["softmax", "layernorm", "rmsnorm", "swiglu", "geglu", "rope", "dropadd",
                                 "attention"],
                        help="which ops to time (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per case (default: 15 CPU, 100 GPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    reps = args.reps or (100 if device.type == "cuda" else 15)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not fk.is_available(device.type):
        print(f"no megabert kernels for {device.type}: {fk.load_error(device.type)}; nothing to compare")
        return
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:  # other processes on the cores make threads wait at every barrier: say how busy the box is
        where = (f"{torch.get_num_threads()} threads of {os.cpu_count()} cores, "
                 f"load average {os.getloadavg()[0]:.1f}")
    print(f"{fk.describe(device.type)} on {where}; median of >= {reps} forward+backward runs; "
          f"x = their time / ours (> 1: ours faster)")
    printed_for = None
    cases = [("softmax", SOFTMAX_SHAPES, softmax_case)]
    if device.type == "cpu":
        # No CUDA kernels for these: PyTorch's dropout is one fused kernel there, and our CUDA
        # LayerNorm lost to PyTorch's (0.70-0.73x) and was deleted (docs/performance.md).
        cases += [("layernorm", LAYER_NORM_SHAPES, layer_norm_case), ("rmsnorm", RMS_NORM_SHAPES, rms_norm_case),
                  ("swiglu", GLU_SHAPES, gated_case("silu")), ("geglu", GLU_SHAPES, gated_case("gelu")),
                  ("rope", ROPE_SHAPES, rope_case), ("dropadd", DROPOUT_ADD_SHAPES, dropout_add_case)]
        cases.append(("attention", ATTENTION_SHAPES, attention_case))
    for op, shapes, build in (c for c in cases if c[0] in args.ops):
        for shape in shapes:
            for dtype_name in args.dtype:
                fns, tensors = build(shape, getattr(torch, dtype_name), device)
                times = median_times(fns, device, reps)
                ours = times.pop("ours")
                if printed_for != list(times):  # the peers' names head their columns
                    printed_for = list(times)
                    print(f"{'op':<10}{'shape':<20}{'dtype':<10}{'ours ms':>9}"
                          + "".join(f"{n + ' ms':>20}" if i == 0 else f"{n + ' ms':>28}" for i, n in enumerate(times)))
                cells = [f"{t * 1e3:9.2f} ({t / ours:5.2f}x)" for t in times.values()]
                line = f"{op:<10}{str(list(shape)).replace(' ', '')[:19]:<20}{dtype_name:<10}{ours * 1e3:9.2f}"
                line += "".join(f"{c:>20}" if i == 0 else f"{c:>28}" for i, c in enumerate(cells))
                print(line, flush=True)
                if device.type == "cuda":
                    print(f"{'':<40}{kernel_bandwidth(op, tensors, device, reps)}", flush=True)
                del fns, tensors


if __name__ == "__main__":
    main()
