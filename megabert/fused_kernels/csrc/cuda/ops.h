// The CUDA ops, defined in softmax.cu and gathered into cuda::kernel_ops() by
// bindings.cpp. Their contracts are KernelOps' (../kernel_ops.h); the CUDA limits:
// sk <= 4096, fp32 / fp16 / bf16. No LayerNorm: ours measured 0.70-0.73x of PyTorch's on
// H100 and H200 (docs/performance.md), so CUDA runs PyTorch's and the kernel was deleted
// (issue 41).
#pragma once

#include "../kernel_ops.h"

namespace megabert {
namespace cuda {

at::Tensor scaled_masked_softmax_forward(const at::Tensor&, const std::optional<at::Tensor>&, double);
at::Tensor scaled_masked_softmax_backward(const at::Tensor&, const at::Tensor&, double);

}  // namespace cuda
}  // namespace megabert
