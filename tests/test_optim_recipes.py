"""Optimizer details of the BERT recipes, against values computed by hand: Adam without
bias correction, LAMB's trust-ratio bounds, the warmup's initial LR."""
import math

import pytest
import torch

from megabert.config import OptimConfig
from megabert.optim import Adam, Lamb, LRSchedule, build_optimizer
from megabert.parallel.param_spec import describe

BETAS, EPS, LR, WD = (0.9, 0.999), 1e-6, 0.1, 0.01


def reference_adam(p, grads, bias_correction):
    """AdamW written out per element, in float64."""
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - LR * WD)
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        m_hat, v_hat = (m / (1 - BETAS[0] ** t), v / (1 - BETAS[1] ** t)) if bias_correction else (m, v)
        p = p - LR * m_hat / (v_hat.sqrt() + EPS)
    return p


def run(opt_cls, params, grads, **kw):
    opt = opt_cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
    for gs in grads:
        for p, g in zip([p for group in opt.param_groups for p in group["params"]], gs):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("bias_correction", [False, True])
def test_adam_matches_hand_written_reference(bias_correction):
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(7, 5, generator=g)
    grads = [torch.randn(7, 5, generator=g) for _ in range(4)]
    p = torch.nn.Parameter(p0.clone())
    run(Adam, [p], [[x] for x in grads], bias_correction=bias_correction)
    torch.testing.assert_close(p.detach().double(), reference_adam(p0, grads, bias_correction), rtol=0, atol=1e-6)


def test_without_bias_correction_the_first_step_is_uncorrected():
    # Step 1: m = 0.1 g, v = 0.001 g^2, so the update is 0.1 / sqrt(0.001) = 3.162 x sign(g)
    # (not 1 x sign(g) as with bias correction), times lr.
    p = torch.nn.Parameter(torch.zeros(3))
    opt = Adam([p], lr=1.0, betas=BETAS, eps=0.0 + 1e-12, weight_decay=0.0, bias_correction=False)
    p.grad = torch.tensor([2.0, -0.5, 1.0])
    opt.step()
    torch.testing.assert_close(p.detach(), -torch.tensor([1.0, -1.0, 1.0]) * 0.1 / math.sqrt(0.001))


def test_adam_with_bias_correction_is_torch_adamw_bitwise():
    g = torch.Generator().manual_seed(1)
    p0 = torch.randn(4, 3, generator=g)
    grads = [[torch.randn(4, 3, generator=g)] for _ in range(3)]
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    run(Adam, [a], grads, bias_correction=True)
    run(torch.optim.AdamW, [b], grads, foreach=False)
    assert torch.equal(a, b)


def test_adam_result_does_not_depend_on_grouping():
    g = torch.Generator().manual_seed(2)
    shapes = [(5, 3), (3,), (2, 2, 2)]
    p0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    one = [torch.nn.Parameter(x.clone()) for x in p0]
    split = [torch.nn.Parameter(x.clone()) for x in p0]
    run(Adam, one, grads, bias_correction=False)
    run(Adam, [{"params": split[:1]}, {"params": split[1:]}], grads, bias_correction=False)
    assert all(torch.equal(x, y) for x, y in zip(one, split))


def lamb_step(w, g, **bounds):
    """One LAMB step (no bias correction, no decay) at lr 1: returns the applied change."""
    p = torch.nn.Parameter(w.clone())
    opt = Lamb([p], lr=1.0, betas=BETAS, eps=1e-12, weight_decay=0.0, bias_correction=False, **bounds)
    p.grad = g
    opt.step()
    return (p.detach() - w)


def test_lamb_trust_ratio_is_clamped_to_its_bounds():
    # Step 1 without bias correction: update = 0.1 g / sqrt(0.001 g^2) = 3.1623 sign(g); for
    # g of 4 elements ||update|| = 6.3246.
    g = torch.tensor([1.0, -1.0, 2.0, -3.0])
    u = 0.1 / math.sqrt(0.001)
    update = -u * torch.sign(g)
    w_small, w_mid, w_big = torch.full((4,), 0.01), torch.full((4,), 1.0), torch.full((4,), 100.0)
    # ||w|| / ||u||: 0.02 / 6.3246 = 0.00316 -> raised to 0.01; 2 / 6.3246 = 0.316 -> cut to 0.3;
    # 200 / 6.3246 = 31.6 -> cut to 10 under the default upper bound.
    torch.testing.assert_close(lamb_step(w_small, g, min_trust_ratio=0.01, max_trust_ratio=0.3), update * 0.01)
    torch.testing.assert_close(lamb_step(w_mid, g, min_trust_ratio=0.01, max_trust_ratio=0.3), update * 0.3)
    torch.testing.assert_close(lamb_step(w_mid, g, min_trust_ratio=0.01, max_trust_ratio=10.0),
                               update * (2.0 / (2 * u)))
    torch.testing.assert_close(lamb_step(w_big, g), update * 10.0)
    # A zero weight (fresh bias) takes ratio 1, unclamped, as DeepSpeed's fused LAMB.
    torch.testing.assert_close(lamb_step(torch.zeros(4), g, min_trust_ratio=0.01, max_trust_ratio=0.3), update)


