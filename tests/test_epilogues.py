"""The layers' fused GEMM epilogues (megabert.ops.epilogues, backend 'compiled': each a
torch.compile'd function) equal PyTorch's unfused chain: outputs and gradients, dropout
masks included (drawn from the same generator as F.dropout, the TP-rank stream inside
RNGStatesTracker.fork()), and a BERT step with them equals one without. On the CPU here;
on CUDA the same code runs Triton kernels (make bench-gpu times them)."""
import contextlib

import pytest
import torch

import megabert
from megabert.ops import bias_dropout_add_layer_norm, bias_gelu
from megabert.ops.epilogues import (bias_dropout_add_layer_norm_reference, bias_dropout_add_reference,
                                     bias_gelu_reference)
from megabert.tensor_parallel.random import RNGStatesTracker


def _leaves(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def _grads(out, leaves, seed=1):
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, leaves, grad)


def test_bias_gelu_equals_the_chain():
    x, b = _leaves((6, 5, 32), (32,))
    out = bias_gelu(x, b, backend="compiled")
    ref = bias_gelu_reference(x, b)
    # Inductor's erf rounds differently from ATen's (1e-6 apart): fp32's default tolerances.
    torch.testing.assert_close(out, ref)
    for a, r in zip(_grads(out, [x, b]), _grads(ref, [x, b])):
        torch.testing.assert_close(a, r)


class _LN(torch.nn.Module):
    """What the epilogue reads of a LayerNorm module (megabert.model.norm.LayerNorm)."""

    def __init__(self, h):
        super().__init__()
        self.weight, self.bias = _leaves((h,), (h,), seed=3)
        self.eps = 1e-12

    def affine(self, x):
        return self.weight, self.bias, contextlib.nullcontext()


@pytest.mark.parametrize("with_norm", [True, False], ids=["post-ln", "no-norm"])
@pytest.mark.parametrize("p,training", [(0.1, True), (0.1, False)], ids=["dropout", "eval"])
def test_bias_dropout_add_layer_norm_equals_the_chain(with_norm, p, training):
    x, b, r = _leaves((7, 3, 32), (32,), (7, 3, 32))
    ln = _LN(32) if with_norm else None
    torch.manual_seed(11)
    out = bias_dropout_add_layer_norm(x, b, r, p, training, ln, backend="compiled")
    after = torch.get_rng_state()
    torch.manual_seed(11)
    if with_norm:
        ref = bias_dropout_add_layer_norm_reference(x, b, r, p, training, ln.weight, ln.bias, ln.eps)
    else:
        ref = bias_dropout_add_reference(x, b, r, p, training)
    # The same mask, drawn from the same generator state, which both advance alike.
    assert torch.equal(torch.get_rng_state(), after)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    leaves = [x, b, r] + ([ln.weight, ln.bias] if ln else [])
    for a, e in zip(_grads(out, leaves), _grads(ref, leaves)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_compiled_dropout_follows_the_forked_tp_stream():
    # Sequence-parallel slices draw from the per-TP-rank stream: inside fork() the compiled
    # epilogue's mask is the stream's, and the default stream is left as it was.
    x, b, r = _leaves((5, 2, 16), (16,), (5, 2, 16))
    masks = []
    for backend in ("compiled", "torch"):
        torch.manual_seed(0)
        tracker = RNGStatesTracker("cpu")
        tracker.add("tensor-parallel", 1234)
        default_before = torch.get_rng_state()
        with tracker.fork():
            out = bias_dropout_add_layer_norm(x, b, r, 0.5, True, None, backend=backend)
        assert torch.equal(torch.get_rng_state(), default_before)
        masks.append((out - r).detach() != 0)
    assert torch.equal(masks[0], masks[1])
    # Not the default stream's mask.
    torch.manual_seed(0)
    assert not torch.equal(masks[0], torch.nn.functional.dropout(x + b, 0.5, True) != 0)


@pytest.mark.parametrize("position", ["post"])  # pre-LN's epilogue (no norm) is covered above; compiling is slow here
def test_bert_step_with_compiled_epilogues_equals_the_chain(position):
    ps = megabert.init_parallel()
    grads, losses = [], []
    for backend in ("compiled", "torch"):
        cfg = megabert.bert_tiny(vocab_size=128)
        cfg = type(cfg)(**{**cfg.__dict__, "hidden_dropout": 0.1, "attention_dropout": 0.0,
                           "layernorm_position": position, "dropout_add_backend": backend,
                           "attention_backend": "torch", "layernorm_backend": "torch"})
        torch.manual_seed(0)
        model = megabert.BertForPreTraining(cfg, ps)
        assert model.ctx.dropout_add_backend == backend
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        labels = torch.where(torch.rand(2, 16, generator=gen) < 0.3, ids, -100)
        torch.manual_seed(5)
        out = model(ids, torch.zeros_like(ids), torch.ones_like(ids), labels, torch.tensor([0, 1]))
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5, msg=name)
