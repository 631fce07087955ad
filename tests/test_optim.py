"""Optimizers and schedules: LAMB is layout-independent and equals its per-tensor form; the
default AdamW is torch's fused kernel; schedules hit their endpoints."""
import logging
import math

import pytest
import torch

import megabert
import megabert.say_once
from megabert.config import ModelConfig, OptimConfig
from megabert.model.pretrained import gather_full
from megabert.optim import Lamb, LRSchedule, build_optimizer, param_groups
from megabert.parallel.param_spec import describe, spec_table

from tests.helpers.dist_utils import run_distributed
from tests.helpers.train_utils import batches


def _lamb_step(rank, world, out):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=99,
                      max_position_embeddings=32, hidden_dropout=0, attention_dropout=0, attention_backend="torch")
    model = megabert.BertForPreTraining(cfg, ps)
    opt = build_optimizer(model, OptimConfig(optimizer="lamb", lr=0.05), ps.tp_group)
    b = next(batches(0, 4, 0, 1))
    for _ in range(2):
        opt.zero_grad()
        model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["labels"], b["next_sentence_label"]).loss.backward()
        opt.step()
    full = gather_full(dict(model.named_parameters()), ps, spec_table(model))
    if rank == 0:
        torch.save({k: v[:99] if v.size(0) >= 99 and "word" in k or k == "lm_head.bias" else v for k, v in full.items()}, out)


def test_lamb_tp2_equals_tp1_parameterwise(tmp_path):
    # The trust ratio needs the norms of whole matrices; with TP-local norms the TP=2 update
    # differs by ~1e-5 here (checked). Float reordering alone (TP splits the GEMMs, and the
    # fused kernels' AVX2 and AVX-512 paths sum in different orders) reaches 1.07e-6 on an
    # AVX-512 machine: 3e-6 sits between the two with a margin of about 3x on each side.
    run_distributed(_lamb_step, 1, str(tmp_path / "a"))
    run_distributed(_lamb_step, 2, str(tmp_path / "b"))
    a, b = torch.load(tmp_path / "a"), torch.load(tmp_path / "b")
    assert len(a) > 10 and set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=3e-6, rtol=0), (k, (a[k] - b[k]).abs().max().item())


def test_no_weight_decay_on_bias_and_layernorm():
    ps = megabert.init_parallel()
    model = megabert.BertForPreTraining(megabert.bert_tiny(vocab_size=100), ps)
    decay, no_decay = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in no_decay["params"]) == sorted(
        n for n, p in model.named_parameters() if p.dim() == 1)  # every bias and LayerNorm parameter
    assert all(p.dim() == 2 for p in decay["params"]) and no_decay["weight_decay"] == 0.0


def test_a_parameter_without_a_spec_is_named():
    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(4, 4)})
    with pytest.raises(megabert.ConfigError, match="dense.weight has no ParamSpec"):
        param_groups(model, 0.01)


@pytest.mark.parametrize("style", ["linear", "cosine", "polynomial", "constant"])
def test_schedules(style):
    # The decay reaches --min-lr one step past the last (iteration 110 of a 109-step run):
    # no step runs at --min-lr (docs/recipes.md).
    s = LRSchedule(OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style=style), train_iters=109)
    assert s(5) == pytest.approx(0.5) and s(10) == pytest.approx(1.0)
    assert s(110) == pytest.approx(1.0 if style == "constant" else 0.1)
    assert (s(109) == pytest.approx(1.0)) if style == "constant" else (s(109) > 0.1)
    if style == "cosine":
        assert s(60) == pytest.approx(0.55)
    if style == "polynomial":
        assert s(60) == pytest.approx(0.1 + 0.9 * math.sqrt(0.5))


@pytest.mark.parametrize("style,mid", [("linear", 0.55), ("cosine", 0.55), ("minus_sqrt", 1.0 - 0.9 * math.sqrt(0.5)),
                                       ("exponential", 0.1 + 0.9 * (2 * 0.5 ** 0.5 - 1))])
def test_wsd(style, mid):
    """Megatron's WSD: warmup to --lr, flat until the last 39 of 109 iterations, then down to
    --min-lr at iteration 110, one past the last step (at 90 the anneal is half done)."""
    s = LRSchedule(OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style="WSD", lr_wsd_decay_iters=39,
                               lr_wsd_decay_style=style), train_iters=109)
    assert s(5) == pytest.approx(0.5) and s(10) == s(40) == s(70) == pytest.approx(1.0)
    assert s(90) == pytest.approx(mid) and s(110) == pytest.approx(0.1) and s(71) < 1.0 and s(109) > 0.1
    with pytest.raises(megabert.ConfigError, match="--lr-wsd-decay-iters"):
        OptimConfig(lr_decay_style="WSD")


def test_warmup_exp_decay_exp():
    s = LRSchedule(OptimConfig(lr=1.0, lr_warmup_iters=10, lr_decay_style="warmup_exp_decay_exp",
                               lr_exp_decay_rate=0.5, lr_exp_decay_iters=20), train_iters=100)
    assert s(5) == pytest.approx(0.25) and s(10) == pytest.approx(1.0) and s(30) == pytest.approx(0.5)


# --- multi-tensor LAMB and fused AdamW against per-tensor references -----------------------

BETAS, EPS = (0.9, 0.999), 1e-6


