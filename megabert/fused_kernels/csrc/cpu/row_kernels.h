// Row kernels for softmax and LayerNorm (and, from dropout_kernels.h, dropout + residual
// add; from attention_kernels.h, attention over real tokens; from cross_entropy_kernels.h,
// the MLM loss's log-sum-exp and softmax gradient; from norm_glu_kernels.h, RMSNorm and the
// gated MLP's act(input) * gate; from rope_kernels.h, RoPE with the grouped-query head layout),
// compiled once per instruction set.
//
// Included by isa_*.cpp after `#define MEGABERT_ISA <name>` (and, on x86, after a
// `#pragma GCC target`), so every function here lands in its own namespace
// megabert::cpu::<name> and can never be merged with another instruction set's copy.
// The inner loops are written for the compiler to vectorise: `omp simd` marks the
// reductions (without it GCC may not reorder a float sum), the exp is a polynomial
// the vectoriser can inline, and nothing in a loop calls into a library.
//
// NOTE: use only builtins and functions defined in this file: a std:: template
// instantiated here could be emitted with this file's instruction set and then shared
// with the rest of the library at link time.
#ifndef MEGABERT_ISA
#error "define MEGABERT_ISA before including row_kernels.h"
#endif

namespace megabert {
namespace cpu {
namespace MEGABERT_ISA {

// ---- element access: storage type -> math type ------------------------------------

// float and double compute in their own type.
template <typename T>
struct Elem {
  using acc_t = T;
  static inline T load(const T* p, int64_t j) { return p[j]; }
  static inline void store(T* p, int64_t j, T v) { p[j] = v; }
  static inline T round(T v) { return v; }  // the value as T holds it
};

template <>
struct Elem<bf16_t> {
  using acc_t = float;
  static inline float load(const bf16_t* p, int64_t j) {
    return __builtin_bit_cast(float, static_cast<uint32_t>(p[j].bits) << 16);
  }
  // Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays NaN.
  static inline uint16_t bits(float v) {
    const uint32_t u = __builtin_bit_cast(uint32_t, v);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (v != v) ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
  }
  static inline void store(bf16_t* p, int64_t j, float v) { p[j].bits = bits(v); }
  // v as a bf16 would hold it (x.to(bfloat16).float()), for math that rounds mid-way as PyTorch's chain does.
  static inline float round(float v) { return __builtin_bit_cast(float, static_cast<uint32_t>(bits(v)) << 16); }
};

// ---- math helpers --------------------------------------------------------------------

// exp for float as a polynomial the vectoriser can inline (Cephes' expf: range
// reduction by ln 2 in two parts, degree-6 polynomial, about 2 ulp). Inputs below
// -87 give 0 (true expf would give a denormal, invisible next to a softmax sum >= 1),
// which makes exp(-inf) = 0 for masked positions. NaN propagates.
constexpr float kExpLo = -87.0f, kExpHi = 88.0f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;  // ln 2 = hi - lo; n * hi is exact for |n| < 2^15

// n = round(c / ln 2) with the 1.5 * 2^23 trick: vectorises without SSE4.1's round.
inline float exp_exponent(float c) {
  const float magic = 12582912.0f;
  return (c * 1.44269504088896341f + magic) - magic;
}

// 2^n * exp(r) for |r| <= ln 2 / 2 (a bit beyond is fine), n integral in [-126, 127].
inline float exp_reduced(float r, float n) {
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_n = __builtin_bit_cast(float, static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return p * two_n;
}

inline float exp_approx(float x) {
  float c = x < kExpLo ? kExpLo : x;
  c = c > kExpHi ? kExpHi : c;
  const float n = exp_exponent(c);
  const float r = (c - n * kLn2Hi) + n * kLn2Lo;
  return x < kExpLo ? 0.0f : exp_reduced(r, n);
}

// exp(hi + lo) for hi + lo <= 88 given in two parts that together hold more bits than a float
// (norm_glu_kernels.h's exp(-x^2 / 2)): n ln 2 is taken off hi alone, which is exact for
// |hi| >= 1 (hi's last bit is then no finer than 2^-23 and hi - n ln 2 is below 2; for smaller
// hi its rounding is below 2^-24), and lo is added after, so the argument's low bits survive
// the reduction. Below -87: 0, as exp_approx (also for hi = -inf, whatever lo is).
inline float exp_approx(float hi, float lo) {
  const float x = hi + lo;
  const float n = exp_exponent(x < kExpLo ? kExpLo : x);
  const float r = ((hi - n * kLn2Hi) + n * kLn2Lo) + lo;
  return (x < kExpLo || hi < kExpLo) ? 0.0f : exp_reduced(r, n);
}

// fp64 is for gradcheck and users who ask for it, not for speed.
inline double exp_approx(double x) { return __builtin_exp(x); }

inline float rsqrt(float v) { return 1.0f / __builtin_sqrtf(v); }
inline double rsqrt(double v) { return 1.0 / __builtin_sqrt(v); }

template <typename A>
inline A neg_inf() {
  return -static_cast<A>(__builtin_inf());
}

// x[j] = exp(x[j] - m) for j < n (m: their max), returning their sum: a softmax's numerators and
// denominator, in place (the softmax rows and each attention score tile).
template <typename A>
inline A exp_sum(A* x, int64_t n, A m) {
  A sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const A e = exp_approx(x[j] - m);
    x[j] = e;
    sum += e;
  }
  return sum;
}

// Per-call scratch (one per thread's range of rows), kept free of std:: templates.
template <typename A>
struct Scratch {
  A* data;
  explicit Scratch(int64_t n) : data(new A[n > 0 ? n : 1]) {}
  ~Scratch() { delete[] data; }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// ---- scaled masked softmax -------------------------------------------------------

template <typename T>
void softmax_fwd(const SoftmaxFwdArgs& a, int64_t row_begin, int64_t row_end) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  const int64_t sk = a.sk;
  const A scale = static_cast<A>(a.scale);
  // Holds scale * x, then the exponentials: one read of x, one write of y.
  Scratch<A> buf(sk);
  A* e = buf.data;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* xr = x + row * sk;
    T* yr = y + row * sk;
    // Pass 1 reads the row from memory into the scratch as scale * x, with plain loads:
    // a select on the mask here becomes a masked load, which stalls on a row that is
    // not in cache far longer (2x on the whole forward, measured on Zen 4).
#pragma omp simd
    for (int64_t j = 0; j < sk; ++j) e[j] = scale * E::load(xr, j);
    A m = neg_inf<A>();
    if (a.mask != nullptr) {
      const int64_t q = row % a.sq, h = (row / a.sq) % a.heads, b = row / (a.sq * a.heads);
      const uint8_t* mr = a.mask + b * a.mask_stride_b + h * a.mask_stride_h + q * a.mask_stride_q;
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < sk; ++j) {
        const A v = mr[j] ? neg_inf<A>() : e[j];
        e[j] = v;
        m = v > m ? v : m;
      }
    } else {
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < sk; ++j) m = e[j] > m ? e[j] : m;
    }
    if (m == neg_inf<A>()) {  // every position masked: zeros, as Megatron's kernel
      for (int64_t j = 0; j < sk; ++j) E::store(yr, j, A(0));
      continue;
    }
    const A inv = A(1) / exp_sum(e, sk, m);
#pragma omp simd
    for (int64_t j = 0; j < sk; ++j) E::store(yr, j, e[j] * inv);
  }
}

