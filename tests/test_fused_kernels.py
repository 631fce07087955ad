"""The fused kernels against the PyTorch reference computed in float64.

Every test goes through the `megabert.ops` front ends (autograd Functions) and checks
that the kernel, not the fallback, ran: `grad_fn` names the fused Function. The CUDA
cases run where a GPU and the CUDA extension are there, and are skipped elsewhere.
"""
import math

import pytest
import torch

import megabert.fused_kernels as fk
from megabert.ops import layer_norm, scaled_masked_softmax
from megabert.ops.reference import layer_norm_reference, scaled_masked_softmax_reference

pytestmark = pytest.mark.skipif(not fk.is_available(), reason=f"kernels not built: {fk.load_error()}")

# fp32 kernels against the fp64 oracle: a few ulp of fp32 (the polynomial exp is ~2 ulp).
# bf16: the output is rounded to 8 bits of mantissa.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=4e-3, atol=4e-3), torch.float64: dict(rtol=1e-10, atol=1e-12)}

_needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and fk.is_available("cuda")),
                                 reason=f"no GPU or no CUDA kernels: {fk.load_error('cuda')}")
DEVICES = ["cpu", pytest.param("cuda", marks=_needs_cuda)]
# Each device with the dtypes its kernel takes (fp64 on the CPU only: it serves gradcheck).
DEVICE_DTYPES = [pytest.param(device, dtype, id=f"{device}-{str(dtype)[6:]}", marks=marks)
                 for device, marks in (("cpu", ()), ("cuda", _needs_cuda))
                 for dtype in ((torch.float32, torch.bfloat16, torch.float64) if device == "cpu"
                               else (torch.float32, torch.bfloat16, torch.float16))]


def _fused(t: torch.Tensor, name: str) -> bool:
    return type(t.grad_fn).__name__.startswith(name)


def _softmax_case(shape, mask_shape, dtype, device="cpu", scale=0.37, fully_masked_rows=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = (torch.randn(shape, generator=gen) * 4).to(dtype)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=gen) < 0.3
        if fully_masked_rows and len(mask_shape) > 1 and mask_shape[-2] > 1:
            mask[..., 0, :] = True  # every query 0 sees no key
    grad = torch.randn(shape, generator=gen).to(dtype)
    return scores.to(device), None if mask is None else mask.to(device), scale, grad.to(device)


def _check_softmax(scores, mask, scale, grad):
    x = scores.clone().requires_grad_()
    probs = scaled_masked_softmax(x, mask, scale)
    assert _fused(probs, "FusedScaledMaskedSoftmax")
    probs.backward(grad)

    x64 = scores.double().requires_grad_()
    ref = scaled_masked_softmax_reference(x64, mask, scale)
    ref.backward(grad.double())

    assert probs.dtype == scores.dtype and probs.shape == scores.shape
    torch.testing.assert_close(probs.double(), ref, **TOL[scores.dtype])
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL[scores.dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sk", [1, 2, 7, 32, 33, 127, 128, 257, 512, 1000, 2048, 4095, 4096])
def test_softmax_key_lengths(sk, device):
    _check_softmax(*_softmax_case((2, 2, 3, sk), (2, 1, 3, sk), torch.float32, device))


@pytest.mark.parametrize("mask_shape", [None, (3, 1, 5, 67), (1, 1, 5, 67), (3, 1, 1, 67), (3, 4, 5, 67),
                                        (5, 67), (67,)], ids=str)
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_softmax_broadcast_masks_and_dtypes(mask_shape, device, dtype):
    _check_softmax(*_softmax_case((3, 4, 5, 67), mask_shape, dtype, device))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_softmax_packed_rows(device, dtype):
    # Key counts that are multiples of 8 take the vector-load path on CUDA.
    _check_softmax(*_softmax_case((2, 3, 16, 512), (2, 1, 1, 512), dtype, device))


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_fully_masked_rows_are_zero_with_zero_grad(device):
    scores, _, scale, grad = _softmax_case((2, 3, 4, 9), None, torch.float32, device)
    mask = torch.zeros(2, 1, 4, 9, dtype=torch.bool, device=device)
    mask[1, 0, 2] = True  # batch 1, query 2: every key masked, in every head
    x = scores.clone().requires_grad_()
    probs = scaled_masked_softmax(x, mask, scale)
    probs.backward(grad)
    assert torch.all(probs[1, :, 2] == 0) and torch.all(x.grad[1, :, 2] == 0)
    torch.testing.assert_close(probs.sum(-1)[0], torch.ones(3, 4, device=device))


def test_softmax_large_and_non_contiguous_input():
    # Scores far from 0 (the max is subtracted) and a transposed view (copied once).
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 3, 40, 24, generator=gen) * 30 + 500
    scores = base.transpose(-1, -2)  # [2, 3, 24, 40], not contiguous
    mask = torch.rand(2, 1, 1, 40, generator=gen) < 0.5
    _check_softmax(scores, mask, 1.0, torch.randn(2, 3, 24, 40, generator=gen))


def test_softmax_empty_batch():
    probs = scaled_masked_softmax(torch.randn(0, 2, 3, 5), torch.zeros(1, 1, 3, 5, dtype=torch.bool), 1.0)
    assert probs.shape == (0, 2, 3, 5)


