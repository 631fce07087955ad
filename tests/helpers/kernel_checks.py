"""The fused kernels' checks against the PyTorch reference computed in float64: random
cases (seeded) and the comparison of outputs and gradients, used by tests/test_fused_kernels.py
in process and by its instruction-set subprocesses."""
import math

import torch

from megabert.ops import gated_activation, layer_norm, rms_norm, scaled_masked_softmax
from megabert.ops.reference import (gated_activation_reference, layer_norm_reference, rms_norm_reference,
                                    scaled_masked_softmax_reference)

# fp32 kernels against the fp64 oracle: a few ulp of fp32 (the polynomial exp is ~2 ulp).
# bf16: the output is rounded to 8 bits of mantissa.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=4e-3, atol=4e-3), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def fused(t: torch.Tensor, name: str) -> bool:
    return type(t.grad_fn).__name__.startswith(name)


def graph_functions(t: torch.Tensor) -> set:
    """The names of the autograd nodes that produced t (which ops, fused or not, ran)."""
    names, todo, seen = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def softmax_case(shape, mask_shape, dtype, device="cpu", scale=0.37, fully_masked_rows=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = (torch.randn(shape, generator=gen) * 4).to(dtype)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=gen) < 0.3
        if fully_masked_rows and len(mask_shape) > 1 and mask_shape[-2] > 1:
            mask[..., 0, :] = True  # every query 0 sees no key
    grad = torch.randn(shape, generator=gen).to(dtype)
    return scores.to(device), None if mask is None else mask.to(device), scale, grad.to(device)


def check_softmax(scores, mask, scale, grad):
    x = scores.clone().requires_grad_()
    probs = scaled_masked_softmax(x, mask, scale)
    assert fused(probs, "FusedScaledMaskedSoftmax")
    probs.backward(grad)

    x64 = scores.double().requires_grad_()
    ref = scaled_masked_softmax_reference(x64, mask, scale)
    ref.backward(grad.double())

    assert probs.dtype == scores.dtype and probs.shape == scores.shape
    torch.testing.assert_close(probs.double(), ref, **TOL[scores.dtype])
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL[scores.dtype])


def ln_case(shape, dtype, device="cpu", seed=0, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + offset).to(dtype)
    weight = (1 + 0.5 * torch.randn(h, generator=gen)).to(dtype)
    bias = (0.1 * torch.randn(h, generator=gen)).to(dtype)
    grad = torch.randn(shape, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (x, weight, bias, grad))


def check_layer_norm(x, weight, bias, grad, eps=1e-5):
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = layer_norm(*leaves, eps)
    assert fused(y, "FusedLayerNorm")
    y.backward(grad)

    leaves64 = [t.double().requires_grad_() for t in (x, weight, bias)]
    ref = layer_norm_reference(*leaves64, eps)
    ref.backward(grad.double())

    assert y.dtype == x.dtype and y.shape == x.shape
    tol = dict(TOL[x.dtype])
    if x.dtype == torch.float32:  # grad_weight/bias sum over rows: fp32 rounding grows with sqrt(rows)
        tol["atol"] *= math.sqrt(x.numel() / x.size(-1)) * 4
    torch.testing.assert_close(y.double(), ref, **TOL[x.dtype])
    for ours, theirs in zip(leaves, leaves64):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, **tol)


def _check_grads(out, want, leaves, leaves64, grad, sum_rows=0):
    """out (fused) against want (the float64 oracle): values, and the grads of `leaves` against
    those of `leaves64` after one backward of `grad` each. `sum_rows`: the rows a weight's grad
    (leaves after the first) sums over: rounding grows with their square root (in bf16 that of
    the bf16 terms the kernel sums as the chain does, which the fp64 oracle does not round)."""
    dtype = leaves[0].dtype
    out.backward(grad)
    want.backward(grad.double())
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    for i, (ours, theirs) in enumerate(zip(leaves, leaves64)):
        tol = dict(TOL[dtype])
        if i > 0 and dtype != torch.float64:
            tol["atol"] *= math.sqrt(max(sum_rows, 1)) * (4 if dtype == torch.float32 else 1)
        torch.testing.assert_close(ours.grad.double(), theirs.grad, **tol)


