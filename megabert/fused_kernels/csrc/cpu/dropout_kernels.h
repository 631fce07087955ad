// Fused dropout + residual add, compiled once per instruction set (included by
// row_kernels.h, inside namespace megabert::cpu::MEGABERT_ISA, after Elem<T>).
//
// out = residual + keep * (x * scale), keep = (philox(seed, i) >= threshold), in one
// pass over memory; the keep mask is written as uint8 for the backward. torch's CPU
// dropout draws a float mask with bernoulli_, divides it, multiplies and then the
// residual is added: four passes and a 4-byte mask (issue 10).
//
// NOTE: element i's random word depends only on (seed, i), never on how the elements
// are split over threads or on the instruction set: kLanes counters make one tile of
// 4 * kLanes elements, and word w of counter (tile * kLanes + j) decides element
// tile * 4 * kLanes + w * kLanes + j. So every ISA and thread count draws the same mask.

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011),
// the generator of cuRAND and of torch's CUDA dropout.
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;
// 16 counters per tile: two AVX2 vectors (independent chains hide the multiply
// latency) or one AVX-512 vector.
constexpr int64_t kLanes = 16;
constexpr int64_t kTile = 4 * kLanes;

#ifndef MEGABERT_VEC_BYTES
#define MEGABERT_VEC_BYTES 16
#endif

// Philox on whole vectors of 32-bit counters. Each round needs the high and the low half
// of two 32x32 -> 64-bit products per counter; written as lane loops over uint64_t, GCC
// packs the halves back with shuffles, and the generator cost more than the two attention
// GEMMs it masks (issue 31's seq 512 profile). x86's (v)pmuludq multiplies the even 32-bit
// lanes into 64-bit lanes; one on the counters and one on them shifted down by 32 give
// every product, and the halves are put back in place with shifts and masks.
typedef uint32_t U32Vec __attribute__((vector_size(MEGABERT_VEC_BYTES)));
typedef uint64_t U64Vec __attribute__((vector_size(MEGABERT_VEC_BYTES)));
constexpr int64_t kU32PerVec = MEGABERT_VEC_BYTES / 4;
static_assert(kLanes % kU32PerVec == 0, "kLanes must be a multiple of the vector width");

// 64-bit lane i = (32-bit lane 2i of a) * (32-bit lane 2i of b).
inline U64Vec mul_even_u32(U32Vec a, U32Vec b) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && MEGABERT_VEC_BYTES == 64
  typedef int v16si __attribute__((vector_size(64)));
  typedef long long v8di __attribute__((vector_size(64)));
  return (U64Vec)__builtin_ia32_pmuludq512_mask((v16si)a, (v16si)b, (v8di){}, static_cast<unsigned char>(0xff));
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && MEGABERT_VEC_BYTES == 32
  typedef int v8si __attribute__((vector_size(32)));
  return (U64Vec)__builtin_ia32_pmuludq256((v8si)a, (v8si)b);
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && MEGABERT_VEC_BYTES == 16
  typedef int v4si __attribute__((vector_size(16)));
  return (U64Vec)__builtin_ia32_pmuludq128((v4si)a, (v4si)b);
#else
  // Other compilers and architectures: the plain product of the zero-extended lanes.
  const U64Vec low = U64Vec{} + 0xFFFFFFFFull;
  return ((U64Vec)a & low) * ((U64Vec)b & low);
#endif
}

// Lanes 2i of `even` and 2i + 1 of `odd`: with AVX2 and AVX-512 one blend (vpblendd /
// a masked move) where masks take an and, an and-not and an or.
inline U32Vec merge_even_odd(U32Vec even, U32Vec odd) {
#if MEGABERT_VEC_BYTES >= 32
  U32Vec idx;
  for (int64_t i = 0; i < kU32PerVec; ++i) idx[i] = static_cast<uint32_t>(i + (i & 1) * kU32PerVec);
  return __builtin_shuffle(even, odd, idx);
#else
  // SSE2 has no 32-bit blend; the masks are as cheap as its shuffles.
  const U32Vec low = (U32Vec)(U64Vec{} + 0xFFFFFFFFull);
  return (even & low) | (odd & ~low);
#endif
}

// hi, lo: the high and low 32 bits of a * m, lane by lane.
inline void mul_hi_lo(U32Vec a, U32Vec m, U32Vec& hi, U32Vec& lo) {
  const U64Vec even = mul_even_u32(a, m);
  const U64Vec odd = mul_even_u32((U32Vec)((U64Vec)a >> 32), m);
  lo = merge_even_odd((U32Vec)even, (U32Vec)(odd << 32));
  hi = merge_even_odd((U32Vec)(even >> 32), (U32Vec)odd);
}

