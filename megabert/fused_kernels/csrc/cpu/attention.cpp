// Torch-facing CPU attention over real tokens (varlen): argument checks, the Philox key,
// and the parallel loop over (sequence, head) pairs. The arithmetic lives in
// attention_kernels.h (compiled per instruction set).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "../kernel_ops.h"
#include "kernel_table.h"
#include "torch_dtype.h"

namespace megabert {
namespace cpu {
namespace {

// q, k, v (and their grads): [T, heads, d] with each head's d elements contiguous and the
// heads of a token next to each other; the token stride is free (views of packed QKV).
void check_heads(const at::Tensor& t, const char* what, const at::Tensor& like) {
  TORCH_CHECK(t.device().is_cpu(), "varlen attention: ", what, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "varlen attention: ", what, " must be ", like.scalar_type(),
              ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 3 && t.sizes() == like.sizes(), "varlen attention: ", what, " must be [T, heads, d] ",
              like.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.size(2) <= 1 || t.stride(2) == 1, "varlen attention: ", what, "'s head dim must be contiguous");
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == t.size(2), "varlen attention: ", what,
              "'s heads must be adjacent (stride d)");
}

struct Plan {
  std::vector<int64_t> order;  // work items of the non-empty sequences, longest first
  int64_t max_len = 0;
};

Plan plan_items(const at::Tensor& cu_seqlens, int64_t total, int64_t heads) {
  TORCH_CHECK(cu_seqlens.device().is_cpu() && cu_seqlens.scalar_type() == at::kLong && cu_seqlens.dim() == 1 &&
                  cu_seqlens.size(0) >= 1 && cu_seqlens.is_contiguous(),
              "varlen attention: cu_seqlens must be a contiguous 1-D int64 CPU tensor [sequences + 1]");
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t seqs = cu_seqlens.size(0) - 1;
  TORCH_CHECK(cu[0] == 0 && cu[seqs] == total, "varlen attention: cu_seqlens must run from 0 to T = ", total,
              ", got ", cu[0], " .. ", cu[seqs]);
  Plan plan;
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(cu[s + 1] >= cu[s], "varlen attention: cu_seqlens must not decrease");
    plan.max_len = std::max(plan.max_len, cu[s + 1] - cu[s]);
  }
  // Philox counters hold the item in 32 bits and a row in 32 bits.
  TORCH_CHECK(seqs * heads < (int64_t(1) << 32), "varlen attention: too many (sequence, head) pairs");
  // An empty sequence (a repeated cu_seqlens value) has no work item: the kernels take len >= 1.
  for (int64_t item = 0; item < seqs * heads; ++item)
    if (cu[item / heads + 1] > cu[item / heads]) plan.order.push_back(item);
  // Longest first, then dynamic scheduling: the cost of an item grows as len^2.
  std::stable_sort(plan.order.begin(), plan.order.end(), [&](int64_t a, int64_t b) {
    return cu[a / heads + 1] - cu[a / heads] > cu[b / heads + 1] - cu[b / heads];
  });
  return plan;
}

struct DropoutKey {
  int dropout = 0;
  uint64_t seed = 0;
  uint32_t threshold = 0;
  double keep_scale = 1.0;
};

DropoutKey dropout_key(double p, const std::optional<at::Tensor>& seed) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "varlen attention: dropout p must be in [0, 1), got ", p);
  DropoutKey key;
  if (p == 0.0) return key;
  TORCH_CHECK(seed.has_value() && seed->device().is_cpu() && seed->scalar_type() == at::kLong && seed->numel() == 1,
              "varlen attention: dropout needs a seed: one int64 on the CPU");
  key.dropout = 1;
  key.seed = static_cast<uint64_t>(*seed->data_ptr<int64_t>());
  // P(keep) = 1 - threshold / 2^32, as dropout_add.
  const double scaled = p * 4294967296.0;
  key.threshold = scaled >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(scaled + 0.5);
  key.keep_scale = 1.0 / (1.0 - p);
  return key;
}

// FlashAttention's window_size: -1 = unbounded, else the keys seen on that side.
void check_window(int64_t left, int64_t right) {
  TORCH_CHECK(left >= -1 && right >= -1, "varlen attention: window (", left, ", ", right,
              ") must hold -1 (unbounded) or key counts >= 0");
}

at::ScalarType math_type(Dtype dt) { return dt == kDouble ? at::kDouble : at::kFloat; }

// What both passes check and read of a call: q, k, v alike, the sequences (and the order of
// their work items), the dropout key and the window.
struct AttnCall {
  Dtype dt;
  Plan plan;
  AttnArgs args;
};

AttnCall attn_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                   double scale, double p, const std::optional<at::Tensor>& seed, int64_t window_left,
                   int64_t window_right) {
  const Dtype dt = kernel_dtype(q, "varlen attention");
  check_heads(q, "q", q);
  check_heads(k, "k", q);
  check_heads(v, "v", q);
  const int64_t total = q.size(0), heads = q.size(1);
  Plan plan = plan_items(cu_seqlens, total, heads);
  const DropoutKey key = dropout_key(p, seed);
  check_window(window_left, window_right);
  const AttnArgs args{q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
                      cu_seqlens.data_ptr<int64_t>(), total, heads, q.size(2), scale, key.dropout, key.seed,
                      key.threshold, key.keep_scale, window_left, window_right};
  return {dt, std::move(plan), args};
}

