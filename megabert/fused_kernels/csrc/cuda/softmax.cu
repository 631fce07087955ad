// Scaled masked softmax on CUDA: one warp per row, the row held in registers.
//
// Attention rows are short (BERT: 128 or 512 keys), so a warp holds a whole row, reads
// it once and writes it once, and the max and the sum are warp shuffles: no shared
// memory and no second pass over global memory (the layout of Megatron-LM's
// scaled_masked_softmax). The key count rounded up to a power of two is a template
// parameter so that the per-thread arrays are registers; 4096 keys is 128 floats a
// thread, the most that stays clear of heavy spilling.
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "ops.h"

namespace megabert {
namespace cuda {
namespace {

constexpr int kMaxLog2Keys = 12;  // 4096 keys
constexpr int kRowsPerBlock = 4;  // four warps, one row each

// Thread `lane` holds elements (it * 32 + lane) * VEC + [0, VEC) for it < ITERS.
template <int LOG2_KEYS, int VEC>
struct RowLayout {
  static constexpr int kKeys = 1 << LOG2_KEYS;
  static constexpr int kPerThread = kKeys > kWarpSize ? kKeys / kWarpSize : 1;
  static_assert(kPerThread % VEC == 0, "a pack must fit in a thread's share of the row");
  static constexpr int kIters = kPerThread / VEC;
  __device__ static int col(int it, int lane) { return (it * kWarpSize + lane) * VEC; }
};

template <typename T, int LOG2_KEYS, int VEC>
__global__ void __launch_bounds__(kWarpSize* kRowsPerBlock)
    softmax_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, const bool* __restrict__ mask, int64_t rows,
                       int heads, int sq, int sk, int64_t mask_stride_b, int64_t mask_stride_h,
                       int64_t mask_stride_q, float scale) {
  using L = RowLayout<LOG2_KEYS, VEC>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y;
  if (row >= rows) return;  // whole warps leave together: the shuffles below stay full-warp
  const int lane = threadIdx.x;
  x += row * sk;
  y += row * sk;
  if (mask != nullptr) {
    const int64_t q = row % sq, h = (row / sq) % heads, b = row / (static_cast<int64_t>(sq) * heads);
    mask += b * mask_stride_b + h * mask_stride_h + q * mask_stride_q;
  }

  float v[L::kIters][VEC];
  float m = -INFINITY;
#pragma unroll
  for (int it = 0; it < L::kIters; ++it) {
    const int c = L::col(it, lane);
    if (c < sk) {  // VEC > 1 only when sk % VEC == 0, so a pack is all in or all out
      load_pack<T, VEC>(x + c, v[it]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        v[it][i] = (mask != nullptr && mask[c + i]) ? -INFINITY : v[it][i] * scale;
        m = fmaxf(m, v[it][i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[it][i] = -INFINITY;
    }
  }
  m = warp_max(m);

  float sum = 0.0f;
  if (m != -INFINITY) {  // a fully masked row keeps sum = 0 and is written as zeros
#pragma unroll
    for (int it = 0; it < L::kIters; ++it) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        v[it][i] = __expf(v[it][i] - m);  // exp(-inf) = 0 for masked keys
        sum += v[it][i];
      }
    }
    sum = warp_sum(sum);
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
  for (int it = 0; it < L::kIters; ++it) {
    const int c = L::col(it, lane);
    if (c < sk) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[it][i] = m == -INFINITY ? 0.0f : v[it][i] * inv;
      store_pack<T, VEC>(y + c, v[it]);
    }
  }
}

// grad_x = scale * y * (grad_y - sum(grad_y * y)); masked keys have y = 0.
// Up to 2048 keys a thread keeps both rows in registers; at 4096 that is 256 floats,
// which spills, so grad_y is read again (an L1/L2 hit: this warp just read it).
// Unpacked at 4096 (VEC 1: a row length that is no multiple of the pack, or unaligned
// rows), even y's 128 floats spilled on sm_80 (255 registers, ~100 bytes of local memory:
// one load, address and bounds check per element where packs share them), so there only
// the first half of y stays and the second half is read again as grad_y is. A value read
// again is the same load converted the same way: the results are bitwise unchanged.
template <typename T, int LOG2_KEYS, int VEC>
__global__ void __launch_bounds__(kWarpSize* kRowsPerBlock)
    softmax_bwd_kernel(const T* __restrict__ grad_y, const T* __restrict__ y, T* __restrict__ grad_x, int64_t rows,
                       int sk, float scale) {
  using L = RowLayout<LOG2_KEYS, VEC>;
  constexpr bool kHoldGrad = L::kPerThread <= 64;
  constexpr int kHeldY = kHoldGrad || VEC > 1 ? L::kIters : L::kIters / 2;  // iterations whose y stays
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y;
  if (row >= rows) return;
  const int lane = threadIdx.x;
  grad_y += row * sk;
  y += row * sk;
  grad_x += row * sk;

  float p[L::kIters][VEC], g_held[kHoldGrad ? L::kIters : 1][VEC];
  float dot = 0.0f;
#pragma unroll
  for (int it = 0; it < L::kIters; ++it) {
    const int c = L::col(it, lane);
    if (c < sk) {
      float(&g)[VEC] = g_held[kHoldGrad ? it : 0];
      load_pack<T, VEC>(grad_y + c, g);
      load_pack<T, VEC>(y + c, p[it]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) dot += g[i] * p[it][i];
    }
  }
  dot = warp_sum(dot);
#pragma unroll
  for (int it = 0; it < L::kIters; ++it) {
    const int c = L::col(it, lane);
    if (c < sk) {
      float(&g)[VEC] = g_held[kHoldGrad ? it : 0];
      if (!kHoldGrad) load_pack<T, VEC>(grad_y + c, g);
      if (it >= kHeldY) load_pack<T, VEC>(y + c, p[it]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) p[it][i] = scale * p[it][i] * (g[i] - dot);
      store_pack<T, VEC>(grad_x + c, p[it]);
    }
  }
}

int log2_ceil(int n) {
  int log2 = 0;
  while ((1 << log2) < n) ++log2;
  return log2;
}

// Calls fn(integral_constant<int, LOG2>, integral_constant<int, VEC>) for the row length
// and the widest pack the row length and the pointers allow.
template <typename T, int LOG2 = 0, typename F>
void dispatch_row(int log2_keys, bool packed, F&& fn) {
  if constexpr (LOG2 > kMaxLog2Keys) {
    TORCH_CHECK(false, "scaled_masked_softmax: more than ", 1 << kMaxLog2Keys, " keys");
  } else if (log2_keys != LOG2) {
    dispatch_row<T, LOG2 + 1>(log2_keys, packed, fn);
  } else {
    constexpr int per_thread = RowLayout<LOG2, 1>::kPerThread;
    constexpr int vec = per_thread < max_pack<T>() ? per_thread : max_pack<T>();
    if (packed && vec > 1) {
      fn(std::integral_constant<int, LOG2>{}, std::integral_constant<int, vec>{});
    } else {
      fn(std::integral_constant<int, LOG2>{}, std::integral_constant<int, 1>{});
    }
  }
}

template <typename T>
bool can_pack(int sk, std::initializer_list<const void*> ptrs) {
  if (sk % max_pack<T>() != 0) return false;
  for (const void* p : ptrs) {
    if (!aligned_to(p, 16)) return false;
  }
  return true;
}

void check_scores(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda(), what, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
  TORCH_CHECK(t.size(-1) <= (1 << kMaxLog2Keys), what, ": the CUDA kernel takes up to ", 1 << kMaxLog2Keys,
              " keys, got ", t.size(-1));
}

dim3 grid_for(int64_t rows) {
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  TORCH_CHECK(blocks <= INT32_MAX, "scaled_masked_softmax: ", rows, " rows is more than one launch takes");
  return dim3(static_cast<unsigned>(blocks));
}

}  // namespace

at::Tensor scaled_masked_softmax_forward(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale) {
  check_scores(x, "scores");
  TORCH_CHECK(x.dim() == 4, "scores must be [b, heads, sq, sk], got ", x.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  const bool* mask_ptr = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_q = 0;
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool, "mask must be bool (True = masked out), got ", m.scalar_type());
    TORCH_CHECK(m.device() == x.device(), "mask must be on ", x.device(), ", got ", m.device());
    TORCH_CHECK(m.sizes() == x.sizes(), "mask must be expanded to the scores' shape ", x.sizes(), ", got ", m.sizes());
    TORCH_CHECK(m.size(3) <= 1 || m.stride(3) == 1, "mask's last dim must be contiguous");
    mask_ptr = m.data_ptr<bool>();
    stride_b = m.stride(0), stride_h = m.stride(1), stride_q = m.stride(2);
  }
  const int sk = static_cast<int>(x.size(3));
  const int64_t rows = sk == 0 ? 0 : x.numel() / sk;
  if (rows == 0) return y;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(x.scalar_type(), "scaled_masked_softmax", [&](auto tag) {
    using T = decltype(tag);
    const bool packed = can_pack<T>(sk, {x.data_ptr(), y.data_ptr()});
    dispatch_row<T>(log2_ceil(sk), packed, [&](auto log2, auto vec) {
      softmax_fwd_kernel<T, decltype(log2)::value, decltype(vec)::value>
          <<<grid_for(rows), dim3(kWarpSize, kRowsPerBlock), 0, stream>>>(
              static_cast<const T*>(x.data_ptr()), static_cast<T*>(y.data_ptr()), mask_ptr, rows,
              static_cast<int>(x.size(1)), static_cast<int>(x.size(2)), sk, stride_b, stride_h, stride_q,
              static_cast<float>(scale));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor scaled_masked_softmax_backward(const at::Tensor& grad_y, const at::Tensor& y, double scale) {
  check_scores(y, "softmax output");
  check_scores(grad_y, "softmax output grad");
  TORCH_CHECK(grad_y.sizes() == y.sizes() && grad_y.scalar_type() == y.scalar_type(),
              "grad ", grad_y.sizes(), " ", grad_y.scalar_type(), " does not match output ", y.sizes(), " ",
              y.scalar_type());
  const c10::cuda::CUDAGuard guard(y.device());
  at::Tensor grad_x = at::empty_like(y);
  const int sk = static_cast<int>(y.size(-1));
  const int64_t rows = sk == 0 ? 0 : y.numel() / sk;
  if (rows == 0) return grad_x;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(y.scalar_type(), "scaled_masked_softmax backward", [&](auto tag) {
    using T = decltype(tag);
    const bool packed = can_pack<T>(sk, {grad_y.data_ptr(), y.data_ptr(), grad_x.data_ptr()});
    dispatch_row<T>(log2_ceil(sk), packed, [&](auto log2, auto vec) {
      softmax_bwd_kernel<T, decltype(log2)::value, decltype(vec)::value>
          <<<grid_for(rows), dim3(kWarpSize, kRowsPerBlock), 0, stream>>>(
              static_cast<const T*>(grad_y.data_ptr()), static_cast<const T*>(y.data_ptr()),
              static_cast<T*>(grad_x.data_ptr()), rows, sk, static_cast<float>(scale));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_x;
}

}  // namespace cuda
}  // namespace megabert
