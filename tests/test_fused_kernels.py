"""The fused kernels against the PyTorch reference computed in float64.

Every test goes through the `megabert.ops` front ends (autograd Functions) and checks
that the kernel, not the fallback, ran: `grad_fn` names the fused Function. The CUDA
cases run where a GPU and the CUDA extension are there, and are skipped elsewhere.
"""
import pytest
import torch

import megabert.fused_kernels as fk
from megabert.ops import layer_norm, scaled_masked_softmax

from tests.helpers.kernel_checks import check_layer_norm, check_softmax, ln_case, philox_mask_digest, softmax_case

pytestmark = pytest.mark.skipif(not fk.is_available(), reason=f"kernels not built: {fk.load_error()}")

_needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and fk.is_available("cuda")),
                                 reason=f"no GPU or no CUDA kernels: {fk.load_error('cuda')}")
DEVICES = ["cpu", pytest.param("cuda", marks=_needs_cuda)]
# Each device with the dtypes its kernel takes (fp64 on the CPU only: it serves gradcheck).
DEVICE_DTYPES = [pytest.param(device, dtype, id=f"{device}-{str(dtype)[6:]}", marks=marks)
                 for device, marks in (("cpu", ()), ("cuda", _needs_cuda))
                 for dtype in ((torch.float32, torch.bfloat16, torch.float64) if device == "cpu"
                               else (torch.float32, torch.bfloat16, torch.float16))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sk", [1, 2, 7, 32, 33, 127, 128, 257, 512, 1000, 2048, 4095, 4096])
def test_softmax_key_lengths(sk, device):
    check_softmax(*softmax_case((2, 2, 3, sk), (2, 1, 3, sk), torch.float32, device))


@pytest.mark.parametrize("mask_shape", [None, (3, 1, 5, 67), (1, 1, 5, 67), (3, 1, 1, 67), (3, 4, 5, 67),
                                        (5, 67), (67,)], ids=str)
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_softmax_broadcast_masks_and_dtypes(mask_shape, device, dtype):
    check_softmax(*softmax_case((3, 4, 5, 67), mask_shape, dtype, device))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_softmax_packed_rows(device, dtype):
    # Key counts that are multiples of 8 take the vector-load path on CUDA.
    check_softmax(*softmax_case((2, 3, 16, 512), (2, 1, 1, 512), dtype, device))


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_fully_masked_rows_are_zero_with_zero_grad(device):
    scores, _, scale, grad = softmax_case((2, 3, 4, 9), None, torch.float32, device)
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
    check_softmax(scores, mask, 1.0, torch.randn(2, 3, 24, 40, generator=gen))


def test_softmax_empty_batch():
    probs = scaled_masked_softmax(torch.randn(0, 2, 3, 5), torch.zeros(1, 1, 3, 5, dtype=torch.bool), 1.0)
    assert probs.shape == (0, 2, 3, 5)


def test_softmax_gradcheck_float64():
    # The CPU kernel runs fp64 with fp64 math, so gradcheck exercises the kernel itself.
    scores, mask, scale, _ = softmax_case((2, 2, 3, 6), (2, 1, 3, 6), torch.float64)
    x = scores.requires_grad_()
    assert torch.autograd.gradcheck(lambda s: scaled_masked_softmax(s, mask, scale), (x,))


# The LayerNorm kernel is the CPU's only (CUDA runs PyTorch's: megabert.ops.layer_norm).
@pytest.mark.parametrize("shape", [(5, 3, 768), (7, 1024), (2, 1, 1), (3, 7), (4, 2, 1023), (3, 4097), (1, 8192),
                                   (64, 2, 130)], ids=str)
def test_layer_norm_shapes(shape):
    check_layer_norm(*ln_case(shape, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_layer_norm_dtypes(dtype):
    check_layer_norm(*ln_case((6, 5, 320), dtype))


def test_layer_norm_large_mean_and_non_contiguous_input():
    # A mean of 1000 with unit spread: E[x^2] - E[x]^2 would cancel in fp32; the kernel
    # centres first. The input is a [b, s, h] -> [s, b, h] transposed view.
    x, weight, bias, grad = ln_case((3, 9, 256), torch.float32, offset=1000.0)
    check_layer_norm(x.transpose(0, 1), weight, bias, grad.transpose(0, 1), eps=1e-12)


def test_layer_norm_empty_input():
    x, weight, bias = torch.randn(0, 8), torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    layer_norm(x.requires_grad_(), weight, bias, 1e-5).sum().backward()
    assert torch.all(weight.grad == 0) and torch.all(bias.grad == 0)


def test_layer_norm_gradcheck_float64():
    # The CPU kernel runs fp64 with fp64 math, so gradcheck exercises the kernel itself.
    x, weight, bias, _ = ln_case((3, 2, 5), torch.float64)
    inputs = tuple(t.requires_grad_() for t in (x, weight, bias))
    assert torch.autograd.gradcheck(lambda a, w, b: layer_norm(a, w, b, 1e-5), inputs)


# ---- one build, several instruction sets ----------------------------------------------

_ISA_CHECK = """
import torch
from megabert.fused_kernels import _cpu
from tests.helpers.kernel_checks import (check_cross_entropy_kernels, check_gated_activation, check_layer_norm,
                                         check_rms_norm, check_rope, check_softmax, check_varlen_attention, glu_case,
                                         ln_case, philox_mask_digest, rms_case, rope_case, softmax_case)
check_cross_entropy_kernels()
for dtype in (torch.float32, torch.bfloat16):
    check_softmax(*softmax_case((2, 3, 4, 200), (2, 1, 4, 200), dtype))
    check_layer_norm(*ln_case((5, 2, 776), dtype))
    check_rms_norm(*rms_case((5, 2, 779), dtype))
    for activation in ("silu", "gelu", "gelu_new"):
        check_gated_activation(*glu_case((3, 2, 2 * 77), dtype), activation, dtype == torch.float32)
    for kv_heads in (None, 2):
        check_rope(*rope_case((7, 3), 4, kv_heads, 66, dtype))
for p in (0.0, 0.3):
    check_varlen_attention(torch.float32, p)
print(philox_mask_digest())
print(_cpu.isa())
"""


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_narrower_instruction_sets_agree(isa, tmp_path):
    """MEGABERT_CPU_ISA caps the row kernels' instruction set; each path meets the oracle
    (softmax, LayerNorm, RMSNorm, the gated activations, RoPE (MHA and GQA), varlen attention
    with and without dropout, the MLM loss's log-sum-exp and softmax gradient) and draws the
    same dropout masks as the widest path this CPU runs."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, MEGABERT_CPU_ISA=isa, OMP_NUM_THREADS="2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `-c` imports tests.helpers from the cwd
    run = subprocess.run([sys.executable, "-c", _ISA_CHECK], env=env, capture_output=True, text=True, timeout=120,
                         cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    digest, ran = run.stdout.split()[-2:]
    if ran != isa:
        pytest.skip(f"this CPU cannot run {isa} (ran {ran})")
    # Philox's words do not depend on the vector width: every ISA draws this process's masks.
    assert digest == philox_mask_digest()


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
