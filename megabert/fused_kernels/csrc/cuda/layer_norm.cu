// LayerNorm on CUDA for hidden sizes up to 8192, fp32 math.
//
// Forward and grad_x: one block per row, the row held in registers (at most
// 16 floats a thread), so the input is read once and the two reductions (mean,
// then the centred variance; sum(g) and sum(g * xhat) in the backward) are block
// reductions in shared memory. grad_weight and grad_bias are column sums over all
// rows: a second kernel sums tiles of rows into fp32 partials, a third sums the
// partials (the two-stage reduction of apex's fused LayerNorm, with no atomics, so
// the result does not depend on scheduling).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "ops.h"

namespace megabert {
namespace cuda {
namespace {

constexpr int kMaxHidden = 8192;
constexpr int kMaxThreads = 512;

// Packs a thread holds: 16 floats of each row it keeps, so 8192 = 512 threads x 16
// whatever the pack width, and the backward's two rows (32 floats) stay in registers
// (a thread has up to 128 at 512 threads a block).
template <int VEC>
constexpr int iters_for() {
  return 16 / VEC;
}

// Thread t holds elements (it * blockDim.x + t) * VEC + [0, VEC) for it < ITERS.
template <int VEC>
__device__ __forceinline__ int ln_col(int it) {
  return (it * blockDim.x + threadIdx.x) * VEC;
}

// The statistics follow the CPU kernel (csrc/cpu/row_kernels.h): the corrected
// two-pass algorithm, so that a row with a large mean keeps full precision.
template <typename T, int VEC, int ITERS = iters_for<VEC>()>
__global__ void __launch_bounds__(kMaxThreads)
    layer_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                          T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int h,
                          float eps) {
  __shared__ float scratch1[1][kWarpSize], scratch2[2][kWarpSize];
  const int64_t row = blockIdx.x;
  x += row * h;
  y += row * h;
  float v[ITERS][VEC];
  float sum[1] = {0.0f};
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = ln_col<VEC>(it);
    if (c < h) {
      load_pack<T, VEC>(x + c, v[it]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) sum[0] += v[it][i];
    }
  }
  block_sum(sum, scratch1);
  const float mean0 = sum[0] / h;
  float dev[2] = {0.0f, 0.0f};  // sum(d), sum(d * d) with d = x - mean0
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    if (ln_col<VEC>(it) < h) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        v[it][i] -= mean0;
        dev[0] += v[it][i];
        dev[1] += v[it][i] * v[it][i];
      }
    }
  }
  block_sum(dev, scratch2);
  const float shift = dev[0] / h;
  const float rstd = rsqrtf((dev[1] - dev[0] * shift) / h + eps);
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = ln_col<VEC>(it);
    if (c < h) {
      float wv[VEC], bv[VEC];
      load_pack<T, VEC>(w + c, wv);
      load_pack<T, VEC>(b + c, bv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[it][i] = (v[it][i] - shift) * rstd * wv[i] + bv[i];
      store_pack<T, VEC>(y + c, v[it]);
    }
  }
  if (threadIdx.x == 0) {
    mean_out[row] = mean0 + shift;
    rstd_out[row] = rstd;
  }
}

// grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = grad_y * w. As on the
// CPU, xhat = (d - mean(d)) * rstd with d = x - saved mean, which undoes the rounding
// of the saved mean; one block reduction gives sum(d), sum(g) and sum(g * d). The
// row's mean(d) goes to `shift_out` for the grad_weight kernel.
template <typename T, int VEC, int ITERS = iters_for<VEC>()>
__global__ void __launch_bounds__(kMaxThreads)
    layer_norm_bwd_input_kernel(const T* __restrict__ grad_y, const T* __restrict__ x, const T* __restrict__ w,
                                const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                                T* __restrict__ grad_x, float* __restrict__ shift_out, int h) {
  __shared__ float scratch[3][kWarpSize];
  const int64_t row = blockIdx.x;
  grad_y += row * h;
  x += row * h;
  grad_x += row * h;
  const float mean = mean_in[row], rstd = rstd_in[row];
  float g[ITERS][VEC], d[ITERS][VEC];
  float sums[3] = {0.0f, 0.0f, 0.0f};  // sum(d), sum(g), sum(g * d)
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = ln_col<VEC>(it);
    if (c < h) {
      float wv[VEC];
      load_pack<T, VEC>(grad_y + c, g[it]);
      load_pack<T, VEC>(x + c, d[it]);
      load_pack<T, VEC>(w + c, wv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        d[it][i] -= mean;
        g[it][i] *= wv[i];
        sums[0] += d[it][i];
        sums[1] += g[it][i];
        sums[2] += g[it][i] * d[it][i];
      }
    }
  }
  block_sum(sums, scratch);
  const float shift = sums[0] / h, mean_g = sums[1] / h;
  const float mean_gxhat = (sums[2] - shift * sums[1]) * rstd / h;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = ln_col<VEC>(it);
    if (c < h) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float xhat = (d[it][i] - shift) * rstd;
        g[it][i] = rstd * (g[it][i] - mean_g - xhat * mean_gxhat);
      }
      store_pack<T, VEC>(grad_x + c, g[it]);
    }
  }
  if (threadIdx.x == 0) shift_out[row] = shift;
}

