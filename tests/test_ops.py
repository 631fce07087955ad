"""megabert.ops front ends: the fallback to PyTorch is logged once, never silent; the
backend resolution honours a missing build; the fused attention core matches torch's."""
import logging

import pytest
import torch

import megabert.fused_kernels as fk
from megabert.errors import ConfigError
from megabert.ops import (core_attention, layer_norm, resolve_attention_backend, resolve_layernorm_backend,
                          scaled_masked_softmax)
from megabert.ops.reference import layer_norm_reference, scaled_masked_softmax_reference


def _messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "megabert.ops" and r.levelno == level]


def test_fallback_is_logged_once_and_matches_reference(fresh_log):
    scores = torch.randn(2, 3, 4, 5, dtype=torch.float16)
    mask = torch.rand(2, 1, 1, 5) < 0.4
    for _ in range(3):
        probs = scaled_masked_softmax(scores, mask, 0.5)
    torch.testing.assert_close(probs, scaled_masked_softmax_reference(scores, mask, 0.5))
    warnings = _messages(fresh_log, logging.WARNING)
    assert len(warnings) == 1 and "float16 on cpu" in warnings[0] and "using PyTorch" in warnings[0]


@pytest.mark.skipif(not fk.is_available(), reason="kernels not built")
def test_each_reason_is_logged_once_and_the_fused_choice_once(fresh_log):
    x = torch.randn(4, 6)
    weight, bias = torch.ones(6), torch.zeros(6)
    for _ in range(2):
        scaled_masked_softmax(torch.randn(2, 2, 2, 3, 4), None, 1.0)  # 5-D scores
        layer_norm(x, weight, None, 1e-5)  # no bias
        y = layer_norm(x, weight, bias, 1e-5)  # fused
    torch.testing.assert_close(y, layer_norm_reference(x, weight, bias, 1e-5))
    warnings = _messages(fresh_log, logging.WARNING)
    assert len(warnings) == 2
    assert any("scores of 5 dims" in w for w in warnings) and any("without weight or bias" in w for w in warnings)
    infos = [m for m in _messages(fresh_log, logging.INFO) if m.startswith("layer_norm:")]
    assert infos == [f"layer_norm: {fk.describe('cpu')}"]


def test_unbuilt_kernels_fall_back_and_resolve_to_torch(fresh_log, monkeypatch):
    monkeypatch.setattr(fk, "_cpu", None)
    monkeypatch.setattr(fk, "_cpu_error", "ImportError: not built in this test")
    assert not fk.is_available() and "not built in this test" in fk.load_error()
    assert resolve_layernorm_backend("auto") == "torch" and resolve_attention_backend("auto") == "sdpa"
    with pytest.raises(ConfigError, match="--layernorm-backend fused"):
        resolve_layernorm_backend("fused")
    with pytest.raises(ConfigError, match="--attention-backend fused"):
        resolve_attention_backend("fused")
    x, weight, bias = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    torch.testing.assert_close(layer_norm(x, weight, bias, 1e-5), layer_norm_reference(x, weight, bias, 1e-5))
    warnings = _messages(fresh_log, logging.WARNING)
    assert len(warnings) == 1 and "not built in this test" in warnings[0]


@pytest.mark.skipif(not fk.is_available() or fk.is_available("cuda"), reason="needs a CPU-only build")
def test_backend_resolution_is_per_device():
    # A CPU-only build (no nvcc, or a CPU torch) must not send a GPU model to kernels it lacks.
    assert resolve_layernorm_backend("auto", "cpu") == "fused" and resolve_attention_backend("auto", "cpu") == (
        "varlen" if fk.cpu_isa() != "default" else "fused")
    assert resolve_layernorm_backend("auto", "cuda") == "torch" and resolve_attention_backend("auto", "cuda") == "sdpa"
    with pytest.raises(ConfigError, match="--layernorm-backend fused: the fused LayerNorm is a CPU kernel"):
        resolve_layernorm_backend("fused", "cuda")


def test_auto_on_cuda_is_sdpa_and_torch_even_with_built_kernels(monkeypatch):
    # Built CUDA kernels are opt-in (--attention-backend fused) until measured on a GPU.
    monkeypatch.setattr(fk, "is_available", lambda device="cpu": True)
    assert resolve_layernorm_backend("auto", "cuda") == "torch" and resolve_attention_backend("auto", "cuda") == "sdpa"
    # There is no CUDA LayerNorm (deleted: PyTorch's was faster), built kernels or not.
    with pytest.raises(ConfigError, match="--layernorm-backend fused: the fused LayerNorm is a CPU kernel"):
        resolve_layernorm_backend("fused", "cuda")


@pytest.mark.skipif(not fk.is_available(), reason="kernels not built")
def test_fused_attention_core_matches_torch():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=gen) for _ in range(3))
    lengths = torch.tensor([7, 4])
    mask = (torch.arange(7)[None, :] >= lengths[:, None])[:, None, None, :]  # [b, 1, 1, sk] padding
    outputs, grads = [], []
    for backend in ("fused", "torch"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = core_attention(*leaves, mask, backend=backend)
        out.backward(torch.ones_like(out))
        outputs.append(out)
        grads.append([t.grad for t in leaves])
    torch.testing.assert_close(outputs[0], outputs[1])
    for fused, ref in zip(*grads):
        torch.testing.assert_close(fused, ref)
