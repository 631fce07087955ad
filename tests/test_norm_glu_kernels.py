"""The fused CPU RMSNorm and gated-activation (SwiGLU, GeGLU) kernels against the PyTorch chains
computed in float64, their fallbacks, and the model modules that choose them.

Every kernel case goes through the `megabert.ops` front ends and checks that the kernel, not the
fallback, ran (the fused Function's grad_fn). The other instruction sets run in
tests/test_fused_kernels.py's per-ISA subprocess.
"""
import logging

import pytest
import torch

import megabert.fused_kernels as fk
from megabert.ops import gated_activation, rms_norm
from megabert.ops.reference import gated_activation_reference, rms_norm_reference

from tests.helpers.kernel_checks import (check_gated_activation, check_rms_norm, fused, glu_case, graph_functions,
                                         rms_case)

pytestmark = pytest.mark.skipif(not fk.is_available(), reason=f"kernels not built: {fk.load_error()}")

# Spec names as the families give them; gelu_new and gelu_pytorch_tanh are one kernel activation.
ACTIVATIONS = ["silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh"]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "megabert.ops" and r.levelno == logging.WARNING]


# ---- RMSNorm -------------------------------------------------------------------------

# Odd widths (not multiples of 16 or 8), one row, no rows, one element, and the families' shapes.
@pytest.mark.parametrize("shape", [(5, 3, 256), (7, 1023), (1, 300), (0, 8), (1, 1), (3, 17), (64, 2, 130)], ids=str)
def test_rms_norm_shapes(shape):
    check_rms_norm(*rms_case(shape, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_dtypes(dtype):
    check_rms_norm(*rms_case((6, 5, 321), dtype))


def test_rms_norm_bf16_equals_pytorchs_chain():
    # bf16 as transformers computes it: fp32 math, the normalised value rounded to bf16 before the
    # weight multiplies it. The kernel rounds at the same places, so it differs from the bf16 chain
    # only where the fp32 sum of squares (summed in another order) moves a value across a rounding
    # boundary: at most one bf16 ulp, and rarely.
    x, weight, _ = rms_case((64, 384), torch.bfloat16)
    ours, chain = rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)
    assert ours.dtype == chain.dtype == torch.bfloat16
    torch.testing.assert_close(ours, chain, rtol=2 ** -7, atol=1e-6)
    assert (ours == chain).float().mean() > 0.99


def test_rms_norm_non_contiguous_input():
    x, weight, grad = rms_case((9, 3, 200), torch.float32)
    check_rms_norm(x.transpose(0, 1), weight, grad.transpose(0, 1))


def test_rms_norm_gradcheck_float64():
    # The kernel runs fp64 with fp64 math, so gradcheck exercises the kernel itself.
    x, weight, _ = rms_case((3, 2, 7), torch.float64)
    inputs = (x.requires_grad_(), weight.requires_grad_())
    assert fused(rms_norm(*inputs, 1e-5), "FusedRMSNorm")
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-5), inputs)


def test_rms_norm_outside_the_kernel_runs_pytorch_and_says_so_once(fresh_log):
    x16, w16, _ = rms_case((4, 40), torch.float16)
    xb, wb, _ = rms_case((4, 40), torch.bfloat16)
    for _ in range(2):
        y16 = rms_norm(x16, w16, 1e-6)  # a dtype the kernel does not take
        mixed = rms_norm(xb, wb.float(), 1e-6)  # bf16 input, fp32 weight: PyTorch promotes to fp32
    torch.testing.assert_close(y16, rms_norm_reference(x16, w16, 1e-6))
    assert mixed.dtype == torch.float32 and not fused(mixed, "FusedRMSNorm")
    torch.testing.assert_close(mixed, rms_norm_reference(xb, wb.float(), 1e-6))
    warnings = _warnings(fresh_log)
    assert len(warnings) == 2, warnings
    assert any("float16 on cpu" in w for w in warnings)
    assert any("bfloat16 input with a torch.float32 weight" in w for w in warnings)


