"""Attention over real tokens (varlen, issue 31): the CPU kernel against PyTorch per
sequence (outputs and the grads of Q, K, V; dropout against the mask the kernel draws), the
same masks at any thread count, the CUDA path's choice, and the model with the varlen core
against the padded reference (`--attention-backend torch`) in every layout."""
import math

import pytest
import torch

import megabert
import megabert.fused_kernels as fk
from megabert.config import ModelConfig
from megabert.ops import resolve_attention_backend
from megabert.ops.varlen_attention import choose_varlen_impl, grouped_sdpa, padded_sdpa, varlen_attention

from tests.helpers.dist_utils import run_distributed
from tests.helpers.kernel_checks import (VARLEN_LENGTHS, check_varlen_attention, cu_seqlens, philox4x32_10,
                                         threshold, varlen_attention_reference)
from tests.helpers.train_utils import batches, build_trainer, step_loss

needs_kernels = pytest.mark.skipif(not fk.is_available(), reason="CPU kernels not built")


def _fused(qkv, lengths, p, seed):
    from megabert.ops.varlen_attention import FusedVarlenAttention

    return FusedVarlenAttention.apply(qkv, cu_seqlens(lengths), 1 / math.sqrt(qkv.size(-1)), p, seed)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 64, 80])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_kernel_matches_pytorch_per_sequence(dtype, head_dim, p):
    """Outputs and grads of Q, K, V (one packed grad) within 1e-5 in fp32; with dropout,
    against PyTorch with the kernel's own mask (varlen_attention_dropout_mask)."""
    check_varlen_attention(dtype, p, head_dim)


