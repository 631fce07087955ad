// CPU ops exposed to Python as megabert.fused_kernels._cpu (see bindings.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace megabert {
namespace cpu {

// The instruction set the row kernels run with: "avx512", "avx2" or "default".
std::string isa();

// scores: [b, heads, sq, sk] contiguous; mask: bool expanded (a view is enough) to the
// scores' shape, last dim contiguous, True = masked out.
at::Tensor scaled_masked_softmax_forward(const at::Tensor& scores, const std::optional<at::Tensor>& mask,
                                         double scale);
at::Tensor scaled_masked_softmax_backward(const at::Tensor& grad_probs, const at::Tensor& probs, double scale);

// x: [..., h] contiguous. Returns {y, mean, rstd}; mean and rstd are [rows] in the math type.
std::vector<at::Tensor> layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                           double eps);
// Returns {grad_x, grad_weight, grad_bias}.
std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& mean, const at::Tensor& rstd);

}  // namespace cpu
}  // namespace megabert
