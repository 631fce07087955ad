// The interface between the torch-facing CPU ops (ops.cpp) and the row kernels
// (row_kernels.h and the headers it includes), which are compiled once per instruction set (isa_*.cpp).
//
// NOTE: nothing here includes a torch header. The row kernels are compiled under
// `#pragma GCC target("avx512f,...")`; had they included torch's inline functions,
// the linker could keep an AVX-512 copy of one of those for the whole library and
// the extension would crash on a CPU without AVX-512. Raw pointers and plain
// structs keep the instruction-set-specific code sealed off.
#pragma once

#include <cstdint>

namespace megabert {
namespace cpu {

// bfloat16 as stored: the upper 16 bits of an IEEE float.
struct bf16_t {
  uint16_t bits;
};

// Element types the CPU kernels take; the math is fp32 for fp32/bf16 and fp64 for fp64.
enum Dtype : int { kFloat = 0, kBFloat16 = 1, kDouble = 2, kNumDtypes = 3 };

// softmax(scale * x) over the last dim of x [b, heads, sq, sk] (contiguous), with
// positions where mask != 0 excluded. The mask is read through strides so that any
// broadcast ([b|1, 1|heads, sq|1, sk]) costs no copy; its last dim is contiguous.
struct SoftmaxFwdArgs {
  const void* x;
  void* y;
  const uint8_t* mask;  // nullptr: nothing masked
  int64_t heads, sq, sk;
  int64_t mask_stride_b, mask_stride_h, mask_stride_q;
  double scale;
};

// grad_x = scale * y * (grad_y - sum(grad_y * y)), rows of length sk.
struct SoftmaxBwdArgs {
  const void* grad_y;
  const void* y;
  void* grad_x;
  int64_t sk;
  double scale;
};

// y = (x - mean) * rstd * w + b over rows of length h; mean and rstd ([rows], the
// math type) are saved for the backward.
// RMSNorm takes the same arguments (b and mean unused), as transformers' Llama-family RMSNorm
// computes it: rstd = 1 / sqrt(mean(x^2) + eps) in the math type, y = w * round(x * rstd),
// where round() is the element type's rounding (for bf16, the normalised value is cast to
// bf16 before the weight multiplies it, as PyTorch's chain does).
struct LayerNormFwdArgs {
  const void* x;
  const void* w;
  const void* b;
  void* y;
  void* mean;
  void* rstd;
  int64_t h;
  double eps;
};

// grad_x for rows [begin, end) and this chunk's partial sums of grad_w and grad_b
// (length h each, the math type), reduced over chunks by layer_norm_bwd_reduce.
// RMSNorm's backward takes the same (mean and grad_b unused).
struct LayerNormBwdArgs {
  const void* grad_y;
  const void* x;
  const void* w;
  const void* mean;
  const void* rstd;
  void* grad_x;
  int64_t h;
};

// out = residual + keep * x * scale with keep = (philox4x32(seed, i) >= threshold), the
// keep mask (0/1) written to `mask`; all contiguous, elements indexed flat.
struct DropoutAddFwdArgs {
  const void* x;
  const void* residual;
  void* out;
  uint8_t* mask;
  uint64_t seed;
  uint32_t threshold;  // P(keep) = 1 - threshold / 2^32
  double scale;        // 1 / (1 - p)
};

// grad_x = mask * grad * scale.
struct DropoutBwdArgs {
  const void* grad;
  const uint8_t* mask;
  void* grad_x;
  double scale;
};

// Attention over the real tokens of a batch (attention_kernels.h): what both passes read.
// q, k, v: [T, heads, d] with token strides q_stride.. (a head's d elements contiguous:
// views of the packed QKV GEMM output); sequence s is tokens cu_seqlens[s] .. cu_seqlens[s + 1].
// keep = (philox(seed, counter(pair, row, key)) >= threshold), scaled by keep_scale.
// Query i sees key j of its sequence iff i - window_left <= j <= i + window_right (a
// sliding window as FlashAttention's window_size; -1 = unbounded on that side).
struct AttnArgs {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_stride, k_stride, v_stride;
  const int64_t* cu_seqlens;
  int64_t total, heads, head_dim;
  double scale;
  int dropout;  // 0: no dropout (seed, threshold unused)
  uint64_t seed;
  uint32_t threshold;
  double keep_scale;
  int64_t window_left, window_right;
};

// out: [T, heads, d] contiguous; lse: [heads, T] (the math type), log of each query's softmax sum.
struct AttnFwdArgs : AttnArgs {
  void* out;
  void* lse;
};

// The forward's out and lse; grad_q/k/v: [T, heads, d] with token strides dq_stride.. (views
// of one packed grad).
struct AttnBwdArgs : AttnArgs {
  const void* out;
  const void* grad_out;
  const void* lse;
  void* grad_q;
  void* grad_k;
  void* grad_v;
  int64_t dq_stride, dk_stride, dv_stride;
};

// Cross entropy over column chunks of logits (megabert/ops/linear_cross_entropy.py).
// Forward: lse [rows] (the math type) of the rows of `num_chunks` chunks, chunk c being
// [rows, widths[c]] contiguous.
struct CeLseArgs {
  const void* const* chunks;
  const int64_t* widths;
  int64_t num_chunks;
  void* lse;
};

// Backward, one chunk: p = exp(logits - lse) * g; logits [rows, c] contiguous, p rows ld_p
// elements apart, lse and g [rows] in the math type.
struct CeGradArgs {
  const void* logits;
  const void* lse;
  const void* g;
  void* p;
  int64_t c, ld_p;
};

// The gated MLP's activation (megabert/model/mlp.py): u [rows, 2f] contiguous holds the
// halves [input; gate] ([gate; input] with gate_first). Forward: out = y [rows, f] =
// act(input) * gate (grad_y unused). Backward: out = grad_u [rows, 2f] (the halves as in u)
// from grad_y [rows, f] and u, in one pass.
enum GluAct : int { kSilu = 0, kGeluErf = 1, kGeluTanh = 2 };

struct GluArgs {
  const void* u;
  const void* grad_y;
  void* out;
  int64_t f;
  int gate_first;
  int act;  // GluAct
};

// Rotary position embeddings (rotate-half layout) and the grouped-query head layout in one pass
// (rope_kernels.h). `qkv` [rows, 3, heads, d] is contiguous: the attention's input. The packed
// side: q [rows, heads, d] and kv [rows, 2, heads / group, d] at the strides below (elements;
// each head's d contiguous). Forward reads q, kv and writes qkv[r, 0, h] = rot(q[r, h]),
// qkv[r, 1, h] = rot(k[r, h / group]), qkv[r, 2, h] = v[r, h / group]. Backward reads qkv (the
// grad) and writes the packed side: grad_q = rot^T(g[., 0, h]), grad_k / grad_v the sums of
// rot^T(g[., 1, h]) / g[., 2, h] over each key/value head's group. cos, sin: [rows, d / 2],
// rows cs_row apart, in the element type.
struct RopeArgs {
  void* q;
  void* kv;
  void* qkv;
  const void* cos;
  const void* sin;
  int64_t q_row, q_head;
  int64_t kv_row, kv_which, kv_head;
  int64_t cs_row;
  int64_t heads, group, half;
};

using SoftmaxFwdFn = void (*)(const SoftmaxFwdArgs&, int64_t row_begin, int64_t row_end);
using SoftmaxBwdFn = void (*)(const SoftmaxBwdArgs&, int64_t row_begin, int64_t row_end);
using LayerNormFwdFn = void (*)(const LayerNormFwdArgs&, int64_t row_begin, int64_t row_end);
using LayerNormBwdFn = void (*)(const LayerNormBwdArgs&, int64_t row_begin, int64_t row_end,
                                void* partial_grad_w, void* partial_grad_b);
// out[j] = sum over parts of partial[part * h + j], cast to the element type.
using LayerNormBwdReduceFn = void (*)(const void* partial, int64_t parts, int64_t h, void* out);
using CeLseFn = void (*)(const CeLseArgs&, int64_t row_begin, int64_t row_end);
using CeGradFn = void (*)(const CeGradArgs&, int64_t row_begin, int64_t row_end);
using GluFn = void (*)(const GluArgs&, int64_t row_begin, int64_t row_end);
using RopeFn = void (*)(const RopeArgs&, int64_t row_begin, int64_t row_end);
using DropoutAddFwdFn = void (*)(const DropoutAddFwdArgs&, int64_t begin, int64_t end);
using DropoutBwdFn = void (*)(const DropoutBwdArgs&, int64_t begin, int64_t end);

// One (sequence, head) work item (item = sequence * heads + head) of a non-empty sequence,
// with `scratch` of attn_*_scratch(max_len, head_dim) math-type elements to itself.
using AttnFwdFn = void (*)(const AttnFwdArgs&, int64_t item, void* scratch);
using AttnBwdFn = void (*)(const AttnBwdArgs&, int64_t item, void* scratch);
using AttnScratchFn = int64_t (*)(int64_t max_len, int64_t head_dim);
// The keep mask of one item as uint8 [len, len] (for tests).
using AttnMaskFn = void (*)(const AttnArgs&, int64_t item, uint8_t* mask);

struct KernelTable {
  const char* isa;
  SoftmaxFwdFn softmax_fwd[kNumDtypes];
  SoftmaxBwdFn softmax_bwd[kNumDtypes];
  LayerNormFwdFn layer_norm_fwd[kNumDtypes];
  LayerNormBwdFn layer_norm_bwd[kNumDtypes];
  LayerNormBwdReduceFn layer_norm_bwd_reduce[kNumDtypes];
  DropoutAddFwdFn dropout_add_fwd[kNumDtypes];
  DropoutBwdFn dropout_bwd[kNumDtypes];
  AttnFwdFn attn_fwd[kNumDtypes];
  AttnBwdFn attn_bwd[kNumDtypes];
  AttnScratchFn attn_fwd_scratch[kNumDtypes];
  AttnScratchFn attn_bwd_scratch[kNumDtypes];
  AttnMaskFn attn_mask[kNumDtypes];
  CeLseFn ce_lse[kNumDtypes];
  CeGradFn ce_grad[kNumDtypes];
  LayerNormFwdFn rms_norm_fwd[kNumDtypes];
  LayerNormBwdFn rms_norm_bwd[kNumDtypes];
  GluFn glu_fwd[kNumDtypes];
  GluFn glu_bwd[kNumDtypes];
  RopeFn rope_fwd[kNumDtypes];
  RopeFn rope_bwd[kNumDtypes];
};

// One table per instruction set; nullptr where this compiler or architecture did not build it.
const KernelTable* default_table();
const KernelTable* avx2_table();
const KernelTable* avx512_table();
// The table the ops run with (ops.cpp: chosen once per process).
const KernelTable& selected_table();

}  // namespace cpu
}  // namespace megabert
