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

from tests.helpers.kernel_checks import fused_dropout_add_with_mask, philox4x32_10, threshold

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
    out, mask = fused_dropout_add_with_mask(x, r, p)
    assert mask.dtype == torch.bool and mask.shape == x.shape
    assert torch.equal(out, _expected(x, r, mask, p))


def test_mask_statistics():
    n = 1_000_000
    torch.manual_seed(1234)
    for p in (0.1, 0.5, 0.9):
        x, r = torch.ones(n), torch.zeros(n)
        out, mask = fused_dropout_add_with_mask(x, r, p)
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


def test_philox_reference_meets_random123_known_answers():
    """The Python Philox4x32-10 that the mask tests below trust: Random123's known answers."""
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_mask_is_philox4x32_10_of_the_element_index():
    """Element i keeps when word (i % 64) // 16 of Philox4x32-10 at counter
    ((i // 64) * 16 + i % 16, 0, 0, 0) under the call's key is >= round(p * 2^32), the
    layout dropout_kernels.h documents, whatever the vector width that computed it."""
    n, p, seed = 300, 0.3, 2**40 + 12345
    x = torch.ones(n)
    _, mask = fk.kernels_for("cpu").dropout_add_forward(x, torch.zeros(n), p, torch.tensor([seed]))
    key = (seed & 0xFFFFFFFF, seed >> 32)
    words = [philox4x32_10((tile * 16 + j, 0, 0, 0), key) for tile in range((n + 63) // 64) for j in range(16)]
    want = [words[(i // 64) * 16 + i % 16][(i % 64) // 16] >= threshold(p) for i in range(n)]
    assert mask.tolist() == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients(dtype):
    x, r = _inputs((300, 65), dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    p = 0.2
    torch.manual_seed(7)
    _, mask = fused_dropout_add_with_mask(x, r, p)
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


def test_backend_resolution(monkeypatch):
    import torch.utils._triton as triton_probe

    assert resolve_dropout_add_backend("auto", "cpu") == "fused"
    assert resolve_dropout_add_backend("torch", "cpu") == "torch"
    assert resolve_dropout_add_backend("compiled", "cpu") == "compiled"
    with pytest.raises(Exception, match="--dropout-add-backend"):
        resolve_dropout_add_backend("fused", "cuda")
    # CUDA: PyTorch's chain (measured faster than the compiled epilogues on an H200), which
    # --dropout-add-backend compiled still selects where Triton is there.
    monkeypatch.setattr(triton_probe, "has_triton", lambda: True)
    assert resolve_dropout_add_backend("auto", "cuda") == "torch"
    assert resolve_dropout_add_backend("compiled", "cuda") == "compiled"
    monkeypatch.setattr(triton_probe, "has_triton", lambda: False)
    assert resolve_dropout_add_backend("auto", "cuda") == "torch"
    with pytest.raises(Exception, match="--dropout-add-backend compiled: torch.compile needs Triton"):
        resolve_dropout_add_backend("compiled", "cuda")
