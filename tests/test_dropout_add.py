"""The fused CPU dropout + residual add (megabert.ops.dropout_add) against its definition:
out = residual + mask * x / (1 - p) for the mask the kernel drew, grads mask * g / (1 - p)
and g, the mask's statistics, and its RNG contract (seeded by torch, advancing it)."""
import pytest
import torch
import torch.nn.functional as F

import megabert.fused_kernels as fk
from megabert.ops import dropout_add
from megabert.ops.dropout_add import FusedDropoutAdd, resolve_dropout_add_backend
from megabert.tensor_parallel.random import RNGStatesTracker

pytestmark = pytest.mark.skipif(not fk.is_available(), reason=f"kernels not built: {fk.load_error()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _expected(x, residual, mask, p):
    """residual + mask * x / (1 - p) as the kernel rounds it: x * scale in the math type,
    then the add, one rounding to the storage type."""
    math = torch.float64 if x.dtype == torch.float64 else torch.float32
    kept = (x.to(math) * (1.0 / (1.0 - p))) * mask.to(math)
    return (residual.to(math) + kept).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_p0_and_eval_are_the_plain_sum_and_draw_nothing(dtype):
    x, r = _inputs((7, 33), dtype)
    state = torch.get_rng_state()
    assert torch.equal(dropout_add(x, r, 0.0, True), r + x)
    assert torch.equal(dropout_add(x, r, 0.3, False), r + x)
    assert torch.equal(torch.get_rng_state(), state)  # as F.dropout: no draw when nothing drops


@pytest.mark.parametrize("dtype", DTYPES)
# Odd sizes: chunk and tile edges (64-element Philox tiles, ~16K-element thread chunks).
@pytest.mark.parametrize("shape", [(5, 3), (1000, 257), (128 * 16 * 60 // 100, 256)])
def test_output_is_residual_plus_scaled_masked_input(dtype, shape):
    x, r = _inputs(shape, dtype)
    p = 0.1
    out, mask = dropout_add(x, r, p, True, return_mask=True)
    assert mask.dtype == torch.bool and mask.shape == x.shape
    assert torch.equal(out, _expected(x, r, mask, p))


def test_mask_statistics():
    n = 1_000_000
    torch.manual_seed(1234)
    for p in (0.1, 0.5, 0.9):
        x, r = torch.ones(n), torch.zeros(n)
        out, mask = dropout_add(x, r, p, True, return_mask=True)
        kept = mask.double().mean().item()
        # 5 standard deviations of a binomial fraction: ~3e-4 at p=0.1, 5e-4 at p=0.5.
        assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5, (p, kept)
        # No structure along the flat index: the halves, and each of the 4 Philox words
        # (elements w * 16 + j of every 64-element tile), keep alike.
        words = mask.view(-1, 4, 16).double().mean(dim=(0, 2))
        sd_word = (p * (1 - p) / (n / 4)) ** 0.5
        assert torch.allclose(words, torch.full((4,), 1 - p, dtype=torch.float64), rtol=0, atol=6 * sd_word)
        halves = mask.view(2, -1).double().mean(dim=1)
        assert abs(halves[0] - halves[1]) < 6 * (p * (1 - p) / (n / 2)) ** 0.5
        assert torch.equal(out, mask.float() * (1.0 / (1 - p)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients(dtype):
    x, r = _inputs((300, 65), dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    p = 0.2
    torch.manual_seed(7)
    _, mask = dropout_add(x, r, p, True, return_mask=True)
    torch.manual_seed(7)  # same key: the same mask
    x.requires_grad_(), r.requires_grad_()
    out = dropout_add(x, r, p, True)
    assert type(out.grad_fn).__name__.startswith(FusedDropoutAdd.__name__)
    grad_x, grad_r = torch.autograd.grad(out, (x, r), g)
    math = torch.float64 if dtype == torch.float64 else torch.float32
    assert torch.equal(grad_x, ((g.to(math) * (1.0 / (1.0 - p))) * mask.to(math)).to(dtype))
    assert torch.equal(grad_r, g)


def test_gradcheck_for_a_fixed_key():
    x, r = _inputs((6, 20), torch.float64)
    x.requires_grad_(), r.requires_grad_()
    # The key is an input, so every evaluation draws the same mask.
    fn = lambda a, b: FusedDropoutAdd.apply(a, b, 0.3, torch.tensor([12345]))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, r))


def test_seeded_by_torch_and_advances_it():
    x, r = _inputs((64, 100), torch.float32)
    torch.manual_seed(3)
    a = dropout_add(x, r, 0.5, True)
    b = dropout_add(x, r, 0.5, True)
    assert not torch.equal(a, b)  # the generator advanced between the calls
    torch.manual_seed(3)
    assert torch.equal(dropout_add(x, r, 0.5, True), a)
    assert torch.equal(dropout_add(x, r, 0.5, True), b)
    gen = torch.Generator().manual_seed(3)
    c = dropout_add(x, r, 0.5, True, gen)  # an explicit generator, the default one untouched
    state = torch.get_rng_state()
    assert torch.equal(dropout_add(x, r, 0.5, True, torch.Generator().manual_seed(3)), c)
    assert torch.equal(torch.get_rng_state(), state)


def test_draws_from_the_forked_stream():
    """Inside RNGStatesTracker.fork() (the sequence-parallel dropout) the key comes from the
    forked stream, and the default stream does not move."""
    x, r = _inputs((32, 64), torch.float32)
    tracker = RNGStatesTracker("cpu")
    tracker.add("tensor-parallel", 99)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        a = dropout_add(x, r, 0.5, True)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(99)
    assert torch.equal(dropout_add(x, r, 0.5, True), a)


def test_outside_limits_runs_pytorch():
    x, r = _inputs((4, 8), torch.float32)
    torch.manual_seed(5)
    out = dropout_add(x, r[:1], 0.5, True)  # broadcast residual: not the kernel's shape
    torch.manual_seed(5)
    assert torch.equal(out, r[:1] + F.dropout(x, 0.5, True))


def test_backend_resolution():
    assert resolve_dropout_add_backend("auto", "cpu") == "fused"
    assert resolve_dropout_add_backend("auto", "cuda") == "torch"
    assert resolve_dropout_add_backend("torch", "cpu") == "torch"
    with pytest.raises(Exception, match="--dropout-add-backend"):
        resolve_dropout_add_backend("fused", "cuda")