@needs_kernels
def test_dropout_mask_is_philox_of_sequence_head_row_key():
    """The keep bit of (sequence, head, query i, key j) is word (j % 64) // 16 of Philox4x32-10
    at counter ((j // 64) * 16 + j % 16, i, sequence * heads + head, 0x61747431) under the
    call's key, kept when >= round(p * 2^32): the layout attention_kernels.h documents."""
    lengths, heads, p, seed = [70, 3], 2, 0.3, 2**33 + 5
    mask = fk.kernels_for("cpu").varlen_attention_dropout_mask(cu_seqlens(lengths), heads, p, torch.tensor([seed]))
    key, words = (seed & 0xFFFFFFFF, seed >> 32), {}
    for s, n in enumerate(lengths):
        want = torch.zeros(heads, max(lengths), max(lengths), dtype=torch.bool)
        for h in range(heads):
            for i in range(n):
                for j in range(n):
                    c = ((j // 64) * 16 + j % 16, i, s * heads + h, 0x61747431)
                    if c not in words:
                        words[c] = philox4x32_10(c, key)
                    want[h, i, j] = words[c][(j % 64) // 16] >= threshold(p)
        assert torch.equal(mask[s], want), s


@needs_kernels
def test_bfloat16_within_its_tolerance():
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(VARLEN_LENGTHS), 3, 2, 64, generator=gen)
    want = varlen_attention_reference(qkv, VARLEN_LENGTHS)
    got = _fused(qkv.bfloat16(), VARLEN_LENGTHS, 0.0, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@needs_kernels
def test_dropout_mask_keeps_one_minus_p_and_follows_the_seed():
    cu = cu_seqlens([200, 130])
    masks = [fk.kernels_for("cpu").varlen_attention_dropout_mask(cu, 2, 0.1, torch.tensor([s])) for s in (1, 1, 2)]
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])
    real = masks[0][0].float()  # sequence 0 fills its [200, 200] block
    assert abs(real.mean().item() - 0.9) < 0.005
    assert not masks[0][1, :, 130:].any() and not masks[0][1, :, :, 130:].any()  # nothing outside sequence 1


@needs_kernels
def test_same_masks_at_one_and_two_threads():
    """Dropout on: outputs and grads bitwise equal whatever the thread count (the Philox
    counter is (sequence, head, row, column), never the thread)."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(sum(VARLEN_LENGTHS), 3, 4, 32, generator=gen).requires_grad_()
    grad = torch.randn(sum(VARLEN_LENGTHS), 4, 32, generator=gen)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = _fused(qkv, VARLEN_LENGTHS, 0.2, torch.tensor([99]))
            results.append((out, torch.autograd.grad(out, qkv, grad)[0]))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@needs_kernels
def test_front_end_draws_its_key_from_the_stream_it_runs_in():
    """One key per call from the default generator (the TP-rank stream under rng_fork): the
    same seed gives the same output, and the draw advances the generator by one int64."""
    qkv = torch.randn(sum(VARLEN_LENGTHS), 3, 2, 16)
    cu = cu_seqlens(VARLEN_LENGTHS)
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        outs.append(varlen_attention(qkv, cu, cu.tolist, dropout_p=0.1))
        after = torch.randint(0, 2**62, (1,))
    torch.manual_seed(3)
    torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64)  # the key draw
    assert torch.equal(outs[0], outs[1]) and torch.equal(after, torch.randint(0, 2**62, (1,)))
    torch.testing.assert_close(varlen_attention(qkv, cu, cu.tolist, dropout_p=0.0),
                               varlen_attention_reference(qkv, VARLEN_LENGTHS))


def test_grouped_sdpa_matches_pytorch_per_sequence():
    """The CUDA fallback (and any dtype the CPU kernel lacks): SDPA per length group."""
    lengths = [7, 3, 7, 0, 3, 5]
    qkv = torch.randn(sum(lengths), 3, 2, 8, dtype=torch.float64, requires_grad=True)
    want = varlen_attention_reference(qkv, lengths)
    got = grouped_sdpa(qkv, cu_seqlens(lengths).tolist(), 0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, qkv, grad)[0], torch.autograd.grad(want, qkv, grad)[0],
                               rtol=0, atol=1e-12)
    # float16 on the CPU is outside the kernel: grouped SDPA, same numbers to fp16 rounding.
    half = varlen_attention(qkv.detach().half(), cu_seqlens(lengths), cu_seqlens(lengths).tolist)
    torch.testing.assert_close(half.double(), want.detach(), rtol=0, atol=5e-3)


def test_cuda_choice_flash_where_it_applies_else_padded_sdpa():
    bf16, f32 = torch.bfloat16, torch.float32
    assert choose_varlen_impl("cuda", bf16, 64, None, True) == ("flash", None)  # with or without dropout
    assert choose_varlen_impl("cuda", torch.float16, 128, None, True) == ("flash", None)
    for args, why in [((f32, 64), "float32"), ((bf16, 60), "head dim 60"), ((bf16, 320), "head dim 320")]:
        impl, reason = choose_varlen_impl("cuda", *args, None, True)
        assert impl == "padded" and why in reason
    impl, reason = choose_varlen_impl("cuda", bf16, 64, None, False)
    assert impl == "padded" and "FlashAttention" in reason
    assert choose_varlen_impl("cpu", f32, 64, None, True) == ("fused", None)
    assert choose_varlen_impl("cpu", torch.float16, 64, "float16", True) == ("grouped_sdpa", "float16")


def test_padded_sdpa_matches_pytorch_per_sequence():
    """CUDA's route where FlashAttention does not apply (fp32): one padded SDPA call with a key
    padding mask; output and the grad of the packed QKV equal PyTorch per sequence (fp64,
    an empty sequence included)."""
    torch.manual_seed(0)
    qkv = torch.randn(sum(VARLEN_LENGTHS), 3, 2, 16, dtype=torch.float64, requires_grad=True)
    want = varlen_attention_reference(qkv, VARLEN_LENGTHS)
    grad = torch.randn_like(want)
    want_grad = torch.autograd.grad(want, qkv, grad)[0]
    # The lengths' maximum, or any bound above it (an unpadded batch hands its padded length:
    # TokenLayout.max_seqlen, so nothing is read back from the device).
    for max_len in (max(VARLEN_LENGTHS), max(VARLEN_LENGTHS) + 5):
        got = padded_sdpa(qkv, cu_seqlens(VARLEN_LENGTHS), max_len, 0.0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(torch.autograd.grad(got, qkv, grad)[0], want_grad, rtol=0, atol=1e-12)


@pytest.mark.skipif(not fk.is_available() or fk.is_available("cuda"), reason="needs a CPU-only build")
def test_backend_resolution(monkeypatch):
    monkeypatch.setattr(fk, "_cpu_isa", "avx2")
    assert resolve_attention_backend("auto", "cpu") == "varlen"
    monkeypatch.setattr(fk, "_cpu_isa", "default")  # the baseline build: not measured to win at seq 512
    assert resolve_attention_backend("auto", "cpu") == "fused"
    assert resolve_attention_backend("varlen", "cpu") == "varlen"
    assert resolve_attention_backend("auto", "cuda", 64) == "sdpa"  # no FlashAttention without a GPU
    assert resolve_attention_backend("varlen", "cuda") == "varlen"


# ---------------------------------------------------------------- the model

def _cfg(**kw):
    return ModelConfig(**{"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 99,
                          "max_position_embeddings": 32, "hidden_dropout": 0, "attention_dropout": 0,
                          "layernorm_backend": "torch", **kw})


def _loss_and_grads(cfg, ps, dtype=torch.float32):
    model = megabert.BertForPreTraining(cfg, ps, seed=5, params_dtype=dtype).to(ps.device).train()
    b = {k: v.to(ps.device) for k, v in next(batches(0, 4, 0, 1)).items()}
    o = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["labels"], b["next_sentence_label"])
    o.loss.backward()
    return o.loss.detach().float(), o.nsp_logits.detach().float(), {n: p.grad.float() for n, p in
                                                                      model.named_parameters()}


@needs_kernels
@pytest.mark.parametrize("layernorm_position,recompute", [("post", None), ("pre", "full"), ("post", "selective")])
def test_varlen_model_equals_padded_reference(layernorm_position, recompute):
    """fp32, dropout 0: loss, sentence-pair logits and every gradient of the unpadded encoder
    with the varlen core equal the padded encoder's with the reference attention."""
    ps = megabert.init_parallel()
    kw = dict(layernorm_position=layernorm_position, recompute_granularity=recompute)
    loss0, nsp0, g0 = _loss_and_grads(_cfg(attention_backend="torch", **kw), ps)
    loss1, nsp1, g1 = _loss_and_grads(_cfg(attention_backend="varlen", unpad_input=True, **kw), ps)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-5)
    torch.testing.assert_close(nsp1, nsp0, rtol=0, atol=1e-5)
    assert g0 and set(g1) == set(g0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-5, msg=name)