// Runs fn(args, item, scratch) over the call's work items: dynamic scheduling across threads,
// one scratch buffer of `scratch`(max_len, d) math-type elements per thread. An item's result
// does not depend on which thread runs it.
template <typename Args>
void run_items(const AttnCall& call, void (*fn)(const Args&, int64_t, void*), AttnScratchFn scratch,
               const Args& args, const at::TensorOptions& math) {
  const std::vector<int64_t>& order = call.plan.order;
  const int64_t n = static_cast<int64_t>(order.size());
  if (n == 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  const int64_t scratch_elems = scratch(call.plan.max_len, call.args.head_dim);
  at::Tensor buffers = at::empty({threads, scratch_elems}, math);
  char* base = static_cast<char*>(buffers.data_ptr());
  const int64_t bytes = scratch_elems * buffers.element_size();
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(args, order[i], base);
    return;
  }
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) fn(args, order[i], base + omp_get_thread_num() * bytes);
}

}  // namespace

std::vector<at::Tensor> varlen_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& cu_seqlens, double scale, double p,
                                                 const std::optional<at::Tensor>& seed, int64_t window_left,
                                                 int64_t window_right) {
  const AttnCall call = attn_call(q, k, v, cu_seqlens, scale, p, seed, window_left, window_right);
  const int64_t total = call.args.total, heads = call.args.heads, d = call.args.head_dim;
  at::Tensor out = at::empty({total, heads, d}, q.options());
  const at::TensorOptions math = q.options().dtype(math_type(call.dt));
  at::Tensor lse = at::empty({heads, total}, math);
  const AttnFwdArgs args{call.args, out.data_ptr(), lse.data_ptr()};
  const KernelTable& t = selected_table();
  run_items(call, t.attn_fwd[call.dt], t.attn_fwd_scratch[call.dt], args, math);
  return {out, lse};
}

at::Tensor varlen_attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                     const at::Tensor& cu_seqlens, double scale, double p,
                                     const std::optional<at::Tensor>& seed, int64_t window_left,
                                     int64_t window_right) {
  const AttnCall call = attn_call(q, k, v, cu_seqlens, scale, p, seed, window_left, window_right);
  check_heads(out, "out", q);
  check_heads(grad_out, "grad_out", q);
  TORCH_CHECK(out.is_contiguous() && grad_out.is_contiguous(), "varlen attention: out and grad_out must be contiguous");
  const int64_t total = call.args.total, heads = call.args.heads, d = call.args.head_dim;
  TORCH_CHECK(lse.scalar_type() == math_type(call.dt) && lse.is_contiguous() && lse.dim() == 2 &&
                  lse.size(0) == heads && lse.size(1) == total,
              "varlen attention: lse must be the forward's [heads, T] statistics");
  // One buffer for the three grads: [T, 3, heads, d] is the grad of the packed QKV as is.
  at::Tensor grad = at::empty({total, 3, heads, d}, q.options());
  char* g = static_cast<char*>(grad.data_ptr());
  const int64_t head_bytes = heads * d * grad.element_size();
  const int64_t gs = 3 * heads * d;
  const AttnBwdArgs args{call.args, out.data_ptr(), grad_out.data_ptr(), lse.data_ptr(), g, g + head_bytes,
                         g + 2 * head_bytes, gs, gs, gs};
  const KernelTable& t = selected_table();
  run_items(call, t.attn_bwd[call.dt], t.attn_bwd_scratch[call.dt], args, q.options().dtype(math_type(call.dt)));
  return grad;
}

at::Tensor varlen_attention_dropout_mask(const at::Tensor& cu_seqlens, int64_t heads, double p, const at::Tensor& seed) {
  const int64_t seqs = cu_seqlens.numel() - 1;
  TORCH_CHECK(seqs >= 0, "varlen attention: cu_seqlens must hold at least one entry");
  const Plan plan = plan_items(cu_seqlens, cu_seqlens.data_ptr<int64_t>()[seqs], heads);
  const DropoutKey key = dropout_key(p, seed);
  TORCH_CHECK(key.dropout, "varlen attention: the dropout mask needs p > 0");
  const int64_t s = plan.max_len;
  at::Tensor mask = at::zeros({seqs, heads, s, s}, cu_seqlens.options().dtype(at::kBool));
  AttnArgs args{};
  args.cu_seqlens = cu_seqlens.data_ptr<int64_t>();
  args.heads = heads;
  args.seed = key.seed;
  args.threshold = key.threshold;
  const int64_t* cu = args.cu_seqlens;
  std::vector<uint8_t> buf(s * s);
  for (int64_t item = 0; item < seqs * heads; ++item) {
    const int64_t len = cu[item / heads + 1] - cu[item / heads];
    selected_table().attn_mask[kFloat](args, item, buf.data());
    uint8_t* dst = reinterpret_cast<uint8_t*>(mask.data_ptr<bool>()) + item * s * s;
    for (int64_t r = 0; r < len; ++r) std::copy(buf.data() + r * len, buf.data() + (r + 1) * len, dst + r * s);
  }
  return mask;
}

}  // namespace cpu
}  // namespace megabert