def reference_lamb(params, states, grads, *, lr, weight_decay, bias_correction, bounds):
    """One LAMB step written per tensor, as the optimizer was before its multi-tensor step:
    `states` in torch's layout (step, exp_avg, exp_avg_sq per tensor). Returns the set of
    bounds that changed a trust ratio ("min", "max")."""
    clamped = set()
    for p, s, g in zip(params, states, grads):
        s["step"] += 1
        s["exp_avg"].mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
        s["exp_avg_sq"].mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        m, v = s["exp_avg"], s["exp_avg_sq"]
        if bias_correction:
            t = float(s["step"])
            m, v = m / (1 - BETAS[0] ** t), v / (1 - BETAS[1] ** t)
        update = m / (v.sqrt() + EPS) + weight_decay * p
        w_norm, u_norm = float(p.norm()), float(update.norm())
        trust = 1.0
        if w_norm > 0 and u_norm > 0:
            ratio = w_norm / u_norm
            trust = min(max(ratio, bounds[0]), bounds[1])
            clamped |= {"min"} if ratio < bounds[0] else {"max"} if ratio > bounds[1] else set()
        p.add_(update, alpha=-lr * trust)
    return clamped


def _lamb_problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (3, 5, 2), (40,), (8,)]
    p0 = [torch.randn(s, generator=g) * scale for s, scale in zip(shapes, (1.0, 1.0, 0.01, 100.0, 0.0))]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(5)]
    return p0, grads


def _fresh_states(p0):
    return [{"step": torch.zeros(()), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            for p in p0]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_multi_tensor_lamb_equals_per_tensor_reference(bias_correction, weight_decay):
    # Bounds [0.05, 0.5]: the 0.01-scaled tensor is raised, the 100-scaled one cut, the zero
    # one (a fresh bias) takes 1, the others fall in between.
    p0, grads = _lamb_problem()
    kw = dict(lr=0.02, weight_decay=weight_decay, bias_correction=bias_correction)
    ref, ref_states = [p.clone() for p in p0], _fresh_states(p0)
    params = [torch.nn.Parameter(p.clone()) for p in p0]
    # Two groups, as BERT's: decayed and not.
    opt = Lamb([{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}], betas=BETAS, eps=EPS,
               min_trust_ratio=0.05, max_trust_ratio=0.5, **kw)
    clamped = set()
    for gs in grads:
        clamped |= reference_lamb(ref[:3], ref_states[:3], gs[:3], bounds=(0.05, 0.5), **kw)
        clamped |= reference_lamb(ref[3:], ref_states[3:], gs[3:], bounds=(0.05, 0.5),
                                  **{**kw, "weight_decay": 0.0})
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    assert clamped == {"min", "max"}
    assert not p0[4].any() and ref[4].abs().min() > 0  # the zero tensor moved (by trust 1 at step 1)
    for got, want in zip(params, ref):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)
    for p, s in zip(params, ref_states):
        assert opt.state[p].keys() == s.keys() and opt.state[p]["step"].dtype == torch.float32
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], s["exp_avg_sq"], rtol=0, atol=1e-6)


def test_lamb_loads_a_checkpoint_of_the_per_tensor_version():
    # Its state_dict: per-parameter step (float32 scalar on the CPU), exp_avg, exp_avg_sq.
    p0, grads = _lamb_problem(1)
    kw = dict(lr=0.02, weight_decay=0.01, bias_correction=True)
    ref, states = [p.clone() for p in p0], _fresh_states(p0)
    for gs in grads[:3]:
        reference_lamb(ref, states, gs, bounds=(0.0, 10.0), **kw)
    params = [torch.nn.Parameter(p.clone()) for p in ref]
    opt = Lamb(params, betas=BETAS, eps=EPS, **kw)
    old = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(states)},
           "param_groups": [{**{k: v for k, v in opt.param_groups[0].items() if k != "params"},
                             "params": list(range(len(params)))}]}
    opt.load_state_dict(old)
    for gs in grads[3:]:
        reference_lamb(ref, states, gs, bounds=(0.0, 10.0), **kw)
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    for got, want in zip(params, ref):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)
    assert all(float(opt.state[p]["step"]) == len(grads) for p in params)


def _bert_like_model():
    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(6, 5), "norm": torch.nn.LayerNorm(5)})
    for name, p in model.named_parameters():
        describe(p, weight_decay=name == "dense.weight")
    return model


def test_default_adamw_is_fused_and_equals_the_per_tensor_loop(monkeypatch, caplog):
    monkeypatch.setattr(megabert.say_once, "_said", set())
    cfg = OptimConfig(lr=0.01, weight_decay=0.01)
    model = _bert_like_model()
    ref_model = _bert_like_model()
    ref_model.load_state_dict(model.state_dict())
    with caplog.at_level(logging.INFO, logger="megabert.optim"):
        opt = build_optimizer(model, cfg)
    assert "optimizer: AdamW (fused)" in caplog.messages
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    ref = torch.optim.AdamW(param_groups(ref_model, cfg.weight_decay), lr=cfg.lr,
                            betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, foreach=False)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        for p, q in zip(model.parameters(), ref_model.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)

    # A checkpoint of the per-tensor loop (the old default) resumes fused: torch would
    # restore the saved "fused"/"foreach" flags with the state.
    opt.load_state_dict(ref.state_dict())
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    opt.step()


def test_adamw_on_a_device_without_the_fused_kernel_is_foreach(monkeypatch, caplog):
    monkeypatch.setattr(megabert.say_once, "_said", set())
    with torch.device("meta"):
        model = _bert_like_model()
    with caplog.at_level(logging.INFO, logger="megabert.optim"):
        opt = build_optimizer(model, OptimConfig())
    assert "optimizer: AdamW (foreach)" in caplog.messages
    assert all(g["foreach"] and not g["fused"] for g in opt.param_groups)