constexpr int kParamTileRows = 8;  // blockDim.y of the column-sum kernel

// partial_{w,b}[part, c] = sums over this part's rows of grad_y * xhat and grad_y.
// Block (32, 8): a warp reads 32 neighbouring columns of a row (coalesced).
template <typename T>
__global__ void layer_norm_bwd_params_partial_kernel(const T* __restrict__ grad_y, const T* __restrict__ x,
                                                     const float* __restrict__ mean_in,
                                                     const float* __restrict__ rstd_in,
                                                     const float* __restrict__ shift_in, float* __restrict__ partial_w,
                                                     float* __restrict__ partial_b, int64_t rows, int h,
                                                     int64_t rows_per_part) {
  __shared__ float tile_w[kParamTileRows][kWarpSize + 1], tile_b[kParamTileRows][kWarpSize + 1];
  const int c = blockIdx.x * kWarpSize + threadIdx.x;
  const int64_t part = blockIdx.y;
  const int64_t begin = part * rows_per_part;
  const int64_t end = begin + rows_per_part < rows ? begin + rows_per_part : rows;
  float acc_w = 0.0f, acc_b = 0.0f;
  if (c < h) {
    for (int64_t r = begin + threadIdx.y; r < end; r += kParamTileRows) {
      const float dy = static_cast<float>(grad_y[r * h + c]);
      acc_w += dy * ((static_cast<float>(x[r * h + c]) - mean_in[r]) - shift_in[r]) * rstd_in[r];
      acc_b += dy;
    }
  }
  tile_w[threadIdx.y][threadIdx.x] = acc_w;
  tile_b[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    for (int i = 1; i < kParamTileRows; ++i) {
      acc_w += tile_w[i][threadIdx.x];
      acc_b += tile_b[i][threadIdx.x];
    }
    partial_w[part * h + c] = acc_w;
    partial_b[part * h + c] = acc_b;
  }
}

template <typename T>
__global__ void layer_norm_bwd_params_final_kernel(const float* __restrict__ partial_w,
                                                   const float* __restrict__ partial_b, int64_t parts, int h,
                                                   T* __restrict__ grad_w, T* __restrict__ grad_b) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= h) return;
  float acc_w = 0.0f, acc_b = 0.0f;
  for (int64_t p = 0; p < parts; ++p) {
    acc_w += partial_w[p * h + c];
    acc_b += partial_b[p * h + c];
  }
  grad_w[c] = static_cast<T>(acc_w);
  grad_b[c] = static_cast<T>(acc_b);
}

// Threads per row: a multiple of a warp, iters_for<VEC>() packs each (more, shorter
// threads hide more memory latency; the register budget caps the length anyway).
template <int VEC>
int threads_for(int h) {
  const int packs = (h + VEC - 1) / VEC;
  const int threads = (packs + iters_for<VEC>() - 1) / iters_for<VEC>();
  return (threads + kWarpSize - 1) / kWarpSize * kWarpSize;  // <= kMaxThreads as h <= kMaxHidden
}

// Runs fn(integral_constant<int, VEC>) with the widest pack h and the pointers allow.
template <typename T, typename F>
void dispatch_pack(int h, std::initializer_list<const void*> ptrs, F&& fn) {
  constexpr int vec = max_pack<T>();
  bool packed = h % vec == 0;
  for (const void* p : ptrs) packed = packed && aligned_to(p, 16);
  if (packed) {
    fn(std::integral_constant<int, vec>{});
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

void check_tensor(const at::Tensor& t, const char* what, const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device(), what, " must be on ", like.device(), ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), what, " must be ", like.scalar_type(), ", got ",
              t.scalar_type());
}