// Philox4x32-10's rounds first_round .. 9 on kLanes counters (c0..c3, in place) under key
// `seed` (first_round > 0: the caller ran the earlier rounds itself).
inline void philox_rounds(uint64_t seed, uint32_t* c0, uint32_t* c1, uint32_t* c2, uint32_t* c3,
                          int first_round = 0) {
  constexpr int64_t n = kLanes / kU32PerVec, bytes = MEGABERT_VEC_BYTES;
  U32Vec x0[n], x1[n], x2[n], x3[n];
  for (int64_t i = 0; i < n; ++i) {
    __builtin_memcpy(&x0[i], c0 + i * kU32PerVec, bytes);
    __builtin_memcpy(&x1[i], c1 + i * kU32PerVec, bytes);
    __builtin_memcpy(&x2[i], c2 + i * kU32PerVec, bytes);
    __builtin_memcpy(&x3[i], c3 + i * kU32PerVec, bytes);
  }
  const U32Vec m0 = U32Vec{} + kPhiloxM0, m1 = U32Vec{} + kPhiloxM1;
  uint32_t k0 = static_cast<uint32_t>(seed) + static_cast<uint32_t>(first_round) * kPhiloxW0;
  uint32_t k1 = static_cast<uint32_t>(seed >> 32) + static_cast<uint32_t>(first_round) * kPhiloxW1;
  for (int round = first_round; round < 10; ++round) {
#pragma GCC unroll 4
    for (int64_t i = 0; i < n; ++i) {
      U32Vec hi0, lo0, hi1, lo1;
      mul_hi_lo(x0[i], m0, hi0, lo0);
      mul_hi_lo(x2[i], m1, hi1, lo1);
      x0[i] = hi1 ^ x1[i] ^ k0;
      x2[i] = hi0 ^ x3[i] ^ k1;
      x1[i] = lo1;
      x3[i] = lo0;
    }
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  for (int64_t i = 0; i < n; ++i) {
    __builtin_memcpy(c0 + i * kU32PerVec, &x0[i], bytes);
    __builtin_memcpy(c1 + i * kU32PerVec, &x1[i], bytes);
    __builtin_memcpy(c2 + i * kU32PerVec, &x2[i], bytes);
    __builtin_memcpy(c3 + i * kU32PerVec, &x3[i], bytes);
  }
}

// The 4 * kLanes random words of tile `tile`: u[w * kLanes + j] is word w of counter
// tile * kLanes + j.
inline void philox_tile(uint64_t seed, int64_t tile, uint32_t* u) {
  uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
  const uint64_t first = static_cast<uint64_t>(tile) * kLanes;
  for (int64_t j = 0; j < kLanes; ++j) {
    const uint64_t ctr = first + static_cast<uint64_t>(j);
    c0[j] = static_cast<uint32_t>(ctr);
    c1[j] = static_cast<uint32_t>(ctr >> 32);
    c2[j] = 0;
    c3[j] = 0;
  }
  philox_rounds(seed, c0, c1, c2, c3);
  for (int64_t j = 0; j < kLanes; ++j) {
    u[j] = c0[j];
    u[kLanes + j] = c1[j];
    u[2 * kLanes + j] = c2[j];
    u[3 * kLanes + j] = c3[j];
  }
}

// Elements [begin, end) of out = residual + keep * (x * scale). The product by keep
// (0 or 1) is exact, so a contracted multiply-add gives the same bits as the separate
// multiply and add that the tests (and torch) compute.
template <typename T>
void dropout_add_fwd(const DropoutAddFwdArgs& a, int64_t begin, int64_t end) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const T* x = static_cast<const T*>(a.x);
  const T* r = static_cast<const T*>(a.residual);
  T* out = static_cast<T*>(a.out);
  uint8_t* mask = a.mask;
  const A scale = static_cast<A>(a.scale);
  const uint32_t threshold = a.threshold;
  uint32_t u[kTile];
  for (int64_t tile = begin / kTile; tile * kTile < end; ++tile) {
    philox_tile(a.seed, tile, u);
    const int64_t t0 = tile * kTile;
    const int64_t lo = begin > t0 ? begin - t0 : 0;
    const int64_t hi = end - t0 < kTile ? end - t0 : kTile;
    if (lo == 0 && hi == kTile) {  // full tile: fixed trip count, fully vectorised
#pragma omp simd
      for (int64_t k = 0; k < kTile; ++k) {
        // An int 0/1 (not a bool) so that the vectoriser converts it to a float lane.
        const int32_t keep = u[k] >= threshold ? 1 : 0;
        mask[t0 + k] = static_cast<uint8_t>(keep);
        E::store(out, t0 + k, E::load(r, t0 + k) + (E::load(x, t0 + k) * scale) * static_cast<A>(keep));
      }
    } else {
      for (int64_t k = lo; k < hi; ++k) {
        const int32_t keep = u[k] >= threshold ? 1 : 0;
        mask[t0 + k] = static_cast<uint8_t>(keep);
        E::store(out, t0 + k, E::load(r, t0 + k) + (E::load(x, t0 + k) * scale) * static_cast<A>(keep));
      }
    }
  }
}

