// Attention over the real tokens of a batch (varlen), forward and backward, compiled once per
// instruction set (included by row_kernels.h inside namespace megabert::cpu::MEGABERT_ISA,
// after Elem<T>, exp_approx and dropout_kernels.h's Philox and attention keep words).
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
// A sliding window (window_left, window_right: query i sees keys i - left .. i + right, as
// FlashAttention's window_size) bounds the key tiles a query block visits in the forward and
// the query rows a key tile visits in the backward: a local layer costs O(len * window), not
// O(len^2). Keys of a visited tile outside a row's window score -inf (forward) or are
// selected away (backward), so the result equals a band-masked softmax.
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
// The backward's query blocks: dK and dV of a key tile sum over kBqB queries per pass over
// their accumulators (16 -> 32: 1.1-1.2x on the backward, measured on AVX2 Zen 3).
constexpr int64_t kBqB = 32;
constexpr int64_t kBk = kTile;  // 64
// Head-dim chunk: rows of scratch are padded to a multiple of it.
constexpr int64_t kDc = 64;

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

// Register-blocked tile GEMM: C[rows][nv vectors] (+)= sum_{i < n} a(r, i) * B[i][:], with
// a(r, i) = a[r * ars + i * ais] and B's rows `bs` apart. As a GEMM micro-kernel does, a
// block of kMR rows x kNR vectors of C stays in registers across the whole sum over i; per
// i it loads kNR vectors of B once and broadcasts kMR coefficients, so the loop issues
// kNR + kMR loads per kMR * kNR multiply-adds (AVX2: 7 per 12; the earlier two-row axpy
// issued 6 per 8 and held 8 accumulators, too few to cover the FMA latency on 2 pipes).
// Each output's sum still runs over i in order from 0 (or from C): the same sums, bitwise.
template <typename A>
struct Gemm {
  using V = typename Vec<A>::type;
  static constexpr int64_t kW = MEGABERT_VEC_BYTES / static_cast<int64_t>(sizeof(A));
  // kMR * kNR accumulators + kNR loaded vectors + one broadcast fit the register file: 16
  // registers for SSE2 and AVX2 (4 x 3: 12 + 3 + 1), 32 for AVX-512 (4 x 4: 16 + 4 + 1).
  static constexpr int kMR = 4;
  static constexpr int kNR = MEGABERT_VEC_BYTES == 64 ? 4 : 3;

  static inline V load(const A* p) {
    V v;
    __builtin_memcpy(&v, p, sizeof(V));
    return v;
  }
  static inline void store(A* p, V v) { __builtin_memcpy(p, &v, sizeof(V)); }

  // NOTE: GCC folds a loaded vector into each multiply-add that reads it (a memory
  // operand), loading it kMR times; an empty asm that claims to change it keeps it in a
  // register.
  static inline void keep_in_register(V& x) {
#if defined(__x86_64__) && defined(__GNUC__) && MEGABERT_VEC_BYTES == 64
    asm("" : "+v"(x));
#elif defined(__x86_64__) && defined(__GNUC__)
    asm("" : "+x"(x));
#else
    (void)x;
#endif
  }

