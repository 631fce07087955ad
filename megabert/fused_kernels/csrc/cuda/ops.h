// The CUDA ops, defined in softmax.cu and layer_norm.cu and gathered into
// cuda::kernel_ops() by bindings.cpp. Their contracts are KernelOps' (../kernel_ops.h);
// the CUDA limits: sk <= 4096 and h <= 8192, fp32 / fp16 / bf16.
#pragma once

#include "../kernel_ops.h"

namespace megabert {
namespace cuda {

at::Tensor scaled_masked_softmax_forward(const at::Tensor&, const std::optional<at::Tensor>&, double);
at::Tensor scaled_masked_softmax_backward(const at::Tensor&, const at::Tensor&, double);
std::vector<at::Tensor> layer_norm_forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
std::vector<at::Tensor> layer_norm_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&);

}  // namespace cuda
}  // namespace megabert
