// CUDA ops exposed to Python as megabert.fused_kernels._cuda (see bindings.cpp); the
// same signatures as the CPU ops (csrc/cpu/ops.h), so megabert.ops calls either alike.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace megabert {
namespace cuda {

// scores: [b, heads, sq, sk] contiguous, sk <= 4096, fp32/fp16/bf16; mask: bool expanded
// (a view is enough) to the scores' shape, last dim contiguous, True = masked out.
at::Tensor scaled_masked_softmax_forward(const at::Tensor& scores, const std::optional<at::Tensor>& mask,
                                         double scale);
at::Tensor scaled_masked_softmax_backward(const at::Tensor& grad_probs, const at::Tensor& probs, double scale);

// x: [..., h] contiguous, h <= 8192. Returns {y, mean, rstd}; mean and rstd are [rows] fp32.
std::vector<at::Tensor> layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                           double eps);
// Returns {grad_x, grad_weight, grad_bias}.
std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& mean, const at::Tensor& rstd);

}  // namespace cuda
}  // namespace megabert
