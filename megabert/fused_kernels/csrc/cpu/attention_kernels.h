// Attention over the real tokens of a batch (varlen), forward and backward, compiled once per
// instruction set (included by row_kernels.h inside namespace megabert::cpu::MEGABERT_ISA,
// after Elem<T>, exp_approx and dropout_kernels.h's Philox).
//
// One work item is one (sequence, head) pair of the unpadded [T, heads, d] Q, K, V; the
// sequence's tokens are rows cu_seqlens[s] .. cu_seqlens[s+1]. Per item the forward runs
// FlashAttention's loop (Dao et al. 2022; FlashAttention-2's order, 2023): blocks of kBq
// queries against key tiles of kBk keys with an online softmax (running max m and sum l),
// so no [s, s] score matrix exists, only a [kBq, kBk] tile; it saves lse = m + log(l) per
// query. The backward recomputes each probability tile from lse (no saved probabilities)
// and walks key tiles outermost so that dK and dV of a tile are finished in registers-sized
// buffers while dQ accumulates over the sequence.
//
// Attention dropout is drawn inside both passes from Philox4x32-10 keyed by the call's seed:
// the keep bit of (pair, query row i, key column j) is word (j % 64) / 16 of the counter
// (c0 = (j / 64) * 16 + j % 16, c1 = i, c2 = pair, c3 = kAttnDomain), where pair =
// sequence * heads + head. It depends on nothing else (not on threads, tiles or the ISA), so
// the backward regenerates exactly the forward's mask, and any thread count draws the same.
//
// Math in fp32 for fp32/bf16 (fp64 for fp64) on scratch copies of the tiles whose head dim
// is zero-padded to a multiple of kDc, so that every inner loop runs over kDc-wide rows held
// in vector registers (GCC vector extensions: one source for SSE2, AVX2 and AVX-512).

#ifndef MEGABERT_VEC_BYTES
#define MEGABERT_VEC_BYTES 16
#endif

// Query rows per block and keys per tile; a tile's keys are one Philox tile (dropout_kernels.h).
constexpr int64_t kBq = 16;
constexpr int64_t kBk = kTile;  // 64
// Head-dim chunk: rows of scratch are padded to a multiple of it.
constexpr int64_t kDc = 64;
// Philox counter word 3 for attention masks: dropout_add's counters keep it 0.
constexpr uint32_t kAttnDomain = 0x61747431u;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- vectors of the math type ----------------------------------------------------------

template <typename A>
struct Vec;

template <>
struct Vec<float> {
  typedef float type __attribute__((vector_size(MEGABERT_VEC_BYTES)));
};

template <>
struct Vec<double> {
  typedef double type __attribute__((vector_size(MEGABERT_VEC_BYTES)));
};

template <typename A>
struct Row64 {
  using V = typename Vec<A>::type;
  static constexpr int64_t kW = MEGABERT_VEC_BYTES / static_cast<int64_t>(sizeof(A));
  static constexpr int64_t kN = kDc / kW;  // vectors per 64-wide row
  static_assert(kDc % kW == 0, "kDc must be a multiple of the vector width");

  static inline V load(const A* p) {
    V v;
    __builtin_memcpy(&v, p, sizeof(V));
    return v;
  }
  static inline void store(A* p, V v) { __builtin_memcpy(p, &v, sizeof(V)); }

  // Accumulators per pass: at most 8 vectors, so that they and the loaded row fit in 16
  // registers (SSE2's 16-float rows take two passes of 32; AVX2 and AVX-512 one).
  static constexpr int64_t kAcc = kN < 8 ? kN : 8;

