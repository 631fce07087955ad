// Rotary position embeddings (rotate-half layout, as megabert/model/rope.py) fused with the
// grouped-query head layout, included by row_kernels.h inside namespace
// megabert::cpu::MEGABERT_ISA (after Elem<T> and Scratch).
//
// PyTorch makes the attention's input [rows, 3, heads, d] in many passes: for grouped-query
// attention a repeat_interleave of K and V to every query head and a cat with Q, then the
// rotation of Q and of every repeated K head (fp32 math: casts, products, a copy of V), and
// backward the rotation's transpose, the cat's split and a sum over each group, each a pass of
// its own (issue 50, item 7). Here each token's row is one pass each way: the kernel reads Q,
// K and V where the GEMMs left them and writes the attention's input once; backward it reads
// that grad once and writes the grads of Q and of K and V, each group's sum made in registers.

// o = x rotated by the angles (kInverse: by minus them) over the halves (x1, x2) of one head:
// (x1 c - x2 s, x2 c + x1 s); inverse (x1 c + x2 s, x2 c - x1 s), the rotation's transpose.
// x is read through Elem<S> (the element type, or the math type for a group's sums), o is
// written through Elem<T>.
template <bool kInverse, typename S, typename T, typename A>
inline void rotate_head(const S* x, T* o, const A* c, const A* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const A x1 = Elem<S>::load(x, i), x2 = Elem<S>::load(x + half, i);
    const A sn = kInverse ? -s[i] : s[i];
    Elem<T>::store(o, i, x1 * c[i] - x2 * sn);
    Elem<T>::store(o + half, i, x2 * c[i] + x1 * sn);
  }
}

// sum[i] = the sum over n heads (d apart from x) of x[i], for i < d, in the math type.
template <typename T, typename A>
inline void sum_heads(const T* x, int64_t n, int64_t d, A* sum) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) sum[i] = Elem<T>::load(x, i);
  for (int64_t h = 1; h < n; ++h) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) sum[i] += Elem<T>::load(x + h * d, i);
  }
}

// Rows (tokens) [row_begin, row_end) of RopeArgs (kernel_table.h); the forward when !kBackward.
template <typename T, bool kBackward>
void rope_qkv(const RopeArgs& a, int64_t row_begin, int64_t row_end) {
  using E = Elem<T>;
  using A = typename E::acc_t;
  const int64_t half = a.half, d = 2 * half, heads = a.heads, group = a.group, kv_heads = heads / group;
  // The row's cos and sin in the math type (every head reads them), and backward a key/value
  // head's sums over its group.
  Scratch<A> buf(2 * half + (kBackward ? 2 * d : 0));
  A* c = buf.data;
  A* s = c + half;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* cr = static_cast<const T*>(a.cos) + row * a.cs_row;
    const T* sr = static_cast<const T*>(a.sin) + row * a.cs_row;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      c[i] = E::load(cr, i);
      s[i] = E::load(sr, i);
    }
    T* q = static_cast<T*>(a.q) + row * a.q_row;
    T* k = static_cast<T*>(a.kv) + row * a.kv_row;
    T* v = k + a.kv_which;
    T* oq = static_cast<T*>(a.qkv) + row * 3 * heads * d;
    T* ok = oq + heads * d;
    T* ov = ok + heads * d;
    if constexpr (!kBackward) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t j = h / group;
        rotate_head<false>(q + h * a.q_head, oq + h * d, c, s, half);
        rotate_head<false>(k + j * a.kv_head, ok + h * d, c, s, half);
        __builtin_memcpy(ov + h * d, v + j * a.kv_head, d * sizeof(T));
      }
    } else {
      for (int64_t h = 0; h < heads; ++h) rotate_head<true>(oq + h * d, q + h * a.q_head, c, s, half);
      // The rotation is linear and shared by a token's heads: the transpose of the group's sum
      // is the sum of the transposes.
      A* gk = s + half;
      A* gv = gk + d;
      for (int64_t j = 0; j < kv_heads; ++j) {
        sum_heads(ok + j * group * d, group, d, gk);
        sum_heads(ov + j * group * d, group, d, gv);
        rotate_head<true>(gk, k + j * a.kv_head, c, s, half);
        T* vj = v + j * a.kv_head;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) E::store(vj, i, gv[i]);
      }
    }
  }
}