def test_softmax_gradcheck_float64():
    # The CPU kernel runs fp64 with fp64 math, so gradcheck exercises the kernel itself.
    scores, mask, scale, _ = _softmax_case((2, 2, 3, 6), (2, 1, 3, 6), torch.float64)
    x = scores.requires_grad_()
    assert torch.autograd.gradcheck(lambda s: scaled_masked_softmax(s, mask, scale), (x,))


def _ln_case(shape, dtype, device="cpu", seed=0, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + offset).to(dtype)
    weight = (1 + 0.5 * torch.randn(h, generator=gen)).to(dtype)
    bias = (0.1 * torch.randn(h, generator=gen)).to(dtype)
    grad = torch.randn(shape, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (x, weight, bias, grad))


def _check_layer_norm(x, weight, bias, grad, eps=1e-5):
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = layer_norm(*leaves, eps)
    assert _fused(y, "FusedLayerNorm")
    y.backward(grad)

    leaves64 = [t.double().requires_grad_() for t in (x, weight, bias)]
    ref = layer_norm_reference(*leaves64, eps)
    ref.backward(grad.double())

    assert y.dtype == x.dtype and y.shape == x.shape
    tol = dict(TOL[x.dtype])
    if x.dtype == torch.float32:  # grad_weight/bias sum over rows: fp32 rounding grows with sqrt(rows)
        tol["atol"] *= math.sqrt(x.numel() / x.size(-1)) * 4
    torch.testing.assert_close(y.double(), ref, **TOL[x.dtype])
    for ours, theirs in zip(leaves, leaves64):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(5, 3, 768), (7, 1024), (2, 1, 1), (3, 7), (4, 2, 1023), (3, 4097), (1, 8192),
                                   (64, 2, 130)], ids=str)
def test_layer_norm_shapes(shape, device):
    _check_layer_norm(*_ln_case(shape, torch.float32, device))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_layer_norm_dtypes(device, dtype):
    _check_layer_norm(*_ln_case((6, 5, 320), dtype, device))


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_large_mean_and_non_contiguous_input(device):
    # A mean of 1000 with unit spread: E[x^2] - E[x]^2 would cancel in fp32; the kernel
    # centres first. The input is a [b, s, h] -> [s, b, h] transposed view.
    x, weight, bias, grad = _ln_case((3, 9, 256), torch.float32, device, offset=1000.0)
    _check_layer_norm(x.transpose(0, 1), weight, bias, grad.transpose(0, 1), eps=1e-12)


def test_layer_norm_empty_input():
    x, weight, bias = torch.randn(0, 8), torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    layer_norm(x.requires_grad_(), weight, bias, 1e-5).sum().backward()
    assert torch.all(weight.grad == 0) and torch.all(bias.grad == 0)


def test_layer_norm_gradcheck_float64():
    # The CPU kernel runs fp64 with fp64 math, so gradcheck exercises the kernel itself.
    x, weight, bias, _ = _ln_case((3, 2, 5), torch.float64)
    inputs = tuple(t.requires_grad_() for t in (x, weight, bias))
    assert torch.autograd.gradcheck(lambda a, w, b: layer_norm(a, w, b, 1e-5), inputs)


# ---- one build, several instruction sets ----------------------------------------------

_ISA_CHECK = """
import sys
sys.path.insert(0, {tests!r})
import torch
from megabert.fused_kernels import _cpu
import test_fused_kernels as t
for dtype in (torch.float32, torch.bfloat16):
    t._check_softmax(*t._softmax_case((2, 3, 4, 200), (2, 1, 4, 200), dtype))
    t._check_layer_norm(*t._ln_case((5, 2, 776), dtype))
print(_cpu.isa())
"""


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_narrower_instruction_sets_agree(isa, tmp_path):
    """MEGABERT_CPU_ISA caps the row kernels' instruction set; each path meets the oracle."""
    import os
    import subprocess
    import sys

    code = _ISA_CHECK.format(tests=os.path.dirname(__file__))
    env = dict(os.environ, MEGABERT_CPU_ISA=isa, OMP_NUM_THREADS="2")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    ran = run.stdout.split()[-1]
    if ran != isa:
        pytest.skip(f"this CPU cannot run {isa} (ran {ran})")


def test_no_simd_instructions_outside_the_isa_kernels():
    """setup.py passes no -march: an AVX instruction anywhere but in the isa_avx2 /
    isa_avx512 namespaces (picked at run time) would crash the wheel on an older CPU."""
    import platform
    import shutil
    import subprocess

    if platform.machine() != "x86_64" or shutil.which("objdump") is None:
        pytest.skip("needs objdump on x86-64")
    disasm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", fk._cpu.__file__], capture_output=True,
                            text=True, check=True).stdout
    function, offenders = "", set()
    for line in disasm.splitlines():
        if line.endswith(">:"):
            function = line
        elif "\t" in line:
            mnemonic = line.split("\t")[1].split(" ")[0] if len(line.split("\t")) > 1 else ""
            # Every VEX/EVEX (AVX, AVX2, AVX-512, FMA) mnemonic starts with "v".
            if mnemonic.startswith("v") and "isa_avx" not in function:
                offenders.add(function)
    assert not offenders, sorted(offenders)[:5]