  // out[0:64] (+)= sum_{i < n} coef[i * coef_stride] * rows[i * row_stride + 0:64]; the
  // accumulators stay in vector registers across the sum.
  template <bool kAccumulate>
  static inline void axpy(A* out, const A* coef, int64_t coef_stride, const A* rows, int64_t row_stride,
                          int64_t n) {
    for (int64_t k0 = 0; k0 < kN; k0 += kAcc) {
      V acc[kAcc];
#pragma GCC unroll 8
      for (int64_t k = 0; k < kAcc; ++k) acc[k] = kAccumulate ? load(out + (k0 + k) * kW) : V{};
      for (int64_t i = 0; i < n; ++i) {
        const A c = coef[i * coef_stride];
        const A* r = rows + i * row_stride + k0 * kW;
#pragma GCC unroll 8
        for (int64_t k = 0; k < kAcc; ++k) acc[k] += c * load(r + k * kW);
      }
#pragma GCC unroll 8
      for (int64_t k = 0; k < kAcc; ++k) store(out + (k0 + k) * kW, acc[k]);
    }
  }

  // NOTE: GCC folds a loaded vector into each multiply-add that reads it (a memory
  // operand), loading it twice in axpy2; an empty asm that claims to change it keeps it in
  // a register.
  static inline void keep_in_register(V& x) {
#if defined(__x86_64__) && defined(__GNUC__)
    asm("" : "+x"(x));
#else
    (void)x;
#endif
  }

  // Two output rows over the same `rows`: each loaded vector feeds two multiply-adds, so
  // the loop issues 3 loads (a vector, two broadcasts) per 4 FMAs where axpy issues 9 per
  // 8; axpy is load-bound (measured on AVX2 Zen 3: 2-row tiles 1.3-1.4x faster). Each
  // output's sum runs in axpy's order: the results are bitwise axpy's.
  static constexpr int64_t kAcc2 = kN < 4 ? kN : 4;

  template <bool kAccumulate>
  static inline void axpy2(A* out0, A* out1, const A* coef0, const A* coef1, int64_t coef_stride, const A* rows,
                           int64_t row_stride, int64_t n) {
    for (int64_t k0 = 0; k0 < kN; k0 += kAcc2) {
      V acc0[kAcc2], acc1[kAcc2];
#pragma GCC unroll 4
      for (int64_t k = 0; k < kAcc2; ++k) {
        acc0[k] = kAccumulate ? load(out0 + (k0 + k) * kW) : V{};
        acc1[k] = kAccumulate ? load(out1 + (k0 + k) * kW) : V{};
      }
      for (int64_t i = 0; i < n; ++i) {
        const A c0 = coef0[i * coef_stride], c1 = coef1[i * coef_stride];
        const A* r = rows + i * row_stride + k0 * kW;
#pragma GCC unroll 4
        for (int64_t k = 0; k < kAcc2; ++k) {
          V x = load(r + k * kW);
          keep_in_register(x);
          acc0[k] += c0 * x;
          acc1[k] += c1 * x;
        }
      }
#pragma GCC unroll 4
      for (int64_t k = 0; k < kAcc2; ++k) {
        store(out0 + (k0 + k) * kW, acc0[k]);
        store(out1 + (k0 + k) * kW, acc1[k]);
      }
    }
  }
};

// C[kBq][kBk] = A[kBq][dp] . Bt[dp][kBk] (Bt: a key tile transposed; dp a multiple of kDc).
template <typename A>
inline void tile_abt(const A* a, int64_t dp, const A* bt, A* c, int64_t rows) {
  int64_t r = 0;
  for (; r + 1 < rows; r += 2)
    Row64<A>::template axpy2<false>(c + r * kBk, c + (r + 1) * kBk, a + r * dp, a + (r + 1) * dp, 1, bt, kBk, dp);
  if (r < rows) Row64<A>::template axpy<false>(c + r * kBk, a + r * dp, 1, bt, kBk, dp);
}