def rms_case(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, weight, torch.randn(shape, generator=gen).to(dtype)


def check_rms_norm(x, weight, grad, eps=1e-5):
    """The fused RMSNorm (it must run) against the float64 oracle, output and both grads."""
    leaves = [t.clone().requires_grad_() for t in (x, weight)]
    y = rms_norm(*leaves, eps)
    assert fused(y, "FusedRMSNorm")
    leaves64 = [t.double().requires_grad_() for t in (x, weight)]
    rows = x.numel() // max(x.size(-1), 1)
    _check_grads(y, rms_norm_reference(*leaves64, eps), leaves, leaves64, grad, sum_rows=rows)


def glu_case(shape, dtype, seed=0, scale=3.0):
    """u [..., 2f] spread over the activations' curved range, and a grad [..., f]."""
    gen = torch.Generator().manual_seed(seed)
    u = (torch.randn(shape, generator=gen) * scale).to(dtype)
    return u, torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(dtype)


def check_gated_activation(u, grad, activation, gate_first):
    """The fused gated activation (it must run) against the float64 oracle, output and grad of u.
    On the baseline ISA, where the front end keeps PyTorch's chain, the kernel is called itself."""
    import megabert.fused_kernels as fk
    from megabert.ops.gated_activation import KERNEL_ACTIVATIONS, FusedGatedActivation

    leaf = u.clone().requires_grad_()
    if fk.cpu_isa() == "default":
        assert not fused(gated_activation(leaf, activation, gate_first), "FusedGatedActivation")
        y = FusedGatedActivation.apply(leaf, KERNEL_ACTIVATIONS[activation], gate_first)
    else:
        y = gated_activation(leaf, activation, gate_first)
    assert fused(y, "FusedGatedActivation")
    leaf64 = u.double().requires_grad_()
    _check_grads(y, gated_activation_reference(leaf64, activation, gate_first), [leaf], [leaf64], grad)


# ---- attention over real tokens (varlen) and the Philox masks --------------------------

VARLEN_LENGTHS = [5, 70, 0, 1, 130, 64]  # empty, single-token, partial and whole key tiles of 64


def cu_seqlens(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)


def varlen_attention_reference(qkv, lengths, keep=None, p=0.0):
    """Per sequence in PyTorch: softmax(Q K^T / sqrt(d)), times keep / (1 - p), times V.
    qkv: [T, 3, heads, d]; keep: the kernel's bool mask [sequences, heads, s, s]."""
    outs, start = [], 0
    for i, n in enumerate(lengths):
        q, k, v = (qkv[start:start + n, j].transpose(0, 1) for j in range(3))  # [heads, n, d]
        probs = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(qkv.size(-1)), dim=-1)
        if keep is not None:
            probs = probs * keep[i, :, :n, :n] / (1 - p)
        outs.append((probs @ v).transpose(0, 1))
        start += n
    return torch.cat(outs)


def check_varlen_attention(dtype, p, head_dim=64, lengths=VARLEN_LENGTHS):
    """The varlen kernel's output and packed QKV grad against the reference (fp32 within
    1e-5; with dropout, against the mask the kernel draws)."""
    import megabert.fused_kernels as fk
    from megabert.ops.varlen_attention import FusedVarlenAttention

    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(sum(lengths), 3, 3, head_dim, dtype=dtype, generator=gen).requires_grad_()
    seed = torch.tensor([1234]) if p else None
    cu = cu_seqlens(lengths)
    keep = fk.kernels_for("cpu").varlen_attention_dropout_mask(cu, 3, p, seed) if p else None
    want = varlen_attention_reference(qkv, lengths, keep, p)
    got = FusedVarlenAttention.apply(qkv, cu, 1 / math.sqrt(head_dim), p, seed)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    grad = torch.randn(want.shape, dtype=dtype, generator=gen)
    (want_grad,) = torch.autograd.grad(want, qkv, grad)
    (got_grad,) = torch.autograd.grad(got, qkv, grad)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=tol)


def check_cross_entropy_kernels(widths=(64, 64, 37), rows=9, seed=0):
    """The MLM loss's CPU kernels (fp32) against float64: each row's log-sum-exp over column
    chunks, and one chunk's exp(logits - lse) * g written into a column slice of a wider
    scratch (rows `ld` apart)."""
    from megabert.fused_kernels import _cpu

    g = torch.Generator().manual_seed(seed)
    chunks = [torch.randn(rows, w, generator=g) * 4 for w in widths]
    lse = _cpu.cross_entropy_lse(chunks)
    ref = torch.logsumexp(torch.cat(chunks, 1).double(), 1)
    torch.testing.assert_close(lse.double(), ref, **TOL[torch.float32])
    grads = torch.randn(rows, generator=g)
    scratch = torch.full((rows, max(widths) + 5), float("nan"))
    out = scratch[:, : widths[-1]]
    _cpu.cross_entropy_grad(chunks[-1], lse, grads, out)
    expected = (chunks[-1].double() - ref.unsqueeze(1)).exp() * grads.double().unsqueeze(1)
    torch.testing.assert_close(out.double(), expected, **TOL[torch.float32])
    assert scratch[:, widths[-1]:].isnan().all()  # nothing written past the slice


