"""Sliding-window varlen attention (issue 42, part 4): the CPU kernel with a window (left,
right) against an unfused PyTorch reference with a band mask (outputs and the grads of Q, K,
V; dropout against the mask the kernel draws), on sequences that are not whole key tiles,
several per batch; a key outside a query's window changes nothing at that query, bitwise;
the SDPA paths' band; and ModernBERT's local layers on the kernel against the padded
band-masked reference."""
import math

import pytest
import torch

import megabert.fused_kernels as fk
from megabert.ops.varlen_attention import FusedVarlenAttention, band, grouped_sdpa, padded_sdpa, varlen_attention

from tests.helpers.kernel_checks import cu_seqlens

needs_kernels = pytest.mark.skipif(not fk.is_available(), reason="CPU kernels not built")

# Empty, single-token, partial and whole key tiles of 64, and one long enough that a
# (64, 64) window skips tiles on both sides of most query blocks.
LENGTHS = [5, 70, 0, 1, 130, 64, 333]
WINDOWS = [(0, 0), (64, 64), (3, 17), (100, 0), (-1, 5), (-1, -1)]


def reference(qkv, lengths, window, keep=None, p=0.0):
    """Per sequence in PyTorch: softmax of the scaled scores with keys outside the window at
    -inf, times keep / (1 - p), times V. qkv: [T, 3, heads, d]; keep: bool [seqs, heads, s, s]."""
    outs, start = [], 0
    for i, n in enumerate(lengths):
        q, k, v = (qkv[start:start + n, j].transpose(0, 1) for j in range(3))  # [heads, n, d]
        scores = q @ k.transpose(1, 2) / math.sqrt(qkv.size(-1))
        allowed = band(n, window, qkv.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if keep is not None:
            probs = probs * keep[i, :, :n, :n] / (1 - p)
        outs.append((probs @ v).transpose(0, 1))
        start += n
    return torch.cat(outs)


def _kernel(qkv, lengths, window, p=0.0, seed=None):
    return FusedVarlenAttention.apply(qkv, cu_seqlens(lengths), 1 / math.sqrt(qkv.size(-1)), p, seed, *window)


def test_band_is_transformers_sliding_window():
    """(w, w) keeps |i - j| <= w, transformers' sliding_window_bidirectional_overlay; an
    unbounded or wider-than-the-sequence window bounds nothing."""
    i = torch.arange(9)
    assert torch.equal(band(9, (2, 2), "cpu"), (i[:, None] - i[None, :]).abs() <= 2)
    assert torch.equal(band(9, (0, 3), "cpu"), (i[None, :] >= i[:, None]) & (i[None, :] - i[:, None] <= 3))
    assert band(9, (-1, -1), "cpu") is None and band(9, (9, 20), "cpu") is None


@needs_kernels
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_windowed_kernel_matches_band_masked_reference(window, p):
    """fp32 outputs and packed QKV grads within 1e-5 of the band-masked reference; with
    dropout, the reference applies the kernel's own keep mask (the same Philox stream as
    without a window: the keep bit depends only on sequence, head, query and key)."""
    gen = torch.Generator().manual_seed(sum(window) + 7)
    heads, d = 3, 32
    qkv = torch.randn(sum(LENGTHS), 3, heads, d, generator=gen).requires_grad_()
    seed = torch.tensor([4321]) if p else None
    cu = cu_seqlens(LENGTHS)
    keep = fk.kernels_for("cpu").varlen_attention_dropout_mask(cu, heads, p, seed) if p else None
    want = reference(qkv, LENGTHS, window, keep, p)
    got = _kernel(qkv, LENGTHS, window, p, seed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    grad = torch.randn(want.shape, generator=gen)
    (want_grad,) = torch.autograd.grad(want, qkv, grad)
    (got_grad,) = torch.autograd.grad(got, qkv, grad)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-5)


@needs_kernels
def test_window_in_float64_to_rounding():
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(sum(LENGTHS), 3, 2, 80, dtype=torch.float64, generator=gen).requires_grad_()
    got = _kernel(qkv, LENGTHS, (64, 64))
    want = reference(qkv, LENGTHS, (64, 64))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(torch.autograd.grad(got, qkv, grad)[0], torch.autograd.grad(want, qkv, grad)[0],
                               rtol=0, atol=1e-12)


@needs_kernels
def test_unbounded_window_is_the_full_kernel_bitwise():
    """(-1, -1) and a window wider than every sequence run the same sums as the kernel
    without a window argument."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(sum(LENGTHS), 3, 2, 64, generator=gen)
    cu = cu_seqlens(LENGTHS)
    q, k, v = qkv.unbind(1)
    full, _ = fk.kernels_for("cpu").varlen_attention_forward(q, k, v, cu, 0.125, 0.0, None)
    for window in ((-1, -1), (1000, 400)):
        assert torch.equal(_kernel(qkv, LENGTHS, window), full), window


@needs_kernels
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_a_key_outside_the_window_changes_nothing(p):
    """Perturbing token j's Q, K and V leaves the output (and, with the same dropout key,
    the dropped output) bitwise unchanged at every query whose window misses j."""
    gen = torch.Generator().manual_seed(11)
    lengths, window = [300, 200], (64, 64)
    qkv = torch.randn(sum(lengths), 3, 2, 32, generator=gen)
    seed = torch.tensor([77]) if p else None
    before = _kernel(qkv, lengths, window, p, seed)
    j = 150
    perturbed = qkv.clone()
    perturbed[j] += 10 * torch.randn(perturbed[j].shape, generator=gen)
    after = _kernel(perturbed, lengths, window, p, seed)
    far = (torch.arange(sum(lengths)) - j).abs() > 64
    far[300:] = True  # the other sequence sees nothing of the first
    assert far.sum() > 300 and torch.equal(after[far], before[far])
    assert not torch.equal(after[~far], before[~far])


@needs_kernels
def test_front_end_passes_the_window():
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(sum(LENGTHS), 3, 2, 16, generator=gen)
    cu = cu_seqlens(LENGTHS)
    got = varlen_attention(qkv, cu, lambda: cu.tolist(), window=(4, 9))
    torch.testing.assert_close(got, reference(qkv, LENGTHS, (4, 9)), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="window"):
        varlen_attention(qkv, cu, lambda: cu.tolist(), window=(-2, 0))


@pytest.mark.parametrize("window", [(0, 0), (3, 17), (-1, -1)])
def test_sdpa_paths_take_the_band(window):
    """The paths CUDA and other devices run where the kernels do not (padded SDPA with a key
    padding mask, SDPA grouped by length) add the window's band."""
    lengths = [5, 70, 0, 1, 33]
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(sum(lengths), 3, 2, 16, generator=gen)
    cu = cu_seqlens(lengths)
    want = reference(qkv, lengths, window)
    torch.testing.assert_close(padded_sdpa(qkv, cu, max(lengths), 0.0, window), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(grouped_sdpa(qkv, cu.tolist(), 0.0, window), want, rtol=0, atol=1e-5)


@needs_kernels
def test_modernbert_local_layers_on_the_kernel_equal_the_band_masked_reference():
    """ModernBERT with local_attention 128 (window (64, 64)) on rows of up to 300 tokens:
    the unpadded encoder, whose local layers run the windowed kernel, against the padded
    reference backend (explicit scores with the band mask): MLM logits at real tokens and
    every parameter gradient, fp32."""
    import megabert

    def build(backend, unpad):
        cfg = megabert.ModelConfig(model_family="modernbert", num_layers=3, hidden_size=32, num_attention_heads=2,
                                   ffn_hidden_size=48, vocab_size=99, max_position_embeddings=512,
                                   local_attention=128, global_attn_every_n_layers=3, attention_backend=backend,
                                   unpad_input=unpad, init_method_std=0.2)
        return megabert.ModernBertForMaskedLM(cfg, megabert.init_parallel())

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (3, 300), generator=gen)
    am = torch.ones_like(ids)
    am[1, 190:] = 0
    am[2, 70:] = 0
    results, state = [], None
    for backend, unpad in (("torch", False), ("varlen", True)):
        model = build(backend, unpad)
        if state is None:
            state = model.state_dict()
        model.load_state_dict(state)
        model.eval()  # no dropout: both sides compute the same function
        assert [layer.attn.is_global for layer in model.bert.encoder.layers.values()] == [True, False, False]
        logits = model(ids, attention_mask=am).mlm_logits
        logits[am.bool()].square().sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (ref_logits, ref_grads), (logits, grads) = results
    torch.testing.assert_close(logits[am.bool()], ref_logits[am.bool()], rtol=1e-4, atol=1e-4)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-3, atol=1e-3, msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rotate_qkv_equals_rotate_of_q_and_k(dtype):
    """ModernBERT's fused RoPE (one buffer: Q, K rotated, V copied) against `rotate` of Q and
    K and a stack, outputs and the grad of the packed QKV, padded [s, b] and unpadded [T]."""
    from megabert.model.rope import cos_sin, rotate, rotate_qkv

    def rotate_in(x, cos, sin):  # `rotate` (fp32 math), in fp64 for fp64
        if x.dtype != torch.float64:
            return rotate(x, cos, sin)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    gen = torch.Generator().manual_seed(0)
    for lead, positions in (((37,), torch.arange(37)), ((9, 2), torch.arange(9)[:, None].expand(9, 2))):
        x = torch.randn(*lead, 3 * 4 * 16, generator=gen).to(dtype)[..., :3 * 4 * 16].view(*lead, 3, 4, 16)
        cos, sin = (t.unsqueeze(-2) for t in cos_sin(positions, 16, 160.0, dtype))
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        got = rotate_qkv(a, cos, sin)
        q, k, v = b.unbind(-3)
        want = torch.stack((rotate_in(q, cos, sin), rotate_in(k, cos, sin), v), dim=-3)
        tol = {"rtol": 0, "atol": 1e-12 if dtype == torch.float64 else 1e-6 if dtype == torch.float32 else 1e-2}
        torch.testing.assert_close(got, want, **tol)
        grad = torch.randn(want.shape, generator=gen).to(dtype)
        torch.testing.assert_close(torch.autograd.grad(got, a, grad)[0], torch.autograd.grad(want, b, grad)[0], **tol)


@needs_kernels
def test_windowed_dropout_same_at_one_and_two_threads():
    """With a window and dropout, outputs and grads are bitwise equal at any thread count."""
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(sum(LENGTHS), 3, 4, 32, generator=gen).requires_grad_()
    grad = torch.randn(sum(LENGTHS), 4, 32, generator=gen)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = _kernel(qkv, LENGTHS, (64, 64), 0.2, torch.tensor([99]))
            results.append((out, torch.autograd.grad(out, qkv, grad)[0]))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
