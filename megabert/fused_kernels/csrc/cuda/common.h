// Shared pieces of the CUDA kernels: element packs for vector loads, warp and block
// reductions, and the dtype switch (fp32, fp16, bf16; the math is always fp32).
// Device code, included by the .cu files only; named .h (not .cuh) because the
// Makefile rebuilds on changes to *.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace megabert {
namespace cuda {

constexpr int kWarpSize = 32;

// N elements loaded or stored with one instruction (16 bytes at most: LDG.128).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_pack(const T* p, float (&out)[N]) {
  const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = static_cast<float>(pack.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const float (&in)[N]) {
  Pack<T, N> pack;
#pragma unroll
  for (int i = 0; i < N; ++i) pack.v[i] = static_cast<T>(in[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

// Elements per 16-byte pack: 4 for fp32, 8 for fp16/bf16.
template <typename T>
constexpr int max_pack() {
  return 16 / static_cast<int>(sizeof(T));
}

inline bool aligned_to(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// N sums over the block (blockDim.x a multiple of 32, at most 1024) in one pass of
// barriers, returned to every thread in place. The leading barrier lets callers reuse
// `scratch` from a previous call.
template <int N>
__device__ __forceinline__ void block_sum(float (&v)[N], float (&scratch)[N][kWarpSize]) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) scratch[i][warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(lane < warps ? scratch[i][lane] : 0.0f);
}

// Runs fn(T{}) with T the element type of `dtype` (float, at::Half or at::BFloat16).
template <typename F>
void dispatch_float_types(at::ScalarType dtype, const char* what, F&& fn) {
  switch (dtype) {
    case at::kFloat:
      fn(float{});
      break;
    case at::kHalf:
      fn(at::Half{});
      break;
    case at::kBFloat16:
      fn(at::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, what, ": the CUDA kernel takes float32, float16 or bfloat16, got ", dtype);
  }
}

}  // namespace cuda
}  // namespace megabert
