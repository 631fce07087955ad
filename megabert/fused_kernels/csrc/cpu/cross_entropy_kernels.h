// Cross entropy over column chunks of the MLM logits (megabert/ops/linear_cross_entropy.py),
// included by row_kernels.h inside namespace megabert::cpu::MEGABERT_ISA (after Elem<T>,
// exp_approx and neg_inf). One call runs rows [row_begin, row_end) of every chunk, so a
// step pays one fork for the log-sum-exp of all chunks, and one per chunk for its gradient.

// lse[row] = log sum_j exp(logits[row, j]) over all chunks. Each chunk's row (at most a few
// KB) is read twice from L1 (max, then the sum of exps against it) and folded into the
// running (max, sum) of the row.
template <typename T>
void ce_lse(const CeLseArgs& a, int64_t row_begin, int64_t row_end) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  A* lse = static_cast<A*>(a.lse);
  for (int64_t row = row_begin; row < row_end; ++row) {
    A m = neg_inf<A>(), s = 0;
    for (int64_t c = 0; c < a.num_chunks; ++c) {
      const int64_t w = a.widths[c];
      const T* r = static_cast<const T*>(a.chunks[c]) + row * w;
      A mc = neg_inf<A>();
#pragma omp simd reduction(max : mc)
      for (int64_t j = 0; j < w; ++j) mc = E::load(r, j) > mc ? E::load(r, j) : mc;
      if (mc == neg_inf<A>()) continue;  // an empty chunk row adds nothing
      A sc = 0;
#pragma omp simd reduction(+ : sc)
      for (int64_t j = 0; j < w; ++j) sc += exp_approx(E::load(r, j) - mc);
      if (mc > m) {
        s = s * exp_approx(m - mc) + sc;  // exp(-inf) = 0 on the first chunk
        m = mc;
      } else {
        s += sc * exp_approx(mc - m);
      }
    }
    lse[row] = m + static_cast<A>(__builtin_log(static_cast<double>(s)));
  }
}

// p[row, j] = exp(logits[row, j] - lse[row]) * g[row]: softmax times the row's loss
// gradient, for one chunk (logits contiguous [rows, c]; p rows ld_p apart).
template <typename T>
void ce_grad(const CeGradArgs& a, int64_t row_begin, int64_t row_end) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const T* logits = static_cast<const T*>(a.logits);
  const A* lse = static_cast<const A*>(a.lse);
  const A* g = static_cast<const A*>(a.g);
  T* p = static_cast<T*>(a.p);
  const int64_t c = a.c;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* lr = logits + row * c;
    T* pr = p + row * a.ld_p;
    const A l = lse[row], gr = g[row];
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) E::store(pr, j, exp_approx(E::load(lr, j) - l) * gr);
  }
}