// Masked positions have y = 0 and so get a zero gradient without reading the mask.
template <typename T>
void softmax_bwd(const SoftmaxBwdArgs& a, int64_t row_begin, int64_t row_end) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const T* gy = static_cast<const T*>(a.grad_y);
  const T* y = static_cast<const T*>(a.y);
  T* gx = static_cast<T*>(a.grad_x);
  const int64_t sk = a.sk;
  const A scale = static_cast<A>(a.scale);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* gyr = gy + row * sk;
    const T* yr = y + row * sk;
    T* gxr = gx + row * sk;
    A dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < sk; ++j) dot += E::load(gyr, j) * E::load(yr, j);
#pragma omp simd
    for (int64_t j = 0; j < sk; ++j) E::store(gxr, j, scale * E::load(yr, j) * (E::load(gyr, j) - dot));
  }
}

// ---- LayerNorm -------------------------------------------------------------------

template <typename T>
void layer_norm_fwd(const LayerNormFwdArgs& a, int64_t row_begin, int64_t row_end) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  const T* b = static_cast<const T*>(a.b);
  T* y = static_cast<T*>(a.y);
  A* mean_out = static_cast<A*>(a.mean);
  A* rstd_out = static_cast<A*>(a.rstd);
  const int64_t h = a.h;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* xr = x + row * h;
    T* yr = y + row * h;
    // Two passes over a row that sits in L1 (the corrected two-pass algorithm of Chan,
    // Golub and LeVeque): the second pass sums the deviations d = x - mean as well as
    // their squares, and sum(d) / h corrects the mean's rounding, which for a row with
    // a large mean (a sum of h large numbers in fp32) would otherwise shift every output.
    A sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < h; ++j) sum += E::load(xr, j);
    const A mean0 = sum / static_cast<A>(h);
    A dsum = 0, dsq = 0;
