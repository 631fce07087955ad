// Torch-facing CPU ops: argument checks, the choice of instruction set (once per
// process), and OpenMP across rows. The arithmetic lives in row_kernels.h.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <omp.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../kernel_ops.h"
#include "kernel_table.h"
#include "torch_dtype.h"

namespace megabert {
namespace cpu {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  // libgcc also checks (XGETBV) that the OS saves the AVX-512 registers.
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

// The widest table this CPU runs, capped by MEGABERT_CPU_ISA or, like torch's own
// kernels, ATEN_CPU_CAPABILITY (default | avx2 | avx512): a way to compare paths
// or to sidestep a suspect one without rebuilding.
const KernelTable& select_table() {
  const char* cap = std::getenv("MEGABERT_CPU_ISA");
  if (cap == nullptr || *cap == '\0') cap = std::getenv("ATEN_CPU_CAPABILITY");
  const std::string limit = cap == nullptr ? "" : cap;
  TORCH_CHECK(limit.empty() || limit == "default" || limit == "avx2" || limit == "avx512",
              "MEGABERT_CPU_ISA / ATEN_CPU_CAPABILITY: expected default, avx2 or avx512, got '", limit, "'");
  const bool allow_avx2 = limit != "default";
  const bool allow_avx512 = limit.empty() || limit == "avx512";
  if (allow_avx512 && cpu_has_avx512() && avx512_table() != nullptr) return *avx512_table();
  if (allow_avx2 && cpu_has_avx2() && avx2_table() != nullptr) return *avx2_table();
  return *default_table();
}

const KernelTable& table() {
  static const KernelTable& chosen = select_table();
  return chosen;
}

void check_input(const at::Tensor& t, const char* what, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, what, " must be ", dtype, ", got ", t.scalar_type());
}

// Runs fn(chunk, begin, end) over at most at::get_num_threads() contiguous chunks of
// [0, n), each at least `grain` long: one fork per op, and one scratch buffer per
// thread rather than per row. Returns the number of chunks.
int64_t num_chunks(int64_t n, int64_t grain) {
  if (n <= 0) return 0;
  if (at::in_parallel_region()) return 1;
  const int64_t by_size = (n + grain - 1) / grain;
  const int64_t threads = at::get_num_threads();
  return by_size < threads ? by_size : threads;
}

template <typename F>
void run_chunks(int64_t n, int64_t chunks, const F& fn) {
  if (chunks <= 1) {
    if (n > 0) fn(0, 0, n);
    return;
  }
  const int64_t per_chunk = (n + chunks - 1) / chunks;
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * per_chunk, end = begin + per_chunk < n ? begin + per_chunk : n;
    if (begin < end) fn(c, begin, end);
  }
}

// ~16K elements per chunk: below that the fork costs more than the work.
int64_t row_grain(int64_t row_len) {
  constexpr int64_t kElementsPerChunk = 1 << 14;
  return row_len >= kElementsPerChunk ? 1 : kElementsPerChunk / (row_len > 0 ? row_len : 1);
}

template <typename F>
void parallel_rows(int64_t rows, int64_t row_len, const F& fn) {
  run_chunks(rows, num_chunks(rows, row_grain(row_len)), fn);
}

