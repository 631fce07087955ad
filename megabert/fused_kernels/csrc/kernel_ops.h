// The ops both extension modules export (megabert.fused_kernels._cpu and _cuda), with
// the same names and signatures so that megabert.ops drives either alike: each backend
// fills one KernelOps, and def_kernel_ops (bind_kernel_ops.h) puts it on its module.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace megabert {

struct KernelOps {
  // softmax(scale * scores) over the last dim with masked keys excluded; a fully masked
  // row gives zeros. scores: [b, heads, sq, sk] contiguous; mask: bool, expanded (a view
  // is enough) to the scores' shape with its last dim contiguous, True = masked out.
  at::Tensor (*scaled_masked_softmax_forward)(const at::Tensor& scores, const std::optional<at::Tensor>& mask,
                                              double scale);
  // grad of the scores from the grad of the probabilities and the probabilities.
  at::Tensor (*scaled_masked_softmax_backward)(const at::Tensor& grad_probs, const at::Tensor& probs, double scale);
  // LayerNorm over the last dim of x [..., h] (contiguous) -> {y, mean, rstd}; mean and
  // rstd are [rows] in the math type (fp32, or fp64 for fp64 input). CPU only: the CUDA
  // module leaves both LayerNorm entries null (PyTorch's LayerNorm won there).
  std::vector<at::Tensor> (*layer_norm_forward)(const at::Tensor& x, const at::Tensor& weight,
                                                const at::Tensor& bias, double eps);
  // -> {grad_x, grad_weight, grad_bias}
  std::vector<at::Tensor> (*layer_norm_backward)(const at::Tensor& grad_y, const at::Tensor& x,
                                                 const at::Tensor& weight, const at::Tensor& mean,
                                                 const at::Tensor& rstd);
};

namespace cpu {
const KernelOps& kernel_ops();
// The instruction set the row kernels run with: "avx512", "avx2" or "default".
std::string isa();
// CPU only (CUDA keeps PyTorch's dropout): residual + dropout(x, p) -> {out, keep mask
// (bool)}, the mask from Philox4x32-10 keyed by `seed` (one int64 tensor, drawn from a torch
// generator: read here rather than in Python, which would count as a host sync); x,
// residual contiguous, one shape.
std::vector<at::Tensor> dropout_add_forward(const at::Tensor& x, const at::Tensor& residual, double p,
                                            const at::Tensor& seed);
// grad of dropout's input: mask * grad / (1 - p).
at::Tensor dropout_backward(const at::Tensor& grad, const at::Tensor& mask, double p);
// Attention over real tokens: q, k, v [T, heads, d] (token stride free), sequence s is
// tokens cu_seqlens[s] .. cu_seqlens[s + 1] (int64) -> {out [T, heads, d], lse [heads, T]};
// dropout p > 0 draws its mask from Philox keyed by `seed` (one int64), inside the kernel.
// Query i sees the keys i - window_left .. i + window_right of its sequence (FlashAttention's
// window_size, -1 = unbounded): key tiles outside the window are skipped.
std::vector<at::Tensor> varlen_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& cu_seqlens, double scale, double p,
                                                 const std::optional<at::Tensor>& seed, int64_t window_left,
                                                 int64_t window_right);
// -> grad of the packed [T, 3, heads, d] (dq, dk, dv), the dropout mask regenerated from `seed`.
at::Tensor varlen_attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                     const at::Tensor& cu_seqlens, double scale, double p,
                                     const std::optional<at::Tensor>& seed, int64_t window_left,
                                     int64_t window_right);
// The keep mask the kernels draw, bool [sequences, heads, max_len, max_len] (False outside
// each sequence): for tests.
at::Tensor varlen_attention_dropout_mask(const at::Tensor& cu_seqlens, int64_t heads, double p,
                                         const at::Tensor& seed);
// Cross entropy over column chunks of logits ([rows, c_i] each, contiguous): each row's
// log-sum-exp over all of them -> lse [rows] (fp32, fp64 for fp64 logits).
at::Tensor cross_entropy_lse(const std::vector<at::Tensor>& chunks);
// out = exp(logits - lse) * g for one chunk (lse, g [rows] as cross_entropy_lse returns;
// out [rows, c] with contiguous rows, e.g. a column slice of a wider scratch).
void cross_entropy_grad(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& g, at::Tensor& out);
// RMSNorm over the last dim of x [..., h] (contiguous), weight [h] of x's dtype, as
// transformers' Llama-family RMSNorm: fp32 math (fp64 for fp64), the normalised value rounded
// to x's dtype before the weight multiplies it -> {y, rstd [rows] in the math type}.
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps);
// -> {grad_x, grad_weight}
std::vector<at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& rstd);
// The gated MLP's act(input) * gate from the up-projection's output u [..., 2f] (contiguous),
// whose halves are [input; gate] ([gate; input] with gate_first) -> y [..., f]; activation:
// silu, gelu (exact, erf) or gelu_tanh.
at::Tensor gated_activation_forward(const at::Tensor& u, const std::string& activation, bool gate_first);
// -> grad_u [..., 2f], both halves written in one pass.
at::Tensor gated_activation_backward(const at::Tensor& grad_y, const at::Tensor& u, const std::string& activation,
                                     bool gate_first);
// The attention's input [rows, 3, heads, d] from q [rows, heads, d] and kv [rows, 2, kv_heads, d]
// (strided views: each head's d contiguous): Q and K rotated by cos, sin [rows, d / 2]
// (rotate-half RoPE, fp32 math, fp64 for fp64), each query head beside its group's K and V.
at::Tensor rope_qkv_forward(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& cos, const at::Tensor& sin);
// -> [rows, heads + 2 kv_heads, d]: per row the grads of q, then of k and v (group sums).
at::Tensor rope_qkv_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                             int64_t kv_heads);
}  // namespace cpu

namespace cuda {
const KernelOps& kernel_ops();
}  // namespace cuda

}  // namespace megabert