// C[rows][dp] += P[rows][kBk] . B[kBk][dp] (B: rows of a tile, dp wide), over n keys.
template <typename A>
inline void tile_ab_acc(const A* p, const A* b, int64_t dp, A* c, int64_t rows, int64_t n) {
  for (int64_t d0 = 0; d0 < dp; d0 += kDc) {
    int64_t r = 0;
    for (; r + 1 < rows; r += 2)
      Row64<A>::template axpy2<true>(c + r * dp + d0, c + (r + 1) * dp + d0, p + r * kBk, p + (r + 1) * kBk, 1,
                                     b + d0, dp, n);
    if (r < rows) Row64<A>::template axpy<true>(c + r * dp + d0, p + r * kBk, 1, b + d0, dp, n);
  }
}

// Y[kBk][dp] += P[rows][kBk]^T . X[rows][dp] (kBk is even: keys go in pairs).
template <typename A>
inline void tile_atb_acc(const A* p, const A* x, int64_t dp, A* y, int64_t rows) {
  static_assert(kBk % 2 == 0, "keys are taken in pairs");
  for (int64_t c = 0; c < kBk; c += 2)
    for (int64_t d0 = 0; d0 < dp; d0 += kDc)
      Row64<A>::template axpy2<true>(y + c * dp + d0, y + (c + 1) * dp + d0, p + c, p + c + 1, kBk, x + d0, dp, rows);
}

// The 64 keep words of (pair, row, key tile kt): u[k] decides key kt * kBk + k.
inline void attn_philox_tile(uint64_t seed, uint32_t pair, uint32_t row, int64_t kt, uint32_t* u) {
  uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    c0[j] = static_cast<uint32_t>(kt * kLanes + j);
    c1[j] = row;
    c2[j] = pair;
    c3[j] = kAttnDomain;
  }
  philox_rounds(seed, c0, c1, c2, c3);
  for (int64_t j = 0; j < kLanes; ++j) {
    u[j] = c0[j];
    u[kLanes + j] = c1[j];
    u[2 * kLanes + j] = c2[j];
    u[3 * kLanes + j] = c3[j];
  }
}

// Loads rows [r0, r0 + n) of one head of q/k/v ([T, heads, d] rows `stride` apart, this
// head's d elements contiguous) into dst[n][dp] times `mul`, zero-padding to dp.
template <typename T, typename A>
inline void load_rows(const T* src, int64_t stride, int64_t d, int64_t n, A mul, A* dst, int64_t dp) {
  using E = Elem<T>;
  for (int64_t r = 0; r < n; ++r) {
    const T* s = src + r * stride;
    A* o = dst + r * dp;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) o[c] = mul * static_cast<A>(E::load(s, c));
    for (int64_t c = d; c < dp; ++c) o[c] = 0;
  }
}

// Key tile kt of one head transposed: dst[dp][kBk], zero beyond the sequence and d.
template <typename T, typename A>
inline void load_tile_t(const T* src, int64_t stride, int64_t d, int64_t n, A* dst, int64_t dp) {
  using E = Elem<T>;
  for (int64_t i = 0; i < dp * kBk; ++i) dst[i] = 0;
  for (int64_t r = 0; r < n; ++r) {
    const T* s = src + r * stride;
    for (int64_t c = 0; c < d; ++c) dst[c * kBk + r] = static_cast<A>(E::load(s, c));
  }
}

template <typename A>
struct AttnDims {
  int64_t len, dp, tiles, lp;
  AttnDims(int64_t len_, int64_t d) : len(len_), dp(round_up(d, kDc)), tiles((len_ + kBk - 1) / kBk),
                                      lp(round_up(len_, kBk)) {}
};

// Scratch (elements of the math type) one thread needs for a sequence of up to max_len.
template <typename T>
int64_t attn_fwd_scratch(int64_t max_len, int64_t d) {
  const int64_t dp = round_up(d, kDc), lp = round_up(max_len, kBk);
  // Kt (lp x dp), V (lp x dp), Q block, O block (kBq x dp each), S (kBq x kBk), m, l.
  return 2 * lp * dp + 2 * kBq * dp + kBq * kBk + 2 * kBq;
}

