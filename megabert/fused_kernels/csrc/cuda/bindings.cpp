// pybind11 module megabert.fused_kernels._cuda, built by setup.py only where torch has
// CUDA and nvcc is found.
#include <cuda_runtime_api.h>

#include "../bind_kernel_ops.h"
#include "ops.h"

namespace megabert {
namespace cuda {

const KernelOps& kernel_ops() {
  // No LayerNorm on CUDA (ops.h says why): PyTorch's runs there.
  static const KernelOps ops{&scaled_masked_softmax_forward, &scaled_masked_softmax_backward, nullptr, nullptr};
  return ops;
}

}  // namespace cuda
}  // namespace megabert

namespace {

// Peak DRAM bandwidth of a device in GB/s from its memory clock and bus width (DDR:
// two transfers a clock), for bench/kernels.py to put achieved GB/s against.
double memory_bandwidth_gbs(int device) {
  int clock_khz = 0, bus_bits = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
                  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) == cudaSuccess,
              "could not read the memory clock or bus width of CUDA device ", device);
  return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megabert fused softmax (warp per row) kernels for CUDA";
  megabert::def_kernel_ops(m, megabert::cuda::kernel_ops());
  m.def("memory_bandwidth_gbs", &memory_bandwidth_gbs, "Peak DRAM bandwidth of a CUDA device in GB/s",
        pybind11::arg("device"));
}