int hidden_of(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 1, "layer_norm: input must be a CUDA tensor with a last dim");
  const int64_t h = x.size(-1);
  TORCH_CHECK(h <= kMaxHidden, "layer_norm: the CUDA kernel takes hidden sizes up to ", kMaxHidden, ", got ", h);
  return static_cast<int>(h);
}

}  // namespace

std::vector<at::Tensor> layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                           double eps) {
  const int h = hidden_of(x);
  check_tensor(x, "input", x);
  check_tensor(weight, "weight", x);
  check_tensor(bias, "bias", x);
  TORCH_CHECK(weight.numel() == h && bias.numel() == h, "weight and bias must be [", h, "]");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = h == 0 ? 0 : x.numel() / h;
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, mean, rstd};
  TORCH_CHECK(rows <= INT32_MAX, "layer_norm: more than 2^31 rows");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(x.scalar_type(), "layer_norm", [&](auto tag) {
    using T = decltype(tag);
    dispatch_pack<T>(h, {x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr()}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      layer_norm_fwd_kernel<T, VEC><<<static_cast<unsigned>(rows), threads_for<VEC>(h), 0, stream>>>(
          static_cast<const T*>(x.data_ptr()), static_cast<const T*>(weight.data_ptr()),
          static_cast<const T*>(bias.data_ptr()), static_cast<T*>(y.data_ptr()), mean.data_ptr<float>(),
          rstd.data_ptr<float>(), h, static_cast<float>(eps));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, mean, rstd};
}

std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& mean, const at::Tensor& rstd) {
  const int h = hidden_of(x);
  check_tensor(x, "input", x);
  check_tensor(grad_y, "output grad", x);
  check_tensor(weight, "weight", x);
  const int64_t rows = h == 0 ? 0 : x.numel() / h;
  TORCH_CHECK(grad_y.sizes() == x.sizes() && weight.numel() == h && mean.numel() == rows && rstd.numel() == rows,
              "layer_norm backward: grad, weight, mean or rstd do not match the input ", x.sizes());
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat, "mean and rstd must be float32");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor grad_x = at::empty_like(x);
  at::Tensor grad_w = at::empty_like(weight), grad_b = at::empty_like(weight);
  if (rows == 0) return {grad_x, grad_w.zero_(), grad_b.zero_()};
  TORCH_CHECK(rows <= INT32_MAX, "layer_norm: more than 2^31 rows");
  // About kParamBlocks blocks (a few waves on any current GPU), each part >= 64 rows.
  constexpr int64_t kParamBlocks = 1024;
  const int64_t col_blocks = (h + kWarpSize - 1) / kWarpSize;
  int64_t parts = (rows + 63) / 64;
  parts = parts < kParamBlocks / col_blocks + 1 ? parts : kParamBlocks / col_blocks + 1;
  const int64_t rows_per_part = (rows + parts - 1) / parts;
  parts = (rows + rows_per_part - 1) / rows_per_part;
  at::Tensor partial = at::empty({2, parts, h}, x.options().dtype(at::kFloat));
  at::Tensor shift = at::empty({rows}, x.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(x.scalar_type(), "layer_norm backward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_pack<T>(h, {grad_y.data_ptr(), x.data_ptr(), weight.data_ptr(), grad_x.data_ptr()}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      layer_norm_bwd_input_kernel<T, VEC><<<static_cast<unsigned>(rows), threads_for<VEC>(h), 0, stream>>>(
          static_cast<const T*>(grad_y.data_ptr()), static_cast<const T*>(x.data_ptr()),
          static_cast<const T*>(weight.data_ptr()), mean.data_ptr<float>(), rstd.data_ptr<float>(),
          static_cast<T*>(grad_x.data_ptr()), shift.data_ptr<float>(), h);
    });
    float* partial_w = partial.data_ptr<float>();
    float* partial_b = partial_w + parts * h;
    layer_norm_bwd_params_partial_kernel<T>
        <<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(parts)), dim3(kWarpSize, kParamTileRows),
           0, stream>>>(static_cast<const T*>(grad_y.data_ptr()), static_cast<const T*>(x.data_ptr()),
                        mean.data_ptr<float>(), rstd.data_ptr<float>(), shift.data_ptr<float>(), partial_w,
                        partial_b, rows, h, rows_per_part);
    layer_norm_bwd_params_final_kernel<T><<<static_cast<unsigned>((h + 255) / 256), 256, 0, stream>>>(
        partial_w, partial_b, parts, h, static_cast<T*>(grad_w.data_ptr()), static_cast<T*>(grad_b.data_ptr()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {grad_x, grad_w, grad_b};
}

}  // namespace cuda
}  // namespace megabert
