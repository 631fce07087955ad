"""The fused CPU RoPE kernel with the attention's head layout (megabert.model.rope.attention_input)
against PyTorch's path (grouped_qkv's repeat and cat, then rotate_qkv) in float64, its fallback,
and the attention layers that choose it.

MHA reads the QKV GEMM's output [..., 3, heads, d]; grouped-query attention the Q and KV GEMMs'
outputs, each query head h reading key/value head h // group. The other instruction sets run in
tests/test_fused_kernels.py's per-ISA subprocess.
"""
import logging

import pytest
import torch

import megabert.fused_kernels as fk
from megabert.model.rope import attention_input, grouped_qkv, rotate_qkv

from tests.helpers.kernel_checks import check_rope, graph_functions, rope_case

pytestmark = pytest.mark.skipif(not fk.is_available(), reason=f"kernels not built: {fk.load_error()}")

# (heads, kv heads): MHA, then groups of 1, 2 and 4.
LAYOUTS = [(4, None), (4, 4), (4, 2), (8, 2)]


@pytest.mark.parametrize("heads,kv_heads", LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_layouts(heads, kv_heads, dtype):
    check_rope(*rope_case((37,), heads, kv_heads, 64, dtype))


# Head dims even but no multiple of 16 (a vector's worth of halves), and a short one.
@pytest.mark.parametrize("d", [40, 66, 2])
def test_rope_head_dims(d):
    check_rope(*rope_case((9,), 4, None, d, torch.float32))
    check_rope(*rope_case((9,), 4, 2, d, torch.float32))


@pytest.mark.parametrize("tokens", [0, 1])
def test_rope_no_or_one_token(tokens):
    check_rope(*rope_case((tokens,), 4, None, 64, torch.float32))
    check_rope(*rope_case((tokens,), 4, 2, 64, torch.float32))


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_rope_padded_layout(kv_heads):
    """[s, b, ...] with the padded tables ([s, b, 1, d]: each slot's position in its row)."""
    check_rope(*rope_case((11, 3), 4, kv_heads, 64, torch.float32))


def test_rope_strided_inputs():
    """Views the kernel reads where they lie: q and kv from one wider GEMM output, kv narrowed
    to one key/value head (the TP case with replicated K/V), and tables read at a row stride."""
    q, _, cos, sin, grad = rope_case((13,), 4, 4, 64, torch.float32)
    fused_proj = torch.randn(13, 4 * 64 + 2 * 3 * 64 + 5)  # [Q | K V of 3 heads | 5 more columns]
    q = fused_proj[:, :256].view(13, 4, 64)
    kv = fused_proj[:, 256:256 + 384].view(13, 2, 3, 64).narrow(2, 1, 1)  # [13, 2, 1, 64]: head 1 of 3
    check_rope(q, kv, cos, sin, grad)
    wide = torch.stack([cos, sin], 0).transpose(0, 1).contiguous()  # [13, 2, 1, 64]: cos and sin rows interleaved
    check_rope(q, kv, wide[:, 0], wide[:, 1], grad)
    qkv = torch.randn(13, 3, 4, 2 * 64)[..., ::2]  # d not contiguous: copied before the kernel
    check_rope(qkv, None, cos, sin, grad)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_rope_gradcheck_float64(kv_heads):
    q, kv, cos, sin, _ = rope_case((3, 2), 4, kv_heads, 6, torch.float64)
    inputs = tuple(t.requires_grad_() for t in (q, kv) if t is not None)

    def fn(*x):
        return attention_input(x[0], x[1] if kv is not None else None, cos, sin, "fused")

    assert "FusedRotaryQKVBackward" in graph_functions(fn(*inputs))
    assert torch.autograd.gradcheck(fn, inputs)


def test_rope_fp32_and_bf16_forward_equal_pytorchs_path():
    # Same maths (fp32 products of the tables' values, one rounding to the dtype): fp32 within an
    # ulp (a fused multiply-add or not), bf16 the same bits but for the rare rounding tie.
    for dtype in (torch.float32, torch.bfloat16):
        q, kv, cos, sin, _ = rope_case((64,), 4, 2, 64, dtype)
        ours, theirs = attention_input(q, kv, cos, sin, "fused"), rotate_qkv(grouped_qkv(q, kv), cos, sin)
        assert ours.dtype == theirs.dtype == dtype
        torch.testing.assert_close(ours, theirs, rtol=2e-7 if dtype == torch.float32 else 2 ** -7, atol=1e-6)
        if dtype == torch.bfloat16:
            assert (ours == theirs).float().mean() > 0.99


def test_rope_torch_backend_and_outside_the_kernel_run_pytorch(fresh_log):
    """backend 'torch' is PyTorch's path, bit for bit, with nothing said; float16 (a dtype the
    kernel does not take) falls back too, said once."""
    q, kv, cos, sin, _ = rope_case((5,), 4, 2, 16, torch.float32)
    q.requires_grad_()
    out = attention_input(q, kv, cos, sin, "torch")
    assert "FusedRotaryQKVBackward" not in graph_functions(out)
    assert torch.equal(out, rotate_qkv(grouped_qkv(q, kv), cos, sin))
    q16, kv16, cos16, sin16, _ = rope_case((5,), 4, 2, 16, torch.float16)
    for _ in range(2):
        half = attention_input(q16, kv16, cos16, sin16, "fused")
    assert torch.equal(half, rotate_qkv(grouped_qkv(q16, kv16), cos16, sin16))
    warnings = [r.getMessage() for r in fresh_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rope_qkv: float16 on cpu" in warnings[0], warnings


@pytest.mark.parametrize("attention_backend", ["auto", "torch"], ids=["unpadded", "padded"])
@pytest.mark.parametrize("family", ["eurobert", "gte"], ids=["gqa", "mha"])
def test_families_run_the_kernel_by_default_and_pytorch_when_asked(family, attention_backend, tmp_path):
    """The CPU default (--dropout-add-backend auto: fused) rotates a RoPE family's Q and K with
    the kernel, unpadded ([T], the varlen core) and padded ([s, b]); logits and every parameter's
    gradient equal the torch backend's (transformers' parity: tests/test_encoder_families.py)."""
    import megabert
    from tests.helpers.family_models import make_family_dir
    from tests.helpers.modernbert_models import modernbert_batch

    pytest.importorskip("transformers")
    hf_dir = make_family_dir(tmp_path / "hf", family)
    ids, am, _ = modernbert_batch()
    results = []
    for backend in ("auto", "torch"):
        model = megabert.AutoModelForMaskedLM.from_pretrained(hf_dir, megabert.init_parallel(),
                                                              attention_backend=attention_backend,
                                                              dropout_add_backend=backend)
        logits = model(ids, attention_mask=am).logits
        assert ("FusedRotaryQKVBackward" in graph_functions(logits)) == (backend == "auto")
        logits.square().sum().backward()
        results.append([logits.detach()] + [p.grad for p in model.parameters() if p.grad is not None])
    assert len(results[0]) == len(results[1]) > 10
    for ours, theirs in zip(*results):  # fp32 sums in other orders (the gated MLP's kernel too)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


def test_rope_kernel_rejects_bad_shapes_in_one_line():
    from megabert.fused_kernels import _cpu

    q, kv, cos, sin = torch.randn(3, 4, 6), torch.randn(3, 2, 3, 6), torch.rand(3, 3), torch.rand(3, 3)
    with pytest.raises(RuntimeError, match="kv_heads dividing heads") as err:
        _cpu.rope_qkv_forward(q, kv, cos, sin)  # 3 key/value heads for 4 query heads
    assert len(str(err.value).splitlines()) == 1
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[3, 3\]"):
        _cpu.rope_qkv_forward(q, kv[:, :, :2], cos[:, :2], sin[:, :2])
    with pytest.raises(RuntimeError, match="grad must be"):
        _cpu.rope_qkv_backward(torch.randn(3, 3, 4, 6), cos, sin, 3)
