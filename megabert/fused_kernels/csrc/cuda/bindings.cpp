// pybind11 module megabert.fused_kernels._cuda, built by setup.py only where torch has
// CUDA and nvcc is found.
#include <cuda_runtime_api.h>
#include <torch/python.h>

#include "ops.h"

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
  namespace cuda = megabert::cuda;
  m.doc() = "megabert fused softmax (warp per row) and LayerNorm (block per row) kernels for CUDA";
  m.def("scaled_masked_softmax_forward", &cuda::scaled_masked_softmax_forward, "softmax(scale * scores), masked",
        py::arg("scores"), py::arg("mask"), py::arg("scale"));
  m.def("scaled_masked_softmax_backward", &cuda::scaled_masked_softmax_backward, "grad of the scores",
        py::arg("grad_probs"), py::arg("probs"), py::arg("scale"));
  m.def("layer_norm_forward", &cuda::layer_norm_forward, "LayerNorm over the last dim -> (y, mean, rstd)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"));
  m.def("layer_norm_backward", &cuda::layer_norm_backward, "-> (grad_x, grad_weight, grad_bias)", py::arg("grad_y"),
        py::arg("x"), py::arg("weight"), py::arg("mean"), py::arg("rstd"));
  m.def("memory_bandwidth_gbs", &memory_bandwidth_gbs, "Peak DRAM bandwidth of a CUDA device in GB/s",
        py::arg("device"));
}