@needs_kernels
def test_varlen_model_bf16_within_tolerance():
    """bf16: the varlen model is as close to the fp32 reference as the padded reference
    attention in bf16 is (the kernel's math is fp32 inside)."""
    _check_bf16_varlen_against("torch")


def _check_bf16_varlen_against(padded_backend):
    """bf16 errors against the fp32 reference: varlen's within 1.5x those of `padded_backend` in bf16."""
    ps = megabert.init_parallel()
    loss0, _, g0 = _loss_and_grads(_cfg(attention_backend="torch"), ps)
    errors = []
    for kw in ({"attention_backend": padded_backend}, {"attention_backend": "varlen", "unpad_input": True}):
        loss, _, g = _loss_and_grads(_cfg(**kw), ps, torch.bfloat16)
        errors.append((abs(loss - loss0), max(((g[n] - g0[n]).norm() / g0[n].norm()).item() for n in g0)))
    (loss_err_ref, grad_err_ref), (loss_err, grad_err) = errors
    assert loss_err < 3e-2 and grad_err < 1.5 * grad_err_ref + 1e-2, errors


def _losses(argv, tp=1):
    _, _, trainer = build_trainer(["--train-iters", "3"] + argv, tp)
    try:
        return [step_loss(trainer) for _ in range(3)]
    finally:
        trainer.close()


def _layouts(rank, world):
    varlen = ["--attention-backend", "varlen"]  # pretrain_bert.py unpads by default
    padded = ["--attention-backend", "torch", "--no-unpad-input"]
    # TP=2 (each rank's heads, its own items): sequence parallelism needs the padded encoder,
    # so the reference runs with it.
    assert _losses(varlen, 2) == pytest.approx(_losses(padded + ["--sequence-parallel"], 2), abs=1e-5, rel=0)
    # PP=2 with full recompute (selective recompute: test_varlen_model_equals_padded_reference).
    extra = ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full"]
    assert _losses(varlen + extra) == pytest.approx(_losses(padded + extra), abs=1e-5, rel=0)


@needs_kernels
def test_varlen_training_equals_padded_reference_in_parallel_layouts():
    """Three training steps (AdamW), fp32, dropout 0: the losses of the padded reference."""
    run_distributed(_layouts, 2)


def _recompute_with_dropout(rank, world):
    """Dropout on at TP=2: recompute replays the kernel's masks (the key is redrawn from the
    restored per-TP-rank stream), so loss and grads equal those without recompute, bitwise."""
    ps = megabert.init_parallel(tensor_parallel_size=world)
    results = []
    for recompute in (None, "full", "selective"):
        torch.manual_seed(5)
        cfg = _cfg(attention_backend="varlen", unpad_input=True, attention_dropout=0.2, hidden_dropout=0.1,
                   recompute_granularity=recompute)
        results.append(_loss_and_grads(cfg, ps))
    (loss0, _, g0), *others = results
    for loss, _, g in others:
        assert torch.equal(loss, loss0) and all(torch.equal(g[n], g0[n]) for n in g0)