  template <int MR, int NR, bool kAccumulate>
  static inline void block(A* c, int64_t cs, const A* a, int64_t ars, int64_t ais, const A* b, int64_t bs,
                           int64_t n) {
    V acc[MR][NR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NR; ++v) acc[r][v] = kAccumulate ? load(c + r * cs + v * kW) : V{};
    for (int64_t i = 0; i < n; ++i) {
      V x[NR];
#pragma GCC unroll 4
      for (int v = 0; v < NR; ++v) {
        x[v] = load(b + i * bs + v * kW);
        keep_in_register(x[v]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const A s = a[r * ars + i * ais];
#pragma GCC unroll 4
        for (int v = 0; v < NR; ++v) acc[r][v] += s * x[v];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NR; ++v) store(c + r * cs + v * kW, acc[r][v]);
  }

  // MR rows over nv vectors: blocks NR wide, then the narrower rest.
  template <int MR, int NR, bool kAccumulate>
  static inline void cols(int64_t nv, A* c, int64_t cs, const A* a, int64_t ars, int64_t ais, const A* b,
                          int64_t bs, int64_t n) {
    int64_t v0 = 0;
    for (; v0 + NR <= nv; v0 += NR) block<MR, NR, kAccumulate>(c + v0 * kW, cs, a, ars, ais, b + v0 * kW, bs, n);
    if constexpr (NR > 1)
      if (v0 < nv) cols<MR, NR - 1, kAccumulate>(nv - v0, c + v0 * kW, cs, a, ars, ais, b + v0 * kW, bs, n);
  }

  // rows x nv vectors: blocks of MR rows, then the fewer rows left.
  template <bool kAccumulate, int MR = kMR>
  static inline void run(int64_t rows, int64_t nv, A* c, int64_t cs, const A* a, int64_t ars, int64_t ais,
                         const A* b, int64_t bs, int64_t n) {
    int64_t r0 = 0;
    for (; r0 + MR <= rows; r0 += MR)
      cols<MR, kNR, kAccumulate>(nv, c + r0 * cs, cs, a + r0 * ars, ars, ais, b, bs, n);
    if constexpr (MR > 1)
      if (r0 < rows) run<kAccumulate, MR - 1>(rows - r0, nv, c + r0 * cs, cs, a + r0 * ars, ars, ais, b, bs, n);
  }
};

// C[rows][0:n] = A[rows][dp] . Bt[dp][0:n] (Bt: a key tile transposed, kBk wide; dp a
// multiple of kDc), n rounded up to whole vectors: the last tile of a sequence skips the
// vectors past its keys (columns beyond are left as they were).
template <typename A>
inline void tile_abt(const A* a, int64_t dp, const A* bt, A* c, int64_t rows, int64_t n) {
  const int64_t kW = Gemm<A>::kW;
  Gemm<A>::template run<false>(rows, (n + kW - 1) / kW, c, kBk, a, dp, 1, bt, kBk, dp);
}

// C[rows][dp] += P[rows][kBk] . B[kBk][dp] (B: rows of a tile, dp wide), over n keys.
template <typename A>
inline void tile_ab_acc(const A* p, const A* b, int64_t dp, A* c, int64_t rows, int64_t n) {
  Gemm<A>::template run<true>(rows, dp / Gemm<A>::kW, c, dp, p, kBk, 1, b, dp, n);
}

// Y[0:n][dp] += P[rows][0:n]^T . X[rows][dp] (P rows kBk apart; n keys of the tile).
template <typename A>
inline void tile_atb_acc(const A* p, const A* x, int64_t dp, A* y, int64_t rows, int64_t n) {
  Gemm<A>::template run<true>(n, dp / Gemm<A>::kW, y, dp, p, 1, kBk, x, dp, rows);
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

// The window of a sequence of len keys as finite half-widths: -1 (unbounded) or anything
// past the sequence becomes len.
struct AttnWindow {
  int64_t left, right;
  AttnWindow(int64_t l, int64_t r, int64_t len) : left(l < 0 || l > len ? len : l), right(r < 0 || r > len ? len : r) {}
  // Columns [lo, hi) of the key tile of `valid` keys from k0 that query i sees (lo >= hi: none).
  inline void cols(int64_t i, int64_t k0, int64_t valid, int32_t& lo, int32_t& hi) const {
    const int64_t a = i - left - k0, b = i + right + 1 - k0;
    lo = static_cast<int32_t>(a < 0 ? 0 : a > valid ? valid : a);
    hi = static_cast<int32_t>(b < 0 ? 0 : b > valid ? valid : b);
  }
};

// One work item (item = sequence * heads + head; attention.cpp plans none for an empty
// sequence): its sequence's tokens t0 .. t0 + len, their sizes in scratch, and this head's
// rows of q, k, v.
template <typename T>
struct AttnItem {
  int64_t head, t0, len, d;
  int64_t dp, tiles, lp;  // d padded to kDc; key tiles; len padded to whole tiles
  const T* q;
  const T* k;
  const T* v;
  AttnItem(const AttnArgs& a, int64_t item)
      : head(item % a.heads), t0(a.cu_seqlens[item / a.heads]), len(a.cu_seqlens[item / a.heads + 1] - t0),
        d(a.head_dim), dp(round_up(d, kDc)), tiles((len + kBk - 1) / kBk), lp(round_up(len, kBk)),
        q(rows(a.q, a.q_stride)), k(rows(a.k, a.k_stride)), v(rows(a.v, a.v_stride)) {}
  // This head's first row in a [T, heads, d] tensor whose tokens lie `stride` elements apart.
  const T* rows(const void* base, int64_t stride) const { return static_cast<const T*>(base) + t0 * stride + head * d; }
  T* rows(void* base, int64_t stride) const { return static_cast<T*>(base) + t0 * stride + head * d; }
  // This head's first query in a [heads, T] statistic of the math type (lse).
  template <typename A>
  A* stat(A* base, int64_t total) const { return base + head * total + t0; }
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
  return 6 * lp * dp + 2 * lp + 2 * kBk * dp + 2 * kBqB * kBk;
}

template <typename T>
void attn_fwd(const AttnFwdArgs& a, int64_t item, void* scratch_v) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const AttnItem<T> it(a, item);
  const int64_t d = it.d, dp = it.dp, len = it.len;
  const T *q = it.q, *k = it.k, *v = it.v;
  T* out = it.rows(a.out, a.heads * d);
  A* lse = it.stat(static_cast<A*>(a.lse), a.total);

  A* kt_all = static_cast<A*>(scratch_v);
  A* v_all = kt_all + it.lp * dp;
  A* qb = v_all + it.lp * dp;
  A* ob = qb + kBq * dp;
  A* s = ob + kBq * dp;
  A* m = s + kBq * kBk;
  A* l = m + kBq;
  for (int64_t kt = 0; kt < it.tiles; ++kt) {
    const int64_t n = len - kt * kBk < kBk ? len - kt * kBk : kBk;
    load_tile_t<T, A>(k + kt * kBk * a.k_stride, a.k_stride, d, n, kt_all + kt * dp * kBk, dp);
  }
  load_rows<T, A>(v, a.v_stride, d, len, A(1), v_all, dp);
  for (int64_t i = len * dp; i < it.lp * dp; ++i) v_all[i] = 0;

  const A scale = static_cast<A>(a.scale), keep_scale = static_cast<A>(a.keep_scale);
  const AttnWindow win(a.window_left, a.window_right, len);
  const uint32_t pair = static_cast<uint32_t>(item);
  uint32_t u[kBk];
  AttnPhiloxTile ptile;
  for (int64_t q0 = 0; q0 < len; q0 += kBq) {
    const int64_t rows = len - q0 < kBq ? len - q0 : kBq;
    load_rows<T, A>(q + q0 * a.q_stride, a.q_stride, d, rows, scale, qb, dp);
    for (int64_t i = 0; i < rows * dp; ++i) ob[i] = 0;
    for (int64_t r = 0; r < rows; ++r) {
      m[r] = neg_inf<A>();
      l[r] = 0;
    }
    // The key tiles some row of the block sees: keys q0 - left .. q0 + rows - 1 + right.
    const int64_t key_lo = q0 - win.left > 0 ? q0 - win.left : 0;
    const int64_t key_hi = q0 + rows - 1 + win.right < len ? q0 + rows - 1 + win.right : len - 1;
    for (int64_t kt = key_lo / kBk; kt <= key_hi / kBk; ++kt) {
      const int64_t valid = len - kt * kBk < kBk ? len - kt * kBk : kBk;
      tile_abt<A>(qb, dp, kt_all + kt * dp * kBk, s, rows, valid);
      if (a.dropout) attn_philox_prepare(a.seed, pair, kt, ptile);
      for (int64_t r = 0; r < rows; ++r) {
        A* sr = s + r * kBk;
        int32_t lo, hi;
        win.cols(q0 + r, kt * kBk, valid, lo, hi);
        if (lo >= hi) {
          // No key of this tile in the row's window: no term (m, l and the row unchanged).
          for (int64_t c = 0; c < kBk; ++c) sr[c] = 0;
          continue;
        }
        // Keys outside the window or past the sequence (the last tile) score -inf: out of
        // the max, exp gives exactly 0.
        for (int64_t c = 0; c < lo; ++c) sr[c] = neg_inf<A>();
        for (int64_t c = hi; c < kBk; ++c) sr[c] = neg_inf<A>();
        A mx = m[r];
#pragma omp simd reduction(max : mx)
        for (int64_t c = 0; c < kBk; ++c) mx = sr[c] > mx ? sr[c] : mx;
        const A alpha = exp_approx(m[r] - mx);  // 0 on the first tile (m = -inf)
        const A sum = exp_sum(sr, kBk, mx);
        m[r] = mx;
        l[r] = l[r] * alpha + sum;  // the softmax sum counts every key, dropped or not
        A* orow = ob + r * dp;
        for (int64_t c = 0; c < dp; ++c) orow[c] *= alpha;
        if (a.dropout) {
          attn_philox_row(a.seed, ptile, static_cast<uint32_t>(q0 + r), u);
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
  const AttnItem<T> it(a, item);
  const int64_t d = it.d, dp = it.dp, len = it.len, lp = it.lp;
  const int64_t od = a.heads * d;  // token stride of out / grad_out
  const T *q = it.q, *k = it.k, *v = it.v;
  const T* out = it.rows(a.out, od);
  const T* dout = it.rows(a.grad_out, od);
  const A* lse_in = it.stat(static_cast<const A*>(a.lse), a.total);
  T* dq = it.rows(a.grad_q, a.dq_stride);
  T* dk = it.rows(a.grad_k, a.dk_stride);
  T* dv = it.rows(a.grad_v, a.dv_stride);

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
  A* ds = p + kBqB * kBk;

  const A scale = static_cast<A>(a.scale), keep_scale = static_cast<A>(a.keep_scale);
  load_rows<T, A>(q, a.q_stride, d, len, scale, qs, dp);
  load_rows<T, A>(k, a.k_stride, d, len, A(1), kr, dp);
  load_rows<T, A>(dout, od, d, len, A(1), dob, dp);
  for (int64_t i = len * dp; i < lp * dp; ++i) qs[i] = kr[i] = dob[i] = 0;
  for (int64_t i = 0; i < lp * dp; ++i) dqb[i] = 0;
  for (int64_t kt = 0; kt < it.tiles; ++kt) {
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

  const AttnWindow win(a.window_left, a.window_right, len);
  const uint32_t pair = static_cast<uint32_t>(item);
  uint32_t u[kBk];
  AttnPhiloxTile ptile;
  for (int64_t kt = 0; kt < it.tiles; ++kt) {
    const int64_t valid = len - kt * kBk < kBk ? len - kt * kBk : kBk;
    const int64_t k0 = kt * kBk;
    // The queries that see some key of the tile: k0 - right .. k0 + valid - 1 + left.
    const int64_t q_lo = k0 - win.right > 0 ? k0 - win.right : 0;
    const int64_t q_end = k0 + valid + win.left < len ? k0 + valid + win.left : len;
    for (int64_t i = 0; i < kBk * dp; ++i) dkb[i] = dvb[i] = 0;
    if (a.dropout) attn_philox_prepare(a.seed, pair, kt, ptile);
    const A* ktile = kt_all + kt * dp * kBk;
    const A* vtile = vt_all + kt * dp * kBk;
    for (int64_t q0 = q_lo; q0 < q_end; q0 += kBqB) {
      const int64_t rows = q_end - q0 < kBqB ? q_end - q0 : kBqB;
      tile_abt<A>(qs + q0 * dp, dp, ktile, p, rows, valid);    // S
      tile_abt<A>(dob + q0 * dp, dp, vtile, ds, rows, valid);  // dP (of the dropped probabilities)
      for (int64_t r = 0; r < rows; ++r) {
        A* pr = p + r * kBk;
        A* dsr = ds + r * kBk;
        const A lr = lse[q0 + r], dr = dvec[q0 + r];
        int32_t lo, hi;  // the row's window within the tile's keys
        win.cols(q0 + r, k0, valid, lo, hi);
        if (a.dropout) {
          attn_philox_row(a.seed, ptile, static_cast<uint32_t>(q0 + r), u);
          // Past the keys the tiles hold stale values, outside the window scores that get no
          // probability: computed on, then selected away.
          // NOTE: loads and exp stay unconditional and the column index 32-bit: a
          // conditional exp made GCC emit masked loads and stores (vmaskmovps, microcoded
          // on AMD) and 64-bit lane compares.
#pragma omp simd
          for (int32_t c = 0; c < kBk; ++c) {
            const A e = exp_approx(pr[c] - lr);
            const A keep = u[c] >= a.threshold ? keep_scale : A(0);
            const A g = e * (dsr[c] * keep - dr);
            const bool in = c >= lo && c < hi;
            pr[c] = in ? e * keep : A(0);  // dropped probabilities, for dV
            dsr[c] = in ? g : A(0);        // grad of the scaled scores
          }
        } else {
#pragma omp simd
          for (int32_t c = 0; c < kBk; ++c) {
            const A e = exp_approx(pr[c] - lr);
            const A g = e * (dsr[c] - dr);
            const bool in = c >= lo && c < hi;
            pr[c] = in ? e : A(0);
            dsr[c] = in ? g : A(0);
          }
        }
      }
      tile_atb_acc<A>(p, dob + q0 * dp, dp, dvb, rows, valid);    // dV += Pd^T dO
      tile_atb_acc<A>(ds, qs + q0 * dp, dp, dkb, rows, valid);    // dK += dS^T (scale Q)
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
void attn_mask(const AttnArgs& a, int64_t item, uint8_t* mask) {
  const int64_t seq = item / a.heads;
  const int64_t len = a.cu_seqlens[seq + 1] - a.cu_seqlens[seq];
  uint32_t u[kBk];
  AttnPhiloxTile ptile;
  for (int64_t kt = 0; kt * kBk < len; ++kt) {
    attn_philox_prepare(a.seed, static_cast<uint32_t>(item), kt, ptile);
    for (int64_t r = 0; r < len; ++r) {
      attn_philox_row(a.seed, ptile, static_cast<uint32_t>(r), u);
      for (int64_t c = 0; c < kBk && kt * kBk + c < len; ++c)
        mask[r * len + kt * kBk + c] = u[c] >= a.threshold ? 1 : 0;
    }
  }
}