#pragma omp simd reduction(+ : dsum, dsq)
    for (int64_t j = 0; j < h; ++j) {
      const A d = E::load(xr, j) - mean0;
      dsum += d;
      dsq += d * d;
    }
    const A shift = dsum / static_cast<A>(h);  // mean = mean0 + shift; x - mean0 is exact near the mean
    const A var = (dsq - dsum * shift) / static_cast<A>(h);
    const A rstd = rsqrt(var + static_cast<A>(a.eps));
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      E::store(yr, j, ((E::load(xr, j) - mean0) - shift) * rstd * E::load(w, j) + E::load(b, j));
    }
    mean_out[row] = mean0 + shift;
    rstd_out[row] = rstd;
  }
}

// With xhat = (x - mean) * rstd and g = grad_y * w:
//   grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat)),
//   grad_w += grad_y * xhat, grad_b += grad_y (this range's partial sums).
// The saved mean is rounded to the math type; for a row with a large mean that
// rounding would bias every xhat, so the first pass also sums d = x - mean (exact near
// the mean) and xhat = (d - mean(d)) * rstd, with sum(g * xhat) taken from the same sums.
template <typename T>
void layer_norm_bwd(const LayerNormBwdArgs& a, int64_t row_begin, int64_t row_end, void* partial_grad_w,
                    void* partial_grad_b) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const T* gy = static_cast<const T*>(a.grad_y);
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  const A* mean_in = static_cast<const A*>(a.mean);
  const A* rstd_in = static_cast<const A*>(a.rstd);
  T* gx = static_cast<T*>(a.grad_x);
  A* gw = static_cast<A*>(partial_grad_w);
  A* gb = static_cast<A*>(partial_grad_b);
  const int64_t h = a.h;
  const A inv_h = A(1) / static_cast<A>(h);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* gyr = gy + row * h;
    const T* xr = x + row * h;
    T* gxr = gx + row * h;
    const A mean = mean_in[row], rstd = rstd_in[row];
    A sum_d = 0, sum_g = 0, sum_gd = 0;
#pragma omp simd reduction(+ : sum_d, sum_g, sum_gd)
    for (int64_t j = 0; j < h; ++j) {
      const A g = E::load(gyr, j) * E::load(w, j);
      const A d = E::load(xr, j) - mean;
      sum_d += d;
      sum_g += g;
      sum_gd += g * d;
    }
    const A shift = sum_d * inv_h;
    const A mean_g = sum_g * inv_h;
    const A mean_gxhat = (sum_gd - shift * sum_g) * rstd * inv_h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      const A dy = E::load(gyr, j);
      const A xhat = ((E::load(xr, j) - mean) - shift) * rstd;
      E::store(gxr, j, rstd * (dy * E::load(w, j) - mean_g - xhat * mean_gxhat));
      gw[j] += dy * xhat;
      gb[j] += dy;
    }
  }
}

