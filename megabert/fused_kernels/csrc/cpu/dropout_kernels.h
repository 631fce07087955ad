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

// Ten Philox4x32-10 rounds on kLanes counters (c0..c3, in place) under key `seed`. Plain
// lane loops: the vectoriser turns the 32x32->64 products into vpmuludq.
inline void philox_rounds(uint64_t seed, uint32_t* c0, uint32_t* c1, uint32_t* c2, uint32_t* c3) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) {
      const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0[j];
      const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2[j];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[j] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[j] ^ k1;
      c1[j] = static_cast<uint32_t>(p1);
      c3[j] = static_cast<uint32_t>(p0);
      c0[j] = n0;
      c2[j] = n2;
    }
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
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