template <typename T>
int64_t attn_bwd_scratch(int64_t max_len, int64_t d) {
  const int64_t dp = round_up(d, kDc), lp = round_up(max_len, kBk);
  // Qs, K, dO, dQ (lp x dp each), Kt, Vt (lp x dp), D, lse (lp), dK, dV tiles (kBk x dp),
  // P and dS tiles (kBq x kBk).
  return 6 * lp * dp + 2 * lp + 2 * kBk * dp + 2 * kBq * kBk;
}

template <typename T>
void attn_fwd(const AttnFwdArgs& a, int64_t item, void* scratch_v) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const int64_t seq = item / a.heads, head = item % a.heads;
  const int64_t t0 = a.cu_seqlens[seq];
  const AttnDims<A> dims(a.cu_seqlens[seq + 1] - t0, a.head_dim);
  if (dims.len <= 0) return;
  const int64_t d = a.head_dim, dp = dims.dp, len = dims.len;
  const T* q = static_cast<const T*>(a.q) + t0 * a.q_stride + head * d;
  const T* k = static_cast<const T*>(a.k) + t0 * a.k_stride + head * d;
  const T* v = static_cast<const T*>(a.v) + t0 * a.v_stride + head * d;
  T* out = static_cast<T*>(a.out) + (t0 * a.heads + head) * d;
  A* lse = static_cast<A*>(a.lse) + head * a.total + t0;  // [heads, T]

  A* kt_all = static_cast<A*>(scratch_v);
  A* v_all = kt_all + dims.lp * dp;
  A* qb = v_all + dims.lp * dp;
  A* ob = qb + kBq * dp;
  A* s = ob + kBq * dp;
  A* m = s + kBq * kBk;
  A* l = m + kBq;
  for (int64_t kt = 0; kt < dims.tiles; ++kt) {
    const int64_t n = len - kt * kBk < kBk ? len - kt * kBk : kBk;
    load_tile_t<T, A>(k + kt * kBk * a.k_stride, a.k_stride, d, n, kt_all + kt * dp * kBk, dp);
  }
  load_rows<T, A>(v, a.v_stride, d, len, A(1), v_all, dp);
  for (int64_t i = len * dp; i < dims.lp * dp; ++i) v_all[i] = 0;

  const A scale = static_cast<A>(a.scale), keep_scale = static_cast<A>(a.keep_scale);
  const uint32_t pair = static_cast<uint32_t>(item);
  uint32_t u[kBk];
  for (int64_t q0 = 0; q0 < len; q0 += kBq) {
    const int64_t rows = len - q0 < kBq ? len - q0 : kBq;
    load_rows<T, A>(q + q0 * a.q_stride, a.q_stride, d, rows, scale, qb, dp);
    for (int64_t i = 0; i < rows * dp; ++i) ob[i] = 0;
    for (int64_t r = 0; r < rows; ++r) {
      m[r] = neg_inf<A>();
      l[r] = 0;
    }
    for (int64_t kt = 0; kt < dims.tiles; ++kt) {
      const int64_t valid = len - kt * kBk < kBk ? len - kt * kBk : kBk;
      tile_abt<A>(qb, dp, kt_all + kt * dp * kBk, s, rows);
      for (int64_t r = 0; r < rows; ++r) {
        A* sr = s + r * kBk;
        // Keys past the sequence (the last tile) score -inf: out of the max, exp gives 0.
        for (int64_t c = valid; c < kBk; ++c) sr[c] = neg_inf<A>();
        A mx = m[r];
#pragma omp simd reduction(max : mx)
        for (int64_t c = 0; c < kBk; ++c) mx = sr[c] > mx ? sr[c] : mx;
        const A alpha = exp_approx(m[r] - mx);  // 0 on the first tile (m = -inf)
        A sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < kBk; ++c) {
          const A e = exp_approx(sr[c] - mx);
          sr[c] = e;
          sum += e;
        }
        m[r] = mx;
        l[r] = l[r] * alpha + sum;  // the softmax sum counts every key, dropped or not
        A* orow = ob + r * dp;
        for (int64_t c = 0; c < dp; ++c) orow[c] *= alpha;
        if (a.dropout) {
          attn_philox_tile(a.seed, pair, static_cast<uint32_t>(q0 + r), kt, u);
#pragma omp simd
          for (int64_t c = 0; c < kBk; ++c) sr[c] = u[c] >= a.threshold ? sr[c] * keep_scale : A(0);
        }
      }
      tile_ab_acc<A>(s, v_all + kt * kBk * dp, dp, ob, rows, valid);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const A inv = A(1) / l[r];
      T* orow = out + (q0 + r) * a.heads * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) E::store(orow, c, ob[r * dp + c] * inv);
      lse[q0 + r] = m[r] + static_cast<A>(__builtin_log(static_cast<double>(l[r])));
    }
  }
}