// grad_x = keep * (grad * scale) over elements [begin, end).
template <typename T>
void dropout_bwd(const DropoutBwdArgs& a, int64_t begin, int64_t end) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const T* g = static_cast<const T*>(a.grad);
  const uint8_t* mask = a.mask;
  T* gx = static_cast<T*>(a.grad_x);
  const A scale = static_cast<A>(a.scale);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    E::store(gx, i, (E::load(g, i) * scale) * static_cast<A>(static_cast<int32_t>(mask[i])));
  }
}

// ---- attention dropout's keep words (attention_kernels.h) ----------------------------

// Philox counter word 3 for attention masks: dropout_add's counters keep it 0.
constexpr uint32_t kAttnDomain = 0x61747431u;

// The keep words of (pair, row, key tile kt) in two steps. Of an attention counter only c0
// varies across a tile's lanes and only c1 (the row) across its rows, so Philox's first two
// rounds split into a part per (pair, tile), drawn once per tile (prepare), and a part per
// row that is lane-uniform (one scalar product); the row then runs rounds 2..9 on vectors.
// The words are Philox4x32-10's, bit for bit: 8 vector rounds per row instead of 10.
struct AttnPhiloxTile {
  uint32_t x0[kLanes], x1[kLanes], x3k[kLanes];  // after round 1: words 0, 1; word 3 ^ round 1's key 1
  uint32_t pair_hi;                               // round 0's high half of pair * M1
};

inline void attn_philox_prepare(uint64_t seed, uint32_t pair, int64_t kt, AttnPhiloxTile& t) {
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const uint64_t pm = static_cast<uint64_t>(pair) * kPhiloxM1;
  t.pair_hi = static_cast<uint32_t>(pm >> 32);
  for (int64_t j = 0; j < kLanes; ++j) {
    // Round 0 (keys k0, k1) of counter (c0, row, pair, kAttnDomain), its row-free words.
    const uint64_t a = static_cast<uint64_t>(static_cast<uint32_t>(kt * kLanes + j)) * kPhiloxM0;
    const uint32_t w1 = static_cast<uint32_t>(pm);                                // lo(pair * M1)
    const uint32_t w2 = static_cast<uint32_t>(a >> 32) ^ kAttnDomain ^ k1;        // hi(c0 * M0) ^ c3 ^ k1
    const uint32_t w3 = static_cast<uint32_t>(a);                                 // lo(c0 * M0)
    // Round 1 (keys + W): word 0's product waits for the row; word 2's is here.
    const uint64_t b = static_cast<uint64_t>(w2) * kPhiloxM1;
    t.x0[j] = static_cast<uint32_t>(b >> 32) ^ w1 ^ (k0 + kPhiloxW0);
    t.x1[j] = static_cast<uint32_t>(b);
    t.x3k[j] = w3 ^ (k1 + kPhiloxW1);
  }
}

// The 64 keep words of one row of a prepared tile: u[k] decides key kt * kBk + k.
inline void attn_philox_row(uint64_t seed, const AttnPhiloxTile& t, uint32_t row, uint32_t* u) {
  // Round 0's word 0 (hi(pair * M1) ^ row ^ k0) and round 1's product of it.
  const uint32_t w0 = t.pair_hi ^ row ^ static_cast<uint32_t>(seed);
  const uint64_t c = static_cast<uint64_t>(w0) * kPhiloxM0;
  const uint32_t hi = static_cast<uint32_t>(c >> 32), lo = static_cast<uint32_t>(c);
  // Counter word w of lane j lives at u[w * kLanes + j], where its output word goes.
  for (int64_t j = 0; j < kLanes; ++j) {
    u[j] = t.x0[j];
    u[kLanes + j] = t.x1[j];
    u[2 * kLanes + j] = hi ^ t.x3k[j];
    u[3 * kLanes + j] = lo;
  }
  philox_rounds(seed, u, u + kLanes, u + 2 * kLanes, u + 3 * kLanes, 2);
}
