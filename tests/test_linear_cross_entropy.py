"""The fused MLM decoder + loss (megabert.ops.linear_cross_entropy) against F.linear +
F.cross_entropy: loss, logits and every gradient, over several vocab chunks with an uneven
last one, ignored rows, gradients through the logits too, with the CPU kernels and with
PyTorch's ops; and BertForPreTraining's loss and gradients with it against the unfused head."""
import pytest
import torch
import torch.nn.functional as F

import megabert
from megabert.config import ModelConfig
from megabert.model import heads
from megabert.ops import linear_cross_entropy as lce
from megabert.ops.linear_cross_entropy import linear_cross_entropy

from tests.helpers.train_utils import batches


def _reference(x, weight, bias, target, vocab):
    logits = F.linear(x, weight[:vocab], bias[:vocab])
    return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), reduction="none").view_as(target), logits


def _ours(x, weight, bias, target, vocab):
    loss, logits = linear_cross_entropy(x, weight, bias, target, vocab)
    return loss, logits.full()


def _run(fn, dtype, with_logits_grad, lead=(3, 13)):
    g = torch.Generator().manual_seed(0)
    h, padded, vocab = 16, 200, 190
    x = torch.randn(*lead, h, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(padded, h, generator=g, dtype=dtype).requires_grad_()
    bias = torch.randn(padded, generator=g, dtype=dtype).requires_grad_()
    target = torch.randint(0, vocab, lead, generator=g)
    target.view(-1)[::4] = -100
    loss, logits = fn(x, weight, bias, target, vocab)
    total = (loss * torch.rand(lead, generator=g, dtype=dtype)).sum()  # a different grad per row
    if with_logits_grad:
        total = total + (logits * torch.randn(logits.shape, generator=g, dtype=dtype)).sum()
    total.backward()
    return [loss.detach(), logits.detach(), x.grad, weight.grad, bias.grad]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("with_logits_grad", [False, True])
@pytest.mark.parametrize("kernels", ["cpu kernels", "pytorch"])
def test_matches_linear_and_cross_entropy(monkeypatch, dtype, tol, with_logits_grad, kernels):
    monkeypatch.setattr(lce, "CPU_CHUNK", 64)  # 190 columns: chunks of 64, 64, 62
    if kernels == "pytorch":
        monkeypatch.setattr(lce, "use_fused_kernel", lambda *args: False)
    ours = _run(_ours, dtype, with_logits_grad)
    ref = _run(_reference, dtype, with_logits_grad)
    for name, a, b in zip(("loss", "logits", "grad x", "grad weight", "grad bias"), ours, ref):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, rtol=tol, atol=tol), (name, (a - b).abs().max().item())
    assert ours[0].view(-1)[::4].eq(0).all()  # ignored rows: no loss
    assert ours[3][190:].eq(0).all() and ours[4][190:].eq(0).all()  # padding rows: no gradient


def test_gradcheck(monkeypatch):
    monkeypatch.setattr(lce, "CPU_CHUNK", 8)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(40, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([1, -100, 3, 36, 0])
    assert torch.autograd.gradcheck(lambda *a: _ours(*a, target, 37), (x, weight, bias))


def test_deterministic_and_logits_made_only_when_asked():
    runs = [_run(_ours, torch.float32, False) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    x = torch.randn(4, 8)
    loss, logits = linear_cross_entropy(x, torch.randn(30, 8), torch.zeros(30), torch.tensor([1, 2, 3, 4]), 30)
    assert logits._full is None and logits.full() is logits.full()


def test_rejects_what_it_does_not_compute():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 or float64"):
        linear_cross_entropy(x, torch.randn(30, 8, dtype=torch.bfloat16), torch.zeros(30), torch.zeros(4).long(), 30)


def _pretraining_step(fused: bool, monkeypatch):
    if not fused:
        monkeypatch.setattr(heads, "supports_linear_cross_entropy", lambda x, w: False)
    ps = megabert.init_parallel()
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=99, max_position_embeddings=32,
                      hidden_dropout=0, attention_dropout=0, mlm_logits_at_masked_only=True)
    model = megabert.BertForPreTraining(cfg, ps)
    b = next(batches(0, 4, 0, 1))
    out = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["labels"], b["next_sentence_label"])
    # The fused head keeps its logits in pieces until asked for them.
    assert ("mlm_logits_parallel" in out) != fused
    out.loss.backward()
    monkeypatch.undo()
    return out.loss.detach(), out.mlm_logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_pretraining_loss_and_gradients_equal_the_unfused_head(monkeypatch):
    loss, logits, grads = _pretraining_step(True, monkeypatch)
    ref_loss, ref_logits, ref_grads = _pretraining_step(False, monkeypatch)
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    assert torch.allclose(logits, ref_logits, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for name in grads:
        assert torch.allclose(grads[name], ref_grads[name], atol=1e-6), name