def test_build_optimizer_follows_the_recipe_flags():
    model = torch.nn.Linear(3, 3)
    describe(model.weight)
    describe(model.bias, weight_decay=False)
    opt = build_optimizer(model, OptimConfig(optimizer="lamb", lamb_min_coeff=0.02, lamb_max_coeff=0.3,
                                             bias_correction=False))
    assert isinstance(opt, Lamb)
    assert {(g["min_trust_ratio"], g["max_trust_ratio"], g["bias_correction"]) for g in opt.param_groups} == \
        {(0.02, 0.3, False)}
    assert isinstance(build_optimizer(model, OptimConfig(bias_correction=False)), Adam)
    assert isinstance(build_optimizer(model, OptimConfig()), torch.optim.AdamW)


def test_warmup_starts_from_lr_warmup_init():
    s = LRSchedule(OptimConfig(lr=1.0, lr_warmup_init=0.2, lr_warmup_iters=10, lr_decay_style="linear",
                               min_lr=0.1), train_iters=109)
    # 0.2 + 0.8 * it / 10 over the warmup, then Megatron's decay from --lr to --min-lr, reached
    # one step past the last.
    assert [s(it) for it in (1, 5, 10)] == pytest.approx([0.28, 0.6, 1.0])
    assert s(60) == pytest.approx(0.55) and s(110) == pytest.approx(0.1) and s(109) > 0.1


def test_warmup_exp_decay_exp_keeps_bing_berts_offset():
    # bing_bert: lr = learning_rate * f(step) + lr_offset; here learning_rate 4e-3, offset 1e-3
    # -> --lr 5e-3 (the peak) and --lr-warmup-init 1e-3.
    s = LRSchedule(OptimConfig(lr=5e-3, lr_warmup_init=1e-3, lr_warmup_iters=10,
                               lr_decay_style="warmup_exp_decay_exp", lr_exp_decay_rate=0.5,
                               lr_exp_decay_iters=20), train_iters=100)
    assert s(5) == pytest.approx(4e-3 * 0.25 + 1e-3)
    assert s(10) == pytest.approx(5e-3)
    assert s(30) == pytest.approx(4e-3 * 0.5 + 1e-3)


def test_recipe_flag_checks():
    from megabert.rules import check_optim

    with pytest.raises(ValueError, match="--lr-warmup-init must be in"):
        check_optim(OptimConfig(lr=1e-4, lr_warmup_init=1e-3))
    with pytest.raises(ValueError, match="--lamb-min-coeff <= --lamb-max-coeff"):
        check_optim(OptimConfig(lamb_min_coeff=0.5, lamb_max_coeff=0.3))


def test_adam_without_bias_correction_under_zero2_matches_one_process(tmp_path):
    # ZeRO hands the optimizer flat partitions; the update is elementwise, so the losses
    # follow the single-process run.
    from tests.helpers.dist_utils import run_distributed
    from tests.helpers.train_utils import read_metrics, train_worker

    one, zero2 = str(tmp_path / "one.jsonl"), str(tmp_path / "zero2.jsonl")
    common = ["--train-iters", "4", "--no-bias-correction"]
    run_distributed(train_worker, 1, common + ["--metrics-file", one])
    run_distributed(train_worker, 2, common + ["--metrics-file", zero2, "--deepspeed", "--zero-stage", "2"])
    assert read_metrics(zero2) == pytest.approx(read_metrics(one), abs=1e-4)
    with_correction = str(tmp_path / "corrected.jsonl")
    run_distributed(train_worker, 1, ["--train-iters", "4", "--metrics-file", with_correction])
    assert read_metrics(with_correction)[1:] != pytest.approx(read_metrics(one)[1:], abs=1e-4)  # it did change