template <typename T>
void attn_bwd(const AttnBwdArgs& a, int64_t item, void* scratch_v) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const int64_t seq = item / a.heads, head = item % a.heads;
  const int64_t t0 = a.cu_seqlens[seq];
  const AttnDims<A> dims(a.cu_seqlens[seq + 1] - t0, a.head_dim);
  if (dims.len <= 0) return;
  const int64_t d = a.head_dim, dp = dims.dp, len = dims.len, lp = dims.lp;
  const T* q = static_cast<const T*>(a.q) + t0 * a.q_stride + head * d;
  const T* k = static_cast<const T*>(a.k) + t0 * a.k_stride + head * d;
  const T* v = static_cast<const T*>(a.v) + t0 * a.v_stride + head * d;
  const T* out = static_cast<const T*>(a.out) + (t0 * a.heads + head) * d;
  const T* dout = static_cast<const T*>(a.grad_out) + (t0 * a.heads + head) * d;
  const A* lse_in = static_cast<const A*>(a.lse) + head * a.total + t0;
  T* dq = static_cast<T*>(a.grad_q) + t0 * a.dq_stride + head * d;
  T* dk = static_cast<T*>(a.grad_k) + t0 * a.dk_stride + head * d;
  T* dv = static_cast<T*>(a.grad_v) + t0 * a.dv_stride + head * d;
  const int64_t od = a.heads * d;  // token stride of out / grad_out

  A* qs = static_cast<A*>(scratch_v);
  A* kr = qs + lp * dp;
  A* dob = kr + lp * dp;
  A* dqb = dob + lp * dp;
  A* kt_all = dqb + lp * dp;
  A* vt_all = kt_all + lp * dp;
  A* dvec = vt_all + lp * dp;
  A* lse = dvec + lp;
  A* dkb = lse + lp;
  A* dvb = dkb + kBk * dp;
  A* p = dvb + kBk * dp;
  A* ds = p + kBq * kBk;

  const A scale = static_cast<A>(a.scale), keep_scale = static_cast<A>(a.keep_scale);
  load_rows<T, A>(q, a.q_stride, d, len, scale, qs, dp);
  load_rows<T, A>(k, a.k_stride, d, len, A(1), kr, dp);
  load_rows<T, A>(dout, od, d, len, A(1), dob, dp);
  for (int64_t i = len * dp; i < lp * dp; ++i) qs[i] = kr[i] = dob[i] = 0;
  for (int64_t i = 0; i < lp * dp; ++i) dqb[i] = 0;
  for (int64_t kt = 0; kt < dims.tiles; ++kt) {
    const int64_t n = len - kt * kBk < kBk ? len - kt * kBk : kBk;
    load_tile_t<T, A>(k + kt * kBk * a.k_stride, a.k_stride, d, n, kt_all + kt * dp * kBk, dp);
    load_tile_t<T, A>(v + kt * kBk * a.v_stride, a.v_stride, d, n, vt_all + kt * dp * kBk, dp);
  }
  // D_i = sum_j P_ij dP_ij (dP the grad of the dropped probabilities) = dO_i . O_i.
  for (int64_t r = 0; r < len; ++r) {
    A acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t c = 0; c < d; ++c) acc += dob[r * dp + c] * static_cast<A>(E::load(out + r * od, c));
    dvec[r] = acc;
    lse[r] = lse_in[r];
  }

  const uint32_t pair = static_cast<uint32_t>(item);
  uint32_t u[kBk];
  for (int64_t kt = 0; kt < dims.tiles; ++kt) {
    const int64_t valid = len - kt * kBk < kBk ? len - kt * kBk : kBk;
    for (int64_t i = 0; i < kBk * dp; ++i) dkb[i] = dvb[i] = 0;
    const A* ktile = kt_all + kt * dp * kBk;
    const A* vtile = vt_all + kt * dp * kBk;
    for (int64_t q0 = 0; q0 < len; q0 += kBq) {
      const int64_t rows = len - q0 < kBq ? len - q0 : kBq;
      tile_abt<A>(qs + q0 * dp, dp, ktile, p, rows);        // S
      tile_abt<A>(dob + q0 * dp, dp, vtile, ds, rows);      // dP (of the dropped probabilities)
      for (int64_t r = 0; r < rows; ++r) {
        A* pr = p + r * kBk;
        A* dsr = ds + r * kBk;
        const A lr = lse[q0 + r], dr = dvec[q0 + r];
        if (a.dropout) {
          attn_philox_tile(a.seed, pair, static_cast<uint32_t>(q0 + r), kt, u);
#pragma omp simd
          for (int64_t c = 0; c < kBk; ++c) {
            const A prob = c < valid ? exp_approx(pr[c] - lr) : A(0);
            const A keep = u[c] >= a.threshold ? keep_scale : A(0);
            pr[c] = prob * keep;                       // dropped probabilities, for dV
            dsr[c] = prob * (dsr[c] * keep - dr);      // grad of the scaled scores
          }
        } else {
#pragma omp simd
          for (int64_t c = 0; c < kBk; ++c) {
            const A prob = c < valid ? exp_approx(pr[c] - lr) : A(0);
            pr[c] = prob;
            dsr[c] = prob * (dsr[c] - dr);
          }
        }
      }
      tile_atb_acc<A>(p, dob + q0 * dp, dp, dvb, rows);           // dV += Pd^T dO
      tile_atb_acc<A>(ds, qs + q0 * dp, dp, dkb, rows);           // dK += dS^T (scale Q)
      tile_ab_acc<A>(ds, kr + kt * kBk * dp, dp, dqb + q0 * dp, rows, valid);  // dQ += dS K
    }
    for (int64_t r = 0; r < valid; ++r) {
      T* dkr = dk + (kt * kBk + r) * a.dk_stride;
      T* dvr = dv + (kt * kBk + r) * a.dv_stride;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) {
        E::store(dkr, c, dkb[r * dp + c]);
        E::store(dvr, c, dvb[r * dp + c]);
      }
    }
  }
  for (int64_t r = 0; r < len; ++r) {
    T* dqr = dq + r * a.dq_stride;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) E::store(dqr, c, scale * dqb[r * dp + c]);
  }
}

// The keep mask of one (sequence, head) as uint8 [len][len] at `mask` (tests check the
// kernel's outputs against a reference that applies this mask).
template <typename T>
void attn_mask(const AttnFwdArgs& a, int64_t item, uint8_t* mask) {
  const int64_t seq = item / a.heads;
  const int64_t len = a.cu_seqlens[seq + 1] - a.cu_seqlens[seq];
  uint32_t u[kBk];
  for (int64_t r = 0; r < len; ++r)
    for (int64_t kt = 0; kt * kBk < len; ++kt) {
      attn_philox_tile(a.seed, static_cast<uint32_t>(item), static_cast<uint32_t>(r), kt, u);
      for (int64_t c = 0; c < kBk && kt * kBk + c < len; ++c)
        mask[r * len + kt * kBk + c] = u[c] >= a.threshold ? 1 : 0;
    }
}