at::Tensor scaled_masked_softmax_forward(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale) {
  const Dtype dt = kernel_dtype(x, "scaled_masked_softmax");
  check_input(x, "scores", x.scalar_type());
  TORCH_CHECK(x.dim() == 4, "scores must be [b, heads, sq, sk], got ", x.sizes());
  at::Tensor y = at::empty_like(x);
  SoftmaxFwdArgs args{x.data_ptr(), y.data_ptr(), nullptr, x.size(1), x.size(2), x.size(3), 0, 0, 0, scale};
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool, "mask must be bool (True = masked out), got ", m.scalar_type());
    TORCH_CHECK(m.device().is_cpu(), "mask must be a CPU tensor");
    TORCH_CHECK(m.sizes() == x.sizes(), "mask must be expanded to the scores' shape ", x.sizes(), ", got ",
                m.sizes());
    TORCH_CHECK(m.size(3) <= 1 || m.stride(3) == 1, "mask's last dim must be contiguous");
    args.mask = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
    args.mask_stride_b = m.stride(0);
    args.mask_stride_h = m.stride(1);
    args.mask_stride_q = m.stride(2);
  }
  const int64_t sk = x.size(3), rows = sk == 0 ? 0 : x.numel() / sk;
  const SoftmaxFwdFn fn = table().softmax_fwd[dt];
  parallel_rows(rows, sk, [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  return y;
}

at::Tensor scaled_masked_softmax_backward(const at::Tensor& grad_y, const at::Tensor& y, double scale) {
  const Dtype dt = kernel_dtype(y, "scaled_masked_softmax backward");
  check_input(y, "softmax output", y.scalar_type());
  check_input(grad_y, "softmax output grad", y.scalar_type());
  TORCH_CHECK(grad_y.sizes() == y.sizes(), "grad shape ", grad_y.sizes(), " != output shape ", y.sizes());
  TORCH_CHECK(y.dim() >= 1, "softmax output must have a last dim");
  at::Tensor grad_x = at::empty_like(y);
  const int64_t sk = y.size(-1), rows = sk == 0 ? 0 : y.numel() / sk;
  const SoftmaxBwdArgs args{grad_y.data_ptr(), y.data_ptr(), grad_x.data_ptr(), sk, scale};
  const SoftmaxBwdFn fn = table().softmax_bwd[dt];
  parallel_rows(rows, sk, [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  return grad_x;
}

// The math type of the kernels: fp32 for fp32/bf16 input, fp64 for fp64 (row statistics, partial sums).
at::ScalarType math_type(Dtype dt) { return dt == kDouble ? at::kDouble : at::kFloat; }

// x [..., h] (contiguous) with weight [h] (and bias [h] when given), one dtype -> (rows, h).
std::pair<int64_t, int64_t> check_norm_input(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                                             const char* what) {
  check_input(x, "input", x.scalar_type());
  check_input(weight, "weight", x.scalar_type());
  if (bias != nullptr) check_input(*bias, "bias", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, what, " input must have a last dim");
  const int64_t h = x.size(-1), rows = h == 0 ? 0 : x.numel() / h;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && (bias == nullptr || bias->sizes() == weight.sizes()),
              what, ": weight (and bias) must be [", h, "], got ", weight.sizes());
  return {rows, h};
}

// Runs fn(begin, end, partial, stride) over chunks of the rows, where `partial` points at this
// chunk's row of h partial sums of the first weight-shaped gradient (math type, zeroed) and
// `stride` bytes further on lie the next gradient's, `count` in all; returns their sums over
// the chunks, shaped and typed as `weight`. One row of partial sums per chunk, summed after:
// no atomics, and the result does not depend on thread timing (the chunking depends only on
// the shape and the thread count).
template <typename F>
std::vector<at::Tensor> weight_grad_sums(int64_t rows, const at::Tensor& weight, int64_t count, Dtype dt,
                                         const F& fn) {
  const int64_t h = weight.numel();
  const int64_t chunks = num_chunks(rows, row_grain(h)), parts = chunks > 0 ? chunks : 1;
  at::Tensor partial = at::zeros({count, parts, h}, weight.options().dtype(math_type(dt)));  // [grad, chunk, h]
  char* base = static_cast<char*>(partial.data_ptr());
  const int64_t part_bytes = h * partial.element_size(), stride = parts * part_bytes;
  run_chunks(rows, chunks,
             [&](int64_t c, int64_t begin, int64_t end) { fn(begin, end, base + c * part_bytes, stride); });
  std::vector<at::Tensor> sums;
  for (int64_t k = 0; k < count; ++k) {
    sums.push_back(at::empty_like(weight));
    table().layer_norm_bwd_reduce[dt](base + k * stride, parts, h, sums.back().data_ptr());
  }
  return sums;
}

std::vector<at::Tensor> layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                           double eps) {
  const Dtype dt = kernel_dtype(x, "layer_norm");
  const auto [rows, h] = check_norm_input(x, weight, &bias, "layer_norm");
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rows}, x.options().dtype(math_type(dt)));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(math_type(dt)));
  const LayerNormFwdArgs args{x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(),
                              mean.data_ptr(), rstd.data_ptr(), h, eps};
  const LayerNormFwdFn fn = table().layer_norm_fwd[dt];
  parallel_rows(rows, h, [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  return {y, mean, rstd};
}

// The saved row statistics of a norm's backward: `what` [rows] in the math type.
void check_row_stat(const at::Tensor& stat, const char* what, int64_t rows, Dtype dt) {
  check_input(stat, what, math_type(dt));
  TORCH_CHECK(stat.numel() == rows, what, " must have ", rows, " elements (one per row), got ", stat.numel());
}

std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& mean, const at::Tensor& rstd) {
  const Dtype dt = kernel_dtype(x, "layer_norm backward");
  const auto [rows, h] = check_norm_input(x, weight, nullptr, "layer_norm backward");
  check_input(grad_y, "output grad", x.scalar_type());
  TORCH_CHECK(grad_y.sizes() == x.sizes(), "grad shape ", grad_y.sizes(), " != input shape ", x.sizes());
  check_row_stat(mean, "mean", rows, dt);
  check_row_stat(rstd, "rstd", rows, dt);
  at::Tensor grad_x = at::empty_like(x);
  const LayerNormBwdArgs args{grad_y.data_ptr(), x.data_ptr(),    weight.data_ptr(), mean.data_ptr(),
                              rstd.data_ptr(),   grad_x.data_ptr(), h};
  const LayerNormBwdFn fn = table().layer_norm_bwd[dt];
  std::vector<at::Tensor> grads = weight_grad_sums(
      rows, weight, 2, dt, [&](int64_t begin, int64_t end, char* partial, int64_t stride) {
        fn(args, begin, end, partial, partial + stride);  // [grad_w | grad_b]
      });
  return {grad_x, grads[0], grads[1]};
}