template <typename T>
void layer_norm_bwd_reduce(const void* partial_in, int64_t parts, int64_t h, void* out_v) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const A* partial = static_cast<const A*>(partial_in);
  T* out = static_cast<T*>(out_v);
  // Blocks of columns so that the inner loop runs along contiguous memory.
  constexpr int64_t kBlock = 128;
  A acc[kBlock];
  for (int64_t j0 = 0; j0 < h; j0 += kBlock) {
    const int64_t n = h - j0 < kBlock ? h - j0 : kBlock;
    for (int64_t k = 0; k < n; ++k) acc[k] = 0;
    for (int64_t p = 0; p < parts; ++p) {
      const A* src = partial + p * h + j0;
#pragma omp simd
      for (int64_t k = 0; k < n; ++k) acc[k] += src[k];
    }
    for (int64_t k = 0; k < n; ++k) E::store(out, j0 + k, acc[k]);
  }
}

#include "dropout_kernels.h"
#include "attention_kernels.h"
#include "cross_entropy_kernels.h"
#include "norm_glu_kernels.h"
#include "rope_kernels.h"

// Indexed by Dtype: kFloat, kBFloat16, kDouble.
const KernelTable kTable = {
    MEGABERT_ISA_NAME,
    {&softmax_fwd<float>, &softmax_fwd<bf16_t>, &softmax_fwd<double>},
    {&softmax_bwd<float>, &softmax_bwd<bf16_t>, &softmax_bwd<double>},
    {&layer_norm_fwd<float>, &layer_norm_fwd<bf16_t>, &layer_norm_fwd<double>},
    {&layer_norm_bwd<float>, &layer_norm_bwd<bf16_t>, &layer_norm_bwd<double>},
    {&layer_norm_bwd_reduce<float>, &layer_norm_bwd_reduce<bf16_t>, &layer_norm_bwd_reduce<double>},
    {&dropout_add_fwd<float>, &dropout_add_fwd<bf16_t>, &dropout_add_fwd<double>},
    {&dropout_bwd<float>, &dropout_bwd<bf16_t>, &dropout_bwd<double>},
    {&attn_fwd<float>, &attn_fwd<bf16_t>, &attn_fwd<double>},
    {&attn_bwd<float>, &attn_bwd<bf16_t>, &attn_bwd<double>},
    {&attn_fwd_scratch<float>, &attn_fwd_scratch<bf16_t>, &attn_fwd_scratch<double>},
    {&attn_bwd_scratch<float>, &attn_bwd_scratch<bf16_t>, &attn_bwd_scratch<double>},
    {&attn_mask<float>, &attn_mask<bf16_t>, &attn_mask<double>},
    {&ce_lse<float>, &ce_lse<bf16_t>, &ce_lse<double>},
    {&ce_grad<float>, &ce_grad<bf16_t>, &ce_grad<double>},
    {&rms_norm_fwd<float>, &rms_norm_fwd<bf16_t>, &rms_norm_fwd<double>},
    {&rms_norm_bwd<float>, &rms_norm_bwd<bf16_t>, &rms_norm_bwd<double>},
    {&glu<float, false>, &glu<bf16_t, false>, &glu<double, false>},
    {&glu<float, true>, &glu<bf16_t, true>, &glu<double, true>},
    {&rope_qkv<float, false>, &rope_qkv<bf16_t, false>, &rope_qkv<double, false>},
    {&rope_qkv<float, true>, &rope_qkv<bf16_t, true>, &rope_qkv<double, true>},
};

}  // namespace MEGABERT_ISA
}  // namespace cpu
}  // namespace megabert
