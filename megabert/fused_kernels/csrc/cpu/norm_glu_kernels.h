// RMSNorm and the gated MLP's activation (SwiGLU, GeGLU), included by row_kernels.h inside
// namespace megabert::cpu::MEGABERT_ISA (after Elem<T>, exp_approx and rsqrt).
//
// Both are one pass over memory each way. PyTorch runs them as chains of elementwise ops,
// each a full pass of its own (RMSNorm: float(), pow, mean, add, rsqrt, mul, cast, mul; the
// gated activation: chunk, act, mul, and in backward the two halves' grads and a cat), which
// on the CPU cost several times their memory traffic (issue 50, item 7).

// ---- RMSNorm -----------------------------------------------------------------------

// Rows of length h: x's and y's row `row` are a.x + row * h and a.y + row * h.
template <typename T>
void rms_norm_fwd(const LayerNormFwdArgs& a, int64_t row_begin, int64_t row_end) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const int64_t h = a.h;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* x = static_cast<const T*>(a.x) + row * h;
    A sq = 0;
#pragma omp simd reduction(+ : sq)
    for (int64_t j = 0; j < h; ++j) sq += E::load(x, j) * E::load(x, j);
    // As PyTorch's chain: mean, + eps, rsqrt.
    const A rstd = rsqrt(sq / static_cast<A>(h) + static_cast<A>(a.eps));
    static_cast<A*>(a.rstd)[row] = rstd;
    const T* w = static_cast<const T*>(a.w);
    T* y = static_cast<T*>(a.y) + row * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) E::store(y, j, E::load(w, j) * E::round(E::load(x, j) * rstd));
  }
}

// With xhat = x * rstd and g = grad_y * w:
//   grad_x = rstd * g - x * rstd^3 * mean(g * x)   (the cast of xhat passes the gradient as is),
//   grad_w += grad_y * round(xhat)                 (this range's partial sums).
template <typename T>
void rms_norm_bwd(const LayerNormBwdArgs& a, int64_t row_begin, int64_t row_end, void* partial_grad_w, void*) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const int64_t h = a.h;
  const T* w = static_cast<const T*>(a.w);
  A* gw = static_cast<A*>(partial_grad_w);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* dy = static_cast<const T*>(a.grad_y) + row * h;
    const T* x = static_cast<const T*>(a.x) + row * h;
    A sum_gx = 0;
#pragma omp simd reduction(+ : sum_gx)
    for (int64_t j = 0; j < h; ++j) sum_gx += E::load(dy, j) * E::load(w, j) * E::load(x, j);
    const A rstd = static_cast<const A*>(a.rstd)[row];
    const A c = sum_gx / static_cast<A>(h) * rstd * rstd * rstd;
    T* dx = static_cast<T*>(a.grad_x) + row * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      E::store(dx, j, rstd * E::load(dy, j) * E::load(w, j) - E::load(x, j) * c);
      gw[j] += E::load(dy, j) * E::round(E::load(x, j) * rstd);
    }
  }
}

// ---- gated activation: y = act(input) * gate ------------------------------------------
// Each activation gives f(x) and, for the backward, f'(x) too: fp32 through exp_approx, fp64
// (gradcheck) through the C library's exp and erfc. Measured in fp32 against the function in
// fp64 (tests/test_norm_glu_kernels.py), x in [-12, 12], relative where the value is a normal
// float: SiLU and GELU's tanh form within 3 ulp, exact GELU within 7 ulp. Values below ~1e-36
// in magnitude flush to 0 (exp_approx gives 0 below -87).

// GELU's erf form needs Phi(x) = erfc(-x / sqrt 2) / 2, the normal CDF, and its density
// phi(x) = exp(-x^2 / 2) / sqrt(2 pi). Relative, not absolute, accuracy matters: in the negative
// tail GELU(x) = x * Phi(x) is a small number made from erfc alone (the erf form's
// 1 + erf(x / sqrt 2) cancels there; PyTorch's fp32 GELU is off by 22% at x = -5).
//
// erfc is Numerical Recipes' erfcc (Press et al., 2nd ed., 6.2): a Chebyshev fit
// erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z / 2), fractional error below 1.2e-7 for every
// z >= 0, and erfc(-z) = 2 - erfc(z). The exponent -z^2 = -x^2 / 2 is taken in two parts
// (half_square) and exp_approx(hi, lo) keeps both: rounded to one float it would cost ~x^2 / 2
// ulp (25 ulp at x = -4).

// -x^2 / 2 = hi + lo to ~44 bits: x = xh + xl with xh the upper 12 bits of x's mantissa, so
// xh * xh is exact (Dekker's split, by masking: no FMA needed on the baseline ISA).
inline void half_square(float x, float& hi, float& lo) {
  const float xh = __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, x) & 0xFFFFF000u);
  const float xl = x - xh;
  hi = -0.5f * (xh * xh);
  lo = -0.5f * (xl * (x + xh));  // 2 xh xl + xl^2
}