// Elementwise ops: ~16K elements per chunk (row_grain), chunk edges on whole Philox
// tiles. The mask does not depend on the split (dropout_kernels.h); the tiles only
// spare a chunk edge from drawing a tile twice.
template <typename F>
void parallel_elements(int64_t n, const F& fn) {
  constexpr int64_t kTileElements = 64;
  const int64_t tiles = (n + kTileElements - 1) / kTileElements;
  run_chunks(tiles, num_chunks(tiles, row_grain(kTileElements)), [&](int64_t c, int64_t begin, int64_t end) {
    fn(c, begin * kTileElements, end * kTileElements < n ? end * kTileElements : n);
  });
}

}  // namespace

const KernelTable& selected_table() { return table(); }

Dtype kernel_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return kFloat;
    case at::kBFloat16:
      return kBFloat16;
    case at::kDouble:
      return kDouble;
    default:
      TORCH_CHECK(false, what, ": the CPU kernel takes float32, bfloat16 or float64, got ", t.scalar_type());
  }
}

std::vector<at::Tensor> dropout_add_forward(const at::Tensor& x, const at::Tensor& residual, double p,
                                            const at::Tensor& seed) {
  const Dtype dt = kernel_dtype(x, "dropout_add");
  check_input(x, "input", x.scalar_type());
  check_input(residual, "residual", x.scalar_type());
  TORCH_CHECK(x.sizes() == residual.sizes(), "dropout_add: input ", x.sizes(), " and residual ", residual.sizes(),
              " must have one shape");
  TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout_add: p must be in [0, 1), got ", p);
  TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1,
              "dropout_add: seed must be one int64 on the CPU, got ", seed.scalar_type(), " ", seed.sizes());
  at::Tensor out = at::empty_like(x);
  at::Tensor mask = at::empty(x.sizes(), x.options().dtype(at::kBool));
  // P(keep) = 1 - threshold / 2^32: p to within 2^-32.
  const double scaled = p * 4294967296.0;
  const uint32_t threshold = scaled >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(scaled + 0.5);
  const DropoutAddFwdArgs args{x.data_ptr(),
                               residual.data_ptr(),
                               out.data_ptr(),
                               reinterpret_cast<uint8_t*>(mask.data_ptr<bool>()),
                               static_cast<uint64_t>(*seed.data_ptr<int64_t>()),
                               threshold,
                               1.0 / (1.0 - p)};
  const DropoutAddFwdFn fn = table().dropout_add_fwd[dt];
  parallel_elements(x.numel(), [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  return {out, mask};
}

at::Tensor dropout_backward(const at::Tensor& grad, const at::Tensor& mask, double p) {
  const Dtype dt = kernel_dtype(grad, "dropout_add backward");
  check_input(grad, "output grad", grad.scalar_type());
  check_input(mask, "mask", at::kBool);
  TORCH_CHECK(grad.sizes() == mask.sizes(), "grad shape ", grad.sizes(), " != mask shape ", mask.sizes());
  at::Tensor grad_x = at::empty_like(grad);
  const DropoutBwdArgs args{grad.data_ptr(), reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()),
                            grad_x.data_ptr(), 1.0 / (1.0 - p)};
  const DropoutBwdFn fn = table().dropout_bwd[dt];
  parallel_elements(grad.numel(), [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  return grad_x;
}

at::Tensor cross_entropy_lse(const std::vector<at::Tensor>& chunks) {
  TORCH_CHECK(!chunks.empty(), "cross_entropy_lse: no logit chunks");
  const at::Tensor& first = chunks.front();
  const Dtype dt = kernel_dtype(first, "cross_entropy_lse");
  TORCH_CHECK(first.dim() == 2, "logit chunks must be [rows, columns], got ", first.sizes());
  const int64_t rows = first.size(0);
  std::vector<const void*> ptrs;
  std::vector<int64_t> widths;
  for (const at::Tensor& c : chunks) {
    check_input(c, "logit chunk", first.scalar_type());
    TORCH_CHECK(c.dim() == 2 && c.size(0) == rows, "logit chunks must all be [", rows, ", columns], got ", c.sizes());
    ptrs.push_back(c.data_ptr());
    widths.push_back(c.size(1));
  }
  at::Tensor lse = at::empty({rows}, first.options().dtype(math_type(dt)));
  const CeLseArgs args{ptrs.data(), widths.data(), static_cast<int64_t>(chunks.size()), lse.data_ptr()};
  int64_t width = 0;
  for (int64_t w : widths) width += w;
  const CeLseFn fn = table().ce_lse[dt];
  parallel_rows(rows, width, [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  return lse;
}

void cross_entropy_grad(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& g, at::Tensor& out) {
  const Dtype dt = kernel_dtype(logits, "cross_entropy_grad");
  check_input(logits, "logit chunk", logits.scalar_type());
  TORCH_CHECK(logits.dim() == 2, "logit chunk must be [rows, columns], got ", logits.sizes());
  const at::ScalarType math = math_type(dt);
  check_input(lse, "lse", math);
  check_input(g, "row grads", math);
  const int64_t rows = logits.size(0), c = logits.size(1);
  TORCH_CHECK(lse.numel() == rows && g.numel() == rows, "lse and row grads must have ", rows, " elements");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == logits.scalar_type() && out.sizes() == logits.sizes() &&
                  (c <= 1 || out.stride(1) == 1),
              "out must be a CPU ", logits.scalar_type(), " tensor of shape ", logits.sizes(),
              " with contiguous rows, got ", out.sizes());
  const CeGradArgs args{logits.data_ptr(), lse.data_ptr(), g.data_ptr(), out.data_ptr(), c, out.stride(0)};
  const CeGradFn fn = table().ce_grad[dt];
  parallel_rows(rows, c, [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
}

std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const Dtype dt = kernel_dtype(x, "rms_norm");
  const auto [rows, h] = check_norm_input(x, weight, nullptr, "rms_norm");
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(math_type(dt)));
  const LayerNormFwdArgs args{x.data_ptr(), weight.data_ptr(), nullptr, y.data_ptr(), nullptr, rstd.data_ptr(), h, eps};
  const LayerNormFwdFn fn = table().rms_norm_fwd[dt];
  parallel_rows(rows, h, [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  return {y, rstd};
}

std::vector<at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& rstd) {
  const Dtype dt = kernel_dtype(x, "rms_norm backward");
  const auto [rows, h] = check_norm_input(x, weight, nullptr, "rms_norm backward");
  check_input(grad_y, "output grad", x.scalar_type());
  TORCH_CHECK(grad_y.sizes() == x.sizes(), "grad shape ", grad_y.sizes(), " != input shape ", x.sizes());
  check_row_stat(rstd, "rstd", rows, dt);
  at::Tensor grad_x = at::empty_like(x);
  const LayerNormBwdArgs args{grad_y.data_ptr(), x.data_ptr(), weight.data_ptr(), nullptr, rstd.data_ptr(),
                              grad_x.data_ptr(), h};
  const LayerNormBwdFn fn = table().rms_norm_bwd[dt];
  std::vector<at::Tensor> grads =
      weight_grad_sums(rows, weight, 1, dt, [&](int64_t begin, int64_t end, char* partial, int64_t) {
        fn(args, begin, end, partial, nullptr);  // no bias
      });
  return {grad_x, grads[0]};
}

namespace {

GluAct glu_act(const std::string& activation) {
  if (activation == "silu") return kSilu;
  if (activation == "gelu") return kGeluErf;
  TORCH_CHECK(activation == "gelu_tanh", "gated_activation: activation must be silu, gelu or gelu_tanh, got '",
              activation, "'");
  return kGeluTanh;
}

// u [..., 2f] contiguous -> f.
int64_t glu_width(const at::Tensor& u, const char* what) {
  check_input(u, what, u.scalar_type());
  TORCH_CHECK(u.dim() >= 1 && u.size(-1) % 2 == 0, what, " must be [..., 2f] ([input; gate]), got ", u.sizes());
  return u.size(-1) / 2;
}

}  // namespace

at::Tensor gated_activation_forward(const at::Tensor& u, const std::string& activation, bool gate_first) {
  const Dtype dt = kernel_dtype(u, "gated_activation");
  const int64_t f = glu_width(u, "up-projection output");
  std::vector<int64_t> shape = u.sizes().vec();
  shape.back() = f;
  at::Tensor y = at::empty(shape, u.options());
  const int64_t rows = f == 0 ? 0 : y.numel() / f;
  const GluArgs args{u.data_ptr(), nullptr, y.data_ptr(), f, gate_first ? 1 : 0, glu_act(activation)};
  const GluFn fn = table().glu_fwd[dt];
  parallel_rows(rows, 2 * f, [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  return y;
}

at::Tensor gated_activation_backward(const at::Tensor& grad_y, const at::Tensor& u, const std::string& activation,
                                     bool gate_first) {
  const Dtype dt = kernel_dtype(u, "gated_activation backward");
  const int64_t f = glu_width(u, "up-projection output");
  check_input(grad_y, "output grad", u.scalar_type());
  TORCH_CHECK(grad_y.dim() == u.dim() && grad_y.size(-1) == f && grad_y.numel() * 2 == u.numel(),
              "gated_activation backward: grad ", grad_y.sizes(), " does not match the input ", u.sizes());
  at::Tensor grad_u = at::empty_like(u);
  const int64_t rows = f == 0 ? 0 : grad_y.numel() / f;
  const GluArgs args{u.data_ptr(), grad_y.data_ptr(), grad_u.data_ptr(), f, gate_first ? 1 : 0,
                     glu_act(activation)};
  const GluFn fn = table().glu_bwd[dt];
  parallel_rows(rows, 2 * f, [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
  return grad_u;
}

namespace {

// cos, sin [rows, d / 2] of the element type, rows equally far apart in both, each row contiguous.
void check_rope_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t rows, int64_t half,
                       at::ScalarType dtype) {
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype, "rope_qkv: cos and sin must be CPU ", dtype,
                " tensors, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == half && (half <= 1 || t->stride(1) == 1),
                "rope_qkv: cos and sin must be [", rows, ", ", half, "] with contiguous rows, got ", t->sizes());
  }
  TORCH_CHECK(rows <= 1 || cos.stride(0) == sin.stride(0), "rope_qkv: cos and sin must have one row stride");
}

void run_rope(const RopeArgs& args, Dtype dt, bool backward, int64_t rows) {
  const RopeFn fn = backward ? table().rope_bwd[dt] : table().rope_fwd[dt];
  parallel_rows(rows, 6 * args.heads * args.half, [&](int64_t, int64_t begin, int64_t end) { fn(args, begin, end); });
}

}  // namespace

at::Tensor rope_qkv_forward(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& cos, const at::Tensor& sin) {
  const Dtype dt = kernel_dtype(q, "rope_qkv");
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu() && kv.scalar_type() == q.scalar_type(),
              "rope_qkv: q and kv must be CPU tensors of one dtype");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 4 && kv.size(0) == q.size(0) && kv.size(1) == 2 &&
                  kv.size(3) == q.size(2) && kv.size(2) > 0 && q.size(1) % kv.size(2) == 0 && q.size(2) % 2 == 0,
              "rope_qkv: q must be [rows, heads, d] and kv [rows, 2, kv_heads, d] with kv_heads dividing heads "
              "and d even, got ", q.sizes(), " and ", kv.sizes());
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK((d <= 1 || (q.stride(2) == 1 && kv.stride(3) == 1)), "rope_qkv: each head's d must be contiguous");
  check_rope_tables(cos, sin, rows, d / 2, q.scalar_type());
  at::Tensor out = at::empty({rows, 3, heads, d}, q.options());
  const RopeArgs args{q.data_ptr(), kv.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), cos.stride(0),
                      heads, heads / kv.size(2), d / 2};
  run_rope(args, dt, false, rows);
  return out;
}

at::Tensor rope_qkv_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                             int64_t kv_heads) {
  const Dtype dt = kernel_dtype(grad, "rope_qkv backward");
  check_input(grad, "rope_qkv output grad", grad.scalar_type());
  TORCH_CHECK(grad.dim() == 4 && grad.size(1) == 3 && grad.size(3) % 2 == 0 && kv_heads > 0 &&
                  grad.size(2) % kv_heads == 0,
              "rope_qkv backward: grad must be [rows, 3, heads, d] with ", kv_heads, " dividing heads, got ",
              grad.sizes());
  const int64_t rows = grad.size(0), heads = grad.size(2), d = grad.size(3), width = (heads + 2 * kv_heads) * d;
  check_rope_tables(cos, sin, rows, d / 2, grad.scalar_type());
  // [rows, heads + 2 kv_heads, d]: each row's grad of q, then of k and v.
  at::Tensor packed = at::empty({rows, heads + 2 * kv_heads, d}, grad.options());
  char* base = static_cast<char*>(packed.data_ptr());
  const RopeArgs args{base, base + heads * d * packed.element_size(), grad.data_ptr(), cos.data_ptr(),
                      sin.data_ptr(), width, d, width, kv_heads * d, d, cos.stride(0), heads, heads / kv_heads,
                      d / 2};
  run_rope(args, dt, true, rows);
  return packed;
}

std::string isa() { return table().isa; }

const KernelOps& kernel_ops() {
  static const KernelOps ops{&scaled_masked_softmax_forward, &scaled_masked_softmax_backward, &layer_norm_forward,
                             &layer_norm_backward};
  return ops;
}

}  // namespace cpu
}  // namespace megabert