@needs_kernels
def test_recompute_replays_the_kernel_dropout_at_tp2():
    run_distributed(_recompute_with_dropout, 2)


# ---------------------------------------------------------------- CUDA: FlashAttention varlen

def _flash_ok():
    from megabert.ops.varlen_attention import flash_varlen_available

    return flash_varlen_available()


needs_flash = pytest.mark.skipif(not _flash_ok(), reason="needs a CUDA GPU with FlashAttention (sm80+)")
CUDA_LENGTHS = [5, 200, 1, 512, 130, 64]


def _cuda_qkv(lengths, dtype, heads=4, d=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(sum(lengths), 3, heads, d, device="cuda", dtype=dtype, generator=g).requires_grad_()


@needs_flash
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_varlen_matches_pytorch_per_sequence(dtype):
    """Dropout 0: output and the grad of the packed QKV against PyTorch per sequence in fp32
    from the same half inputs, within half rounding."""
    qkv = _cuda_qkv(CUDA_LENGTHS, dtype)
    cu = cu_seqlens(CUDA_LENGTHS).cuda()
    got = varlen_attention(qkv, cu, cu.tolist)
    ref_in = qkv.detach().float().requires_grad_()
    want = varlen_attention_reference(ref_in, CUDA_LENGTHS)
    grad = torch.randn_like(want)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2)
    g_got = torch.autograd.grad(got, qkv, grad.to(dtype))[0].float()
    g_want = torch.autograd.grad(want, ref_in, grad)[0]
    assert ((g_got - g_want).norm() / g_want.norm()).item() < 2e-2


@needs_flash
def test_flash_varlen_dropout_is_sdpa_flash_dropout():
    """Dropout inside the kernel: with sequences of one length the varlen kernel draws the
    same Philox stream as SDPA's flash kernel on [b, heads, s, d] under the same seed, so
    output and grads agree; the same seed gives the same masks, another seed others."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lengths, p = [256] * 3, 0.3
    qkv = _cuda_qkv(lengths, torch.bfloat16)
    cu = cu_seqlens(lengths).cuda()
    grad = torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16)

    def varlen(seed):
        torch.cuda.manual_seed(seed)
        out = varlen_attention(qkv, cu, cu.tolist, dropout_p=p)
        return out, torch.autograd.grad(out, qkv, grad)[0]

    out, g = varlen(7)
    torch.cuda.manual_seed(7)
    q, k, v = qkv.view(3, 256, 3, 4, 64).permute(2, 0, 3, 1, 4).unbind(0)  # [b, heads, s, d]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
    ref = ref.transpose(1, 2).reshape(sum(lengths), 4, 64)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(g, torch.autograd.grad(ref, qkv, grad)[0], rtol=0, atol=0)
    again, g_again = varlen(7)
    assert torch.equal(again, out) and torch.equal(g_again, g)
    assert not torch.equal(varlen(8)[0], out)
    # About p of the probabilities dropped: the output's scale stays that of no dropout.
    plain = varlen_attention(qkv, cu, cu.tolist).float()
    assert 0.8 < (out.float().norm() / plain.norm()).item() < 1.5


@needs_flash
def test_cuda_auto_is_varlen_and_fp32_runs_padded_sdpa():
    """On a GPU with FlashAttention `auto` is varlen; in fp32 (no autocast) the varlen core
    runs one padded SDPA call: loss and every gradient equal the padded reference to 1e-5."""
    assert resolve_attention_backend("auto", "cuda", 64) == "varlen"
    ps = megabert.init_parallel()
    loss0, nsp0, g0 = _loss_and_grads(_cfg(attention_backend="torch"), ps)
    loss1, nsp1, g1 = _loss_and_grads(_cfg(attention_backend="auto", unpad_input=True), ps)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-5)
    torch.testing.assert_close(nsp1, nsp0, rtol=0, atol=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-5, msg=name)


@needs_flash
def test_flash_varlen_model_bf16_within_tolerance():
    """BERT in bf16 on the GPU, dropout 0: the varlen model (FlashAttention) is as close to
    the fp32 reference as padded SDPA in bf16 is."""
    _check_bf16_varlen_against("sdpa")