def fused_dropout_add_with_mask(x: torch.Tensor, residual: torch.Tensor, p: float):
    """(out, keep mask) of the CPU kernel behind `megabert.ops.dropout_add`, with the key that
    dropout_add draws from the default generator at this point (no autograd)."""
    import megabert.fused_kernels as fk
    from megabert.ops.dropout_add import draw_seed

    return fk.kernels_for("cpu").dropout_add_forward(x, residual, float(p), draw_seed())


def philox_mask_digest() -> str:
    """A digest of the masks the kernels draw from Philox for fixed keys (dropout + add and
    attention dropout): equal on every instruction set and thread count."""
    import hashlib

    import megabert.fused_kernels as fk

    torch.manual_seed(5)
    _, add_mask = fused_dropout_add_with_mask(torch.ones(1000, 257), torch.zeros(1000, 257), 0.1)
    attn_mask = fk.kernels_for("cpu").varlen_attention_dropout_mask(cu_seqlens([200, 130, 7]), 2, 0.3,
                                                                    torch.tensor([2**40 + 17]))
    return hashlib.sha256(add_mask.numpy().tobytes() + attn_mask.numpy().tobytes()).hexdigest()[:16]


def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC 2011) in plain Python: the oracle of the kernels'
    vectorised generator. counter: 4 uint32 words; key: 2. -> 4 uint32 words."""
    m0, m1, w0, w1, mask = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = m0 * c0, m1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & mask, (p0 >> 32) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    """The kernels' keep threshold: a word w keeps its element when w >= round(p * 2^32)."""
    return min(int(p * 4294967296.0 + 0.5), 0xFFFFFFFF)


# ---- RoPE with the attention's head layout --------------------------------------------

def rope_case(lead, heads, kv_heads, d, dtype, seed=0, theta=10000.0):
    """Inputs of `megabert.model.rope.attention_input` for leading dims `lead` ([T] or [s, b]):
    (q, kv, cos, sin, grad) with q = qkv [*lead, 3, heads, d] and kv None when kv_heads is None
    (MHA), else q [*lead, heads, d] and kv [*lead, 2, kv_heads, d], each a view of a GEMM-like
    output [*lead, width]; positions as the padded layout counts ([s, b]: the slot in the row)."""
    from megabert.model.rope import cos_sin

    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(lead[0])[:, None].expand(*lead) if len(lead) == 2 else torch.arange(lead[0]) * 7
    cos, sin = (t.unsqueeze(-2) for t in cos_sin(positions, d, theta, dtype))

    def gemm_output(*shape):
        return torch.randn(*lead, math.prod(shape), generator=gen).to(dtype).view(*lead, *shape)

    q = gemm_output(3, heads, d) if kv_heads is None else gemm_output(heads, d)
    kv = None if kv_heads is None else gemm_output(2, kv_heads, d)
    return q, kv, cos, sin, torch.randn(*lead, 3, heads, d, generator=gen).to(dtype)


def check_rope(q, kv, cos, sin, grad):
    """The fused RoPE (it must run) against the PyTorch path (grouped_qkv, rotate_qkv) computed
    in float64 from the same (rounded) tables: output and the grads of q and kv."""
    from megabert.model.rope import attention_input, grouped_qkv, rotate_qkv

    leaves = [t.detach().clone().requires_grad_() for t in (q, kv) if t is not None]
    out = attention_input(leaves[0], leaves[1] if kv is not None else None, cos, sin, "fused")
    assert "FusedRotaryQKVBackward" in graph_functions(out)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    x64 = leaves64[0] if kv is None else grouped_qkv(*leaves64)
    want = rotate_qkv(x64, cos.double(), sin.double())
    # A key/value head's grad sums its group's heads: rounding grows with the group.
    group = 1 if kv is None else q.size(-2) // kv.size(-2)
    _check_grads(out, want, leaves, leaves64, grad, sum_rows=group)