inline float normal_cdf(float x) {
  const float z = (x < 0.0f ? -x : x) * 0.70710678118654752f;
  const float t = 1.0f / (1.0f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  float hi, lo;
  half_square(x, hi, lo);
  const float tail = 0.5f * t * exp_approx(hi, lo + p);  // erfc(|x| / sqrt 2) / 2
  return x < 0.0f ? tail : 1.0f - tail;
}

inline float normal_pdf(float x) {
  float hi, lo;
  half_square(x, hi, lo);
  return 0.39894228040143267794f * exp_approx(hi, lo);
}

inline double normal_cdf(double x) { return 0.5 * __builtin_erfc(x * -0.70710678118654752440); }
inline double normal_pdf(double x) { return 0.39894228040143267794 * __builtin_exp(-0.5 * x * x); }

// 1 / (1 + exp(-x)) from e = exp(-|x|) <= 1, as 1 / (1 + e) or, for x < 0, e / (1 + e): no
// overflow (exp_approx saturates at exp(88)), and 0 where e underflows (x < -87).
inline float sigmoid(float x) {
  const float e = exp_approx(x < 0.0f ? x : -x);
  return (x < 0.0f ? e : 1.0f) / (1.0f + e);
}
inline double sigmoid(double x) { return 1.0 / (1.0 + __builtin_exp(-x)); }

// sigmoid(hi + lo) for an argument held in two floats (exp_approx(hi, lo)), as above.
inline float sigmoid(float hi, float lo) {
  const bool neg = hi < 0.0f;
  const float e = exp_approx(neg ? hi : -hi, neg ? lo : -lo);
  return (neg ? e : 1.0f) / (1.0f + e);
}

// GELU's tanh form: sigmoid(2u), 2u = 2 sqrt(2 / pi) * (x + 0.044715 x^3) (1 + tanh(u) =
// 2 / (1 + exp(-2u)): one exp, no cancellation). For fp32, 2u is computed in double and
// handed to exp as two floats: rounded to one float it would cost about |2u| ulp (30 ulp at
// x = -5, as PyTorch's fp32 chain has).
inline float gelu_tanh_sigmoid(float x) {
  const double xd = x;
  const double v = 1.59576912160573071176 * (xd + 0.044715 * xd * xd * xd);
  const float hi = static_cast<float>(v);
  return sigmoid(hi, static_cast<float>(v - static_cast<double>(hi)));
}
inline double gelu_tanh_sigmoid(double x) { return sigmoid(1.59576912160573071176 * (x + 0.044715 * x * x * x)); }

// act(x), its derivative in `grad` (the forward leaves it unused: the compiler drops it).
template <int kAct, typename A>
inline A activation(A x, A& grad) {
  if constexpr (kAct == kSilu) {  // x * sigmoid(x); f' = s * (1 + x * (1 - s))
    const A s = sigmoid(x);
    grad = s * (A(1) + x * (A(1) - s));
    return x * s;
  } else if constexpr (kAct == kGeluErf) {  // x * Phi(x); f' = Phi(x) + x * phi(x)
    const A cdf = normal_cdf(x);
    grad = cdf + x * normal_pdf(x);
    return x * cdf;
  } else {  // x * s, s = sigmoid(2u); f' = s + x * s * (1 - s) * d(2u)/dx
    const A s = gelu_tanh_sigmoid(x);
    grad = s + x * s * (A(1) - s) * A(1.59576912160573071176) * (A(1) + A(0.134145) * x * x);
    return x * s;
  }
}

// Forward: y = act(input) * gate. Backward: grad_input = grad_y * gate * act'(input) and
// grad_gate = grad_y * act(input), one read of u and grad_y and one write of grad_u.
template <typename T, int kAct, bool kBackward>
void glu_rows(const GluArgs& a, int64_t row_begin, int64_t row_end) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const int64_t f = a.f;
  const int64_t in_off = a.gate_first ? f : 0, gate_off = f - in_off;  // within a row of u / grad_u
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* in = static_cast<const T*>(a.u) + row * 2 * f + in_off;
    const T* gate = in - in_off + gate_off;
    if constexpr (kBackward) {
      const T* dy = static_cast<const T*>(a.grad_y) + row * f;
      T* grad_in = static_cast<T*>(a.out) + row * 2 * f + in_off;
      T* grad_gate = grad_in - in_off + gate_off;
#pragma omp simd
      for (int64_t j = 0; j < f; ++j) {
        A d;
        const A act = activation<kAct>(E::load(in, j), d);
        E::store(grad_in, j, E::load(dy, j) * E::load(gate, j) * d);
        E::store(grad_gate, j, E::load(dy, j) * act);
      }
    } else {
      T* y = static_cast<T*>(a.out) + row * f;
#pragma omp simd
      for (int64_t j = 0; j < f; ++j) {
        A unused;
        E::store(y, j, activation<kAct>(E::load(in, j), unused) * E::load(gate, j));
      }
    }
  }
}

// One table entry per element type and direction; the activation is a template argument of
// the row loop, picked once per call (ops.cpp checks the code).
template <typename T, bool kBackward>
void glu(const GluArgs& a, int64_t row_begin, int64_t row_end) {
  if (a.act == kSilu) return glu_rows<T, kSilu, kBackward>(a, row_begin, row_end);
  if (a.act == kGeluErf) return glu_rows<T, kGeluErf, kBackward>(a, row_begin, row_end);
  glu_rows<T, kGeluTanh, kBackward>(a, row_begin, row_end);
}