@pytest.mark.parametrize("bf16_residual", [False, True])
def test_rms_norm_module_fused_equals_torch_backend(bf16_residual):
    """The RMSNorm module on each backend, plain and as a post-LN epilogue (residual add first):
    the same outputs and gradients; with --bf16-residual a bf16 input is normalised with the bf16
    weight (the kernel) and gives bf16."""
    from megabert.model.norm import RMSNorm

    dtype = torch.bfloat16 if bf16_residual else torch.float32
    x, _, grad = rms_case((4, 3, 96), dtype)
    residual = rms_case((4, 3, 96), dtype, seed=1)[0]
    results = []
    for backend in ("torch", "fused"):
        norm = RMSNorm(96, 1e-6, backend=backend, bf16_residual=bf16_residual)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.arange(96.0) / 96)
        leaf = x.clone().requires_grad_()
        out = [norm(leaf), norm(leaf, residual=residual)]
        assert fused(out[0], "FusedRMSNorm") == (backend == "fused")
        assert all(o.dtype == dtype for o in out)
        (out[0].float() * grad.float()).sum().add((out[1].float() * grad.float()).sum()).backward()
        results.append([o.detach() for o in out] + [leaf.grad, norm.weight.grad])
    tol = dict(rtol=2e-2, atol=2e-2) if bf16_residual else dict(rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(ours, theirs, **tol)


# ---- gated activation ------------------------------------------------------------------

@pytest.mark.parametrize("gate_first", [False, True], ids=["input_first", "gate_first"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_activation_each_activation_both_orders(activation, gate_first):
    # f = 37: odd, no multiple of any vector width; three leading dims.
    check_gated_activation(*glu_case((2, 3, 74), torch.float32), activation, gate_first)


@pytest.mark.parametrize("shape", [(1, 2), (0, 10), (1, 2050), (9, 2048)], ids=str)
def test_gated_activation_shapes(shape):
    check_gated_activation(*glu_case(shape, torch.float32), "silu", False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_new"])
def test_gated_activation_dtypes(activation, dtype):
    check_gated_activation(*glu_case((5, 2, 66), dtype), activation, True)


def test_gated_activation_non_contiguous_input():
    u, _ = glu_case((40, 6, 3), torch.float32)  # [2f, tokens, b] -> [b, tokens, 2f], a view
    check_gated_activation(u.permute(2, 1, 0), torch.randn(3, 6, 20), "gelu", False)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_new"])
def test_gated_activation_gradcheck_float64(activation):
    # fp64 runs the C library's exp and erfc, so gradcheck checks the kernel's derivative formulas.
    u, _ = glu_case((3, 10), torch.float64, scale=2.0)
    u.requires_grad_()
    assert fused(gated_activation(u, activation, True), "FusedGatedActivation")
    assert torch.autograd.gradcheck(lambda t: gated_activation(t, activation, True), (u,))


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_new"])
def test_gated_activation_fp32_accuracy_in_the_tails(activation):
    """fp32 against the function in float64, written without cancellation (erfc for GELU, the
    sigmoid form for its tanh approximation: PyTorch's fp64 erf/tanh forms lose the far negative
    tail themselves). Within a few ulp wherever the value is a normal float well above FLT_MIN
    (norm_glu_kernels.h: the exp of -x^2 / 2 and of 2u keep their low bits); no inf or NaN for
    large finite inputs, and 0 where the true value underflows."""
    x = torch.cat([torch.linspace(-12, 12, 48001), torch.tensor([-1e30, -1e4, -200.0, 200.0, 1e4, 1e30])])
    u = torch.stack([x, torch.ones_like(x)], 1)
    xd = x.double()
    truth = {"silu": xd * torch.sigmoid(xd), "gelu": 0.5 * xd * torch.special.erfc(-xd / 2 ** 0.5),
             "gelu_new": xd * torch.sigmoid(1.5957691216057308 * (xd + 0.044715 * xd ** 3))}[activation]
    y = gated_activation(u, activation).squeeze(1).double()
    assert torch.isfinite(y).all()
    normal = truth.abs() > 1e-30
    ulp = torch.finfo(torch.float32).eps * torch.exp2(torch.floor(torch.log2(truth[normal].abs())))
    assert ((y[normal] - truth[normal]).abs() / ulp).max() <= 8
    assert (y[~normal].abs() <= 1e-30).all()


def test_gated_activation_outside_the_kernel_runs_pytorch_and_says_so_once(fresh_log):
    u, _ = glu_case((4, 20), torch.float32)
    for _ in range(2):
        relu = gated_activation(u, "relu", False)  # an activation the kernel does not take
        half = gated_activation(u.half(), "silu", False)  # a dtype it does not take
    torch.testing.assert_close(relu, gated_activation_reference(u, "relu", False))
    torch.testing.assert_close(half, gated_activation_reference(u.half(), "silu", False))
    warnings = _warnings(fresh_log)
    assert len(warnings) == 2, warnings
    assert any("activation 'relu'" in w for w in warnings) and any("float16 on cpu" in w for w in warnings)
    # Another backend runs PyTorch's chain with nothing to say (it was asked for).
    leaf = u.clone().requires_grad_()
    assert not fused(gated_activation(leaf, "silu", False, backend="torch"), "FusedGatedActivation")
    assert len(_warnings(fresh_log)) == 2


# ---- the families choose them ------------------------------------------------------------

@pytest.mark.parametrize("family", ["eurobert", "gte"])
def test_families_run_the_kernels_by_default_and_pytorch_when_asked(family, tmp_path):
    """The CPU defaults (--layernorm-backend and --dropout-add-backend auto: fused) put an
    RMSNorm family's norms and every gated MLP on the kernels, and both give the same logits as
    the torch backends (transformers' parity: tests/test_encoder_families.py)."""
    import megabert
    from tests.helpers.family_models import make_family_dir
    from tests.helpers.modernbert_models import modernbert_batch

    pytest.importorskip("transformers")
    hf_dir = make_family_dir(tmp_path / "hf", family)
    ids, am, _ = modernbert_batch()
    logits = {}
    for backends in ({}, {"layernorm_backend": "torch", "dropout_add_backend": "torch"}):
        model = megabert.AutoModelForMaskedLM.from_pretrained(hf_dir, megabert.init_parallel(), **backends)
        out = model(ids, attention_mask=am).logits
        names = graph_functions(out)
        assert ("FusedGatedActivationBackward" in names) == (not backends)
        assert ("FusedRMSNormBackward" in names) == (not backends and family == "eurobert")
        logits[bool(backends)] = out.detach()
    torch.testing.assert_close(logits[False], logits[True], rtol=1e-5, atol=1e-5)
